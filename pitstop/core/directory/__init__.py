"""A checkpoint directory: its identity and index, names, retention records, recovery."""
