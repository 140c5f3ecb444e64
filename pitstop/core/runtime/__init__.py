"""A manager's life in its process: signals, resources and close, ranks' coordination, the supervisor."""
