"""The torch plugin's distributed coordinator: the ``torch.distributed`` job this process is a
rank of, found without initializing anything (core asks it through the plugin record)."""

from __future__ import annotations

import sys
from typing import Any


def ambient_coordinator() -> Any:
    """A :class:`ProcessGroupCoordinator` when ``torch.distributed`` is initialized with
    several ranks; None otherwise."""
    td = sys.modules.get("torch.distributed")
    if td is not None and td.is_available() and td.is_initialized() and \
            td.get_world_size() > 1:
        from pitstop.adapters.torch.distributed import ProcessGroupCoordinator
        return ProcessGroupCoordinator()
    return None


def ambient_rank() -> tuple[int, int] | None:
    """``(rank, ranks)`` in the initialized ``torch.distributed`` job; None without one."""
    td = sys.modules.get("torch.distributed")
    if td is not None and td.is_available() and td.is_initialized():
        return td.get_rank(), td.get_world_size()
    return None
