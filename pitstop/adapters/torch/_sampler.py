"""Data progress that survives a restart: which epoch, how far into its shuffled order.

:class:`ResumableSampler` shuffles like ``DistributedSampler`` (a permutation seeded by
``seed + epoch``, so the order is a pure function of the two and needs no saved generator)
and starts each iteration at its saved position.

:class:`ResumableLoader` is a ``DataLoader`` that counts the batches the *training loop*
took. With ``num_workers > 0`` the workers pull indices from the sampler ahead of the loop
(``prefetch_factor`` batches per worker), so "how far the sampler was iterated" overstates
progress; the loader's count is what gets saved. It also fixes a drift of the plain
``DataLoader``: each ``iter(loader)`` draws the workers' base seed from the *global* torch
generator, so a resumed run (which creates one more iterator mid-epoch) would see different
dropout masks from then on. The loader draws that seed from its own generator, re-seeded
from ``(seed, epoch)`` before each epoch, so worker seeds are the same after a resume and
the global generator is never touched. Its worker processes leave SIGTERM and SIGINT to the
training process (see ``_workers``), so a signal to the whole job is saved, not fatal.

A bare ``ResumableSampler`` under a ``DataLoader`` with worker processes cannot be exact;
it notices the prefetching iterator when an epoch starts and says so (``caveats``), naming
``ResumableLoader`` as the fix.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Iterator, Mapping, Sized
from types import FrameType
from typing import Any

import torch
from torch.utils.data import Sampler

from pitstop.core.errors import IncompatibleTargetError

log = logging.getLogger("pitstop")

#: how many callers up from a sampler's ``__iter__`` to look for the DataLoader iterator
#: (the sampler <- BatchSampler.__iter__ (<- its list comprehension) <- _next_index)
_CALLER_DEPTH = 8

_MASK = (1 << 63) - 1


def mix_epoch(seed: int, epoch: int) -> int:
    """A 63-bit seed for the loader's base-seed generator, distinct from ``seed + epoch``."""
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK
    x ^= x >> 31
    return (x * 0xD6E8FEB86659FD93) & _MASK


