"""Randomness inside DataLoader worker processes that repeats after a resume.

A plain worker seeds torch, ``random`` and NumPy once (``base_seed + worker_id``) and its
generators then advance with every sample it loads. A run resumed mid-epoch starts new
workers at that seed, so an augmentation drawn in ``__getitem__`` would differ from the
uninterrupted run's. :class:`~pitstop.adapters.torch.ResumableLoader` instead tags every
batch of indices it hands to the workers with a seed that is a function of ``(seed, epoch,
batch number)``; the worker's fetch (patched in the worker process only, by
:func:`install`, from the loader's ``worker_init_fn``) seeds the three global generators
with it before loading the batch. For an ``IterableDataset`` the seed is a function of the
worker's seed and the number of batches that worker produced, and each batch comes back
with the dataset copy's ``state_dict()`` taken right after it (:class:`Stamped`), so that
the loader can save each worker's state after the last batch the *loop* took.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

_MASK = (1 << 63) - 1


def mix(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 steps; distinct inputs, distinct streams)."""
    x = 0x94D049BB133111EB
    for p in parts:
        x = (x ^ (int(p) & _MASK)) * 0x9E3779B97F4A7C15 & _MASK
        x ^= x >> 31
        x = x * 0xBF58476D1CE4E5B9 & _MASK
        x ^= x >> 29
    return x


def seed_globals(seed: int) -> None:
    """Seed torch's CPU generator, ``random`` and NumPy's legacy global generator."""
    random.seed(seed)
    torch.manual_seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % (1 << 32))


class SeededBatch(list):  # type: ignore[type-arg]
    """A batch of indices and the seed its worker loads it with."""

    def __init__(self, items: Any, seed: int) -> None:
        super().__init__(items)
        self.pitstop_seed = seed

    def __reduce__(self) -> Any:
        return SeededBatch, (list(self), self.pitstop_seed)


class SeededIndex(int):
    """One index (``batch_size=None``) and the seed its worker loads it with."""

    pitstop_seed: int

    def __new__(cls, value: int, seed: int) -> SeededIndex:
        obj = super().__new__(cls, value)
        obj.pitstop_seed = seed
        return obj

    def __reduce__(self) -> Any:
        return SeededIndex, (int(self), self.pitstop_seed)


def tag(index: Any, seed: int) -> Any:
    """``index`` (a list of indices or one index) carrying ``seed`` to the worker."""
    if isinstance(index, list):
        return SeededBatch(index, seed)
    if isinstance(index, int) and not isinstance(index, bool):
        return SeededIndex(index, seed)
    return index  # another kind of index (a user's batch_sampler yielding tuples...): as is


class Stamped:
    """A batch of an ``IterableDataset`` worker, with that worker's id, the number of
    batches it produced so far this epoch, and its dataset's ``state_dict()`` after it."""

    __slots__ = ("data", "worker", "count", "state")

    def __init__(self, data: Any, worker: int, count: int, state: Any) -> None:
        self.data, self.worker, self.count, self.state = data, worker, count, state

    def pin_memory(self, device: Any = None) -> Stamped:
        from torch.utils.data._utils.pin_memory import pin_memory
        return Stamped(pin_memory(self.data, device), self.worker, self.count, self.state)


#: this worker process's stream bookkeeping: batches produced, and whether the fetcher
#: to be created next is the first (it keeps the count restored by install)
_stream: dict[str, Any] = {"count": 0, "first": True}


def install(resume: dict[str, Any] | None) -> None:
    """In a worker process (from the loader's ``worker_init_fn``): seed every batch as
    tagged, stamp an ``IterableDataset``'s batches with its state, and restore this worker's
    saved state (``resume``: worker id -> ``{"count", "state"}``) before iteration starts."""
    from torch.utils.data import get_worker_info
    from torch.utils.data._utils import fetch

    from pitstop.adapters.torch._values_codec import decode, encode

    info = get_worker_info()
    if info is None:
        return
    mine = (resume or {}).get(str(info.id))
    _stream.update(count=0, first=True)
    if mine is not None:
        info.dataset.load_state_dict(decode(mine["state"]))
        _stream["count"] = int(mine["count"])
    cls = fetch._MapDatasetFetcher
    if not getattr(cls.fetch, "pitstop", False):
        map_fetch = cls.fetch

        def seeded(self: Any, index: Any) -> Any:
            seed = getattr(index, "pitstop_seed", None)
            if seed is not None:
                seed_globals(seed)
            return map_fetch(self, index)

        seeded.pitstop = True  # type: ignore[attr-defined]
        cls.fetch = seeded  # type: ignore[method-assign]
    it_cls = fetch._IterableDatasetFetcher
    if getattr(it_cls.fetch, "pitstop", False):
        return
    it_init, it_fetch = it_cls.__init__, it_cls.fetch

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        if not _stream["first"]:
            _stream["count"] = 0  # a new epoch of persistent workers
        _stream["first"] = False
        it_init(self, *args, **kwargs)

    def stamped(self: Any, index: Any) -> Any:
        w = get_worker_info()
        seed_globals(mix(w.seed, _stream["count"]))
        data = it_fetch(self, index)
        _stream["count"] += 1
        state = self.dataset.state_dict() if hasattr(self.dataset, "state_dict") else None
        return Stamped(data, w.id, _stream["count"], encode(state))

    stamped.pitstop = True  # type: ignore[attr-defined]
    it_cls.__init__ = init  # type: ignore[method-assign]
    it_cls.fetch = stamped  # type: ignore[method-assign]
