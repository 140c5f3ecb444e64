"""Restoring: the plan checked before any byte is written, the verified read, the apply."""
