"""What the converters of every foreign format share: reading one pitstop step as a plain
tree, writing an exported file atomically, and saving an imported tree as a committed step."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from pitstop.core.errors import CheckpointNotFoundError, CheckpointWriteError, StepExistsError
from pitstop.core.manager import CheckpointManager, DirectoryReader
from pitstop.core.tree import select

PathLike = str | os.PathLike[str]


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


def write_import(state: Any, directory: PathLike, step: int,
                 metrics: Mapping[str, Any] | None, encryption: Any = None) -> int:
    """Save ``state`` (numpy + values) as committed step ``step``; returns the step.
    ``encryption``: the key of an encrypted directory (:func:`refuse_existing` finds it)."""
    # not ``with CheckpointManager(...)``: its __exit__ reports an exception as one "during
    # training", which an import is not
    mgr = CheckpointManager(directory, async_save=False, save_on_signals=None,
                            memory_tier=False, encryption=encryption)
    try:
        mgr.save(step, state, metrics).wait()
    finally:
        mgr.close()
    return step


def refuse_existing(directory: PathLike, step: int) -> Any:
    """Raise StepExistsError before reading a (possibly large) file to import; returns the
    key of an encrypted directory (from PITSTOP_ENCRYPTION_KEY, as a reader takes it; None
    for a plaintext one), so the import is encrypted like the directory's checkpoints."""
    mgr = CheckpointManager(directory, read_only=True, save_on_signals=None)
    try:
        exists = step in mgr.all_steps()
        where = mgr.directory
        key = mgr.encryption
    finally:
        mgr.close()
    if exists:
        raise StepExistsError(
            f"{where} already has a checkpoint of step {step}; pitstop never overwrites one. "
            "Import under another step (step=...) or into another directory, or delete that "
            "checkpoint first.")
    return key
