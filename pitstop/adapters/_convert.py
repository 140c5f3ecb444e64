"""What the export helpers of every framework share (torch.save / safetensors, Orbax)."""

from __future__ import annotations

import os
from typing import Any

from ..core.errors import CheckpointNotFoundError
from ..core.manager import CheckpointManager
from ..core.tree import select


def read_step(directory: str | os.PathLike[str], step: int | None, key: str | None
              ) -> tuple[int, Any]:
    """``(step, tree)``: pitstop step ``step`` of ``directory`` (the newest for None) as a
    plain tree, or its subtree at key path ``key``; read without taking the writer's lock."""
    mgr = CheckpointManager(directory, read_only=True, save_on_signals=None)
    try:
        if step is None:
            step = mgr.latest_step()
            if step is None:
                raise CheckpointNotFoundError(f"no checkpoint in {mgr.directory} to export")
        tree = mgr.load(step)
    finally:
        mgr.close()
    return step, select(tree, key, f"step {step} in {directory}")
