"""The JAX plugin's distributed coordinator: the ``jax.distributed`` job this process is a
process of, read from JAX's distributed runtime state (core asks it through the plugin)."""

from __future__ import annotations

import sys
from typing import Any


def _client_state() -> Any:
    """JAX's distributed runtime state once ``jax.distributed.initialize`` ran, else None
    (nothing is imported to find out)."""
    jd = sys.modules.get("jax._src.distributed")
    if jd is not None and getattr(getattr(jd, "global_state", None), "client", None) is not None:
        return jd.global_state
    return None


def ambient_coordinator() -> Any:
    """A :class:`JaxCoordinator` in a job of several processes; None otherwise."""
    if _client_state() is not None:
        from pitstop.adapters.jax.distributed import JaxCoordinator
        coord = JaxCoordinator()
        return coord if coord.world_size > 1 else None
    return None


def ambient_rank() -> tuple[int, int] | None:
    """``(process_id, num_processes)`` of the initialized JAX job; None without one."""
    state = _client_state()
    if state is not None:
        return int(state.process_id), int(state.num_processes)
    return None
