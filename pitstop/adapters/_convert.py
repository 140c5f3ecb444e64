"""What the export helpers of every framework share (torch.save / safetensors, Orbax)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

from pitstop.core.errors import CheckpointNotFoundError, CheckpointWriteError
from pitstop.core.manager import DirectoryReader
from pitstop.core.tree import select


def read_step(directory: str | os.PathLike[str], step: int | None, key: str | None
              ) -> tuple[int, Any]:
    """``(step, tree)``: pitstop step ``step`` of ``directory`` (the newest for None) as a
    plain tree, or its subtree at key path ``key``; read without taking the writer's lock."""
    mgr = DirectoryReader(directory)
    try:
        if step is None:
            step = mgr.latest_step()
            if step is None:
                raise CheckpointNotFoundError(f"no checkpoint in {mgr.directory} to export")
        tree = mgr.load(step)
    finally:
        mgr.close()
    return step, select(tree, key, f"step {step} in {directory}")


def atomic_write(path: str | os.PathLike[str], write: Callable[[str], None]) -> None:
    """Write an exported file through a temporary file in the same folder (``write(tmp)``),
    fsync it and rename it into place: a crash leaves the old file or none, never half of
    one. An OSError becomes a :class:`pitstop.CheckpointWriteError` naming ``path``."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".pitstop-export-")
    except OSError as e:
        raise CheckpointWriteError(f"{path}: cannot write there ({e.strerror or e}); check the "
                                   "folder and your permissions", path=path) from e
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise CheckpointWriteError(f"{path}: cannot write it ({e.strerror or e})",
                                       path=path) from e
        raise
