"""Saving: the snapshot into staging memory, the lazy copy, the persist pipeline, skips, the memory tier."""
