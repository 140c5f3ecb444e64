"""Committing the saves whose in-memory snapshot outlived their writer (a SIGKILL after
``save()`` returned), for a face that opens a directory read-only first (tf.train's
``CheckpointManager``): a reader does not recover them, a writer does."""

from __future__ import annotations

from typing import Any

from pitstop.core.errors import CheckpointError
from pitstop.core.manager import CheckpointManager
from pitstop.core.save import memtier as memtier_mod
from pitstop.core.save.memtier import MemoryTier


def persist_survivors(reader: CheckpointManager, directory: str, **options: Any) -> bool:
    """Commit the saves of ``directory`` whose snapshot survived their writer in the memory
    tier; True when there were some. ``reader`` is a manager open on ``directory``;
    ``options`` are the keywords of the writer opened for it (its retention, say), opened
    only when there are saves to commit. A directory a live writer holds (here or in another
    process) is left to it."""
    root = memtier_mod.default_root()
    if root is None or not reader.directory_id:
        return False
    steps = reader.all_steps()
    tier = MemoryTier(root, directory, reader.directory_id)
    try:
        waiting = [m for m, _buf in tier.candidates()
                   if tier.trusted(m, steps[-1] if steps else None) is None]
    except OSError:
        return False
    if not waiting:
        return False
    try:
        writer = CheckpointManager(directory, **options)
    except CheckpointError:  # DirectoryLockedError: its live writer recovers them
        return False
    try:
        recovered = bool(writer.recovered_steps)
        writer.wait()
    finally:
        writer.close()
    return recovered
