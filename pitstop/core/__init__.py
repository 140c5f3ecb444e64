"""Framework-neutral core: format, storage, snapshot engine, policies, manager."""
