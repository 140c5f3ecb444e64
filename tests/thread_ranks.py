"""Ranks as threads of this process, joined by an in-memory coordinator: the core's
multi-rank protocol without processes (the real coordinators, on torch.distributed and JAX,
are tested with real processes in tests/adapters/torch/test_distributed.py and
tests/adapters/jax/test_multiprocess.py)."""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pitstop.core.runtime.coordination import CoordinationError, Coordinator


class Hub:
    """What the threads of one "job" share: each exchange's answers, by channel and round."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.cond = threading.Condition()
        self.rounds: dict[tuple[str, int], dict[int, bytes]] = defaultdict(dict)


class ThreadCoordinator(Coordinator):
    def __init__(self, hub: Hub, rank: int, timeout_s: float = 20.0) -> None:
        self.hub, self.rank, self.world_size, self.timeout_s = hub, rank, hub.n, timeout_s
        self.seq = {"control": 0, "persist": 0}

    def all_gather(self, data: bytes, *, what: str, channel: str = "control") -> list[bytes]:
        key = (channel, self.seq[channel])
        self.seq[channel] += 1
        hub = self.hub
        with hub.cond:
            hub.rounds[key][self.rank] = data
            hub.cond.notify_all()
            if not hub.cond.wait_for(lambda: len(hub.rounds[key]) == hub.n, self.timeout_s):
                raise CoordinationError(f"{what}: rank {self.rank} timed out")
            return [hub.rounds[key][r] for r in range(hub.n)]


def ranks(n: int, fn: Any) -> list[Any]:
    """``fn(rank, coordinator)`` on ``n`` threads of one job; their results, rank order."""
    hub = Hub(n)
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(fn, r, ThreadCoordinator(hub, r)) for r in range(n)]
        return [f.result(timeout=60) for f in futures]