class ResumableSampler(Sampler[int]):
    """A (distributed) shuffling sampler whose ``state_dict`` is ``(seed, epoch, position)``.

    ``position`` is the number of this rank's indices of the current epoch already consumed.
    Iterating it directly (a ``DataLoader`` with ``num_workers=0``) counts the indices handed
    out, which is exact there; with worker processes use :class:`ResumableLoader`, which
    counts the batches the training loop consumed instead (in the checkpointed state, a
    sampler under a prefetching ``DataLoader`` is reported at the first save).

    The epoch advances by itself when one is used up; ``set_epoch(e)`` (the
    ``DistributedSampler`` call) is also accepted and keeps the position when ``e`` is the
    current epoch, so ``for epoch in range(sampler.epoch, n): sampler.set_epoch(epoch)``
    resumes mid-epoch. ``set_epoch(e)`` for the epoch it has just used up (and moved on
    from by itself, nothing of ``e + 1`` taken yet) leaves ``e`` used up: iterating yields
    nothing for it, so a loop whose epoch counter was saved before it moved on goes on with
    ``e + 1`` instead of repeating ``e``.
    """

    def __init__(self, data_source: Sized | int, *, shuffle: bool = True, seed: int = 0,
                 num_replicas: int = 1, rank: int = 0, drop_last: bool = False) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        self.dataset_len = data_source if isinstance(data_source, int) else len(data_source)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.num_replicas = num_replicas
        self.rank = rank
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0
        #: the epoch used up last when the sampler moved on to the next by itself (None
        #: once anything else moved it): ``set_epoch`` of it does not start it over
        self.completed: int | None = None
        #: bumped by load_state_dict when the position changes, so that a running
        #: ResumableLoader iterator starts over from the restored position
        self.generation = 0
        #: set by ResumableLoader: it, not iteration, advances ``position``
        self._tracked = False
        #: what iterates this sampler ahead of the training loop, as last seen (see caveats)
        self._prefetched_by: str | None = None

    @property
    def num_samples(self) -> int:
        """Indices per epoch on this rank."""
        n, r = self.dataset_len, self.num_replicas
        return n // r if self.drop_last else math.ceil(n / r)

    def __len__(self) -> int:
        return self.num_samples

    def order(self, epoch: int | None = None) -> list[int]:
        """This rank's indices of ``epoch`` (default: the current one), in order."""
        epoch = self.epoch if epoch is None else epoch
        n = self.dataset_len
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            idx = torch.randperm(n, generator=g).tolist()
        else:
            idx = list(range(n))
        total = self.num_samples * self.num_replicas
        if total > n:  # pad by repeating, as DistributedSampler does
            idx += (idx * math.ceil((total - n) / max(n, 1)))[: total - n]
        else:
            idx = idx[:total]
        return idx[self.rank:total:self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        if self.position >= self.num_samples:
            # an epoch used up already (set_epoch of the epoch just completed): nothing
            # for it; the next iteration starts the next epoch
            self._next_epoch()
            return
        order = self.order()
        start = self.position
        if self._tracked:
            yield from order[start:]
            return
        # the body runs at the first next(): our caller is what draws the indices
        self._prefetched_by = _prefetching_caller(sys._getframe(1))
        for i in range(start, len(order)):
            self._consume(1)
            yield order[i]

    def _consume(self, n: int, drop_tail: int = 0) -> None:
        """``n`` more indices used; at the end of the epoch (or with fewer than ``drop_tail``
        left, which a ``drop_last`` batching would drop) move to the next one."""
        self.position = min(self.position + n, self.num_samples)
        left = self.num_samples - self.position
        if left == 0 or left < drop_tail:
            self._next_epoch()

    def _next_epoch(self) -> None:
        self.completed = self.epoch
        self.epoch += 1
        self.position = 0

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (from its beginning), unless it is the current one (the position
        is kept) or the one just used up (it stays used up: see the class docstring)."""
        epoch = int(epoch)
        if epoch == self.epoch:
            return
        if (self.completed is not None and epoch == self.completed
                and self.epoch == epoch + 1 and self.position == 0):
            self.epoch, self.position = epoch, self.num_samples
            return
        self.epoch, self.position, self.completed = epoch, 0, None

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position,
                "shuffle": self.shuffle, "dataset_len": self.dataset_len,
                "num_replicas": self.num_replicas, "rank": self.rank,
                "drop_last": self.drop_last, "completed_epoch": self.completed}

    def caveats(self) -> list[str]:
        """Why the saved position may not be exact, with the fix (empty when it is exact)."""
        if self._tracked or self._prefetched_by is None:
            return []
        return [
            f"this ResumableSampler is iterated by {self._prefetched_by}, whose worker "
            "processes take indices ahead of the training loop (prefetch): the saved position "
            "runs ahead of the batches trained on, and a resumed run would skip those. Use "
            "pitstop.adapters.torch.ResumableLoader (DataLoader's arguments; pass this "
            "sampler as sampler=) and put the loader in the state instead: it counts the "
            "batches the loop took."]

    def check_state(self, state: Any) -> None:
        """Raise :class:`pitstop.IncompatibleTargetError` when ``state`` cannot be loaded:
        not a sampler state, or saved over a dataset of another length."""
        needed = ("seed", "epoch", "position", "shuffle", "dataset_len")
        if not isinstance(state, Mapping) or any(k not in state for k in needed):
            have = sorted(map(str, state)) if isinstance(state, Mapping) else type(state).__name__
            raise IncompatibleTargetError(
                f"the checkpoint's entry is not a ResumableSampler/ResumableLoader state "
                f"(needs {list(needed)}, found {have}); restore it into the kind of object "
                "that saved it")
        if int(state["dataset_len"]) != self.dataset_len:
            raise IncompatibleTargetError(
                f"the checkpoint's sampler ran over {state['dataset_len']} samples, this dataset "
                f"has {self.dataset_len}: its saved position would point at other samples. "
                "Resume with the same dataset, or leave the sampler/loader out of the state "
                "(restore with strict=False, then call set_epoch) to start the epoch over.")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        before = (self.seed, self.shuffle, self.epoch, self.position)
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        self.epoch = int(state["epoch"])
        position = int(state["position"])
        if "completed_epoch" in state:
            done = state["completed_epoch"]
            self.completed = None if done is None else int(done)
        else:
            # saved before "completed_epoch" existed: at the start of an epoch after the
            # first, the sampler had (almost always) moved on from the one before by itself
            self.completed = self.epoch - 1 if position == 0 and self.epoch > 0 else None
        old = int(state.get("num_replicas", 1))
        if old != self.num_replicas:
            # elastic restart: keep the global count of consumed samples
            position = position * old // self.num_replicas
            log.warning("pitstop: sampler saved with %d replicas, resumed with %d: continuing "
                        "after about %d samples of epoch %d", old, self.num_replicas,
                        position * self.num_replicas, self.epoch)
        self.position = min(position, self.num_samples)
        if (self.seed, self.shuffle, self.epoch, self.position) != before:
            self.generation += 1


def _prefetching_caller(frame: FrameType | None) -> str | None:
    """``"a DataLoader with num_workers=2"`` when a DataLoader iterator whose workers draw
    indices ahead of the loop is among the first callers of ``frame``, else None."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    for _ in range(_CALLER_DEPTH):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, _BaseDataLoaderIter):
            workers = int(getattr(owner, "_num_workers", 0) or 0)
            if workers <= 0:
                return None  # one process: indices are drawn when the loop asks for a batch
            return f"a DataLoader with num_workers={workers}"
        frame = frame.f_back
    return None
