"""The training loop's position over any sampler or batch_sampler (``ResumableLoader``).

A sampler other than :class:`ResumableSampler` (``RandomSampler``, ``WeightedRandomSampler``,
``SubsetRandomSampler``, ``DistributedSampler``, a ``BatchSampler`` over any of them, a
user's bucketing batch sampler) has no position of its own that survives a restart, and
with worker processes it is iterated ahead of the loop. :class:`SamplerOrder` keeps:

- ``epoch`` and ``position`` (batches the *loop* took this epoch: what it hands out counts,
  what workers prefetched does not);
- ``start``: what the sampler's order depends on, taken just before the epoch's first draw
  (its own ``state_dict()`` when it has one; otherwise its ``generator``'s state and an
  integer ``epoch`` attribute, for every nested ``sampler``/``batch_sampler``).

The sampler is drawn from with torch's, Python's and NumPy's global generators set to a
private stream seeded from ``(seed, epoch)`` (and put back after every draw): a sampler
that draws from the global generator (``RandomSampler`` without a generator,
``WeightedRandomSampler``) gets the same order after a resume, and the training loop's
own random stream is never touched. A resume loads ``start`` into the sampler and draws
(without loading any data) the ``position`` batches the loop had taken: index generation
only, about a second per 30 million indices.
"""

from __future__ import annotations

import random
import sys
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import Sampler

from pitstop.adapters.torch._fetch import mix, seed_globals, tag
from pitstop.adapters.torch._values_codec import decode, encode
from pitstop.core.errors import IncompatibleTargetError

_NESTED = ("sampler", "batch_sampler")


def source_state(obj: Any, depth: int = 0) -> dict[str, Any]:
    """What ``obj``'s next iteration order depends on, as plain values."""
    if callable(getattr(obj, "state_dict", None)) and callable(
            getattr(obj, "load_state_dict", None)):
        return {"state_dict": encode(obj.state_dict())}
    out: dict[str, Any] = {}
    g = getattr(obj, "generator", None)
    if isinstance(g, torch.Generator):
        out["generator"] = g.get_state().numpy().tobytes()
    epoch = getattr(obj, "epoch", None)
    if isinstance(epoch, int) and not isinstance(epoch, bool):
        out["epoch"] = epoch
    if depth < 4:
        for name in _NESTED:
            inner = getattr(obj, name, None)
            if inner is not None and inner is not obj:
                out[name] = source_state(inner, depth + 1)
    return out


def load_source_state(obj: Any, state: Mapping[str, Any], depth: int = 0) -> None:
    """Put ``state`` (from :func:`source_state`) back into ``obj``."""
    if "state_dict" in state:
        obj.load_state_dict(decode(state["state_dict"]))
        return
    g = getattr(obj, "generator", None)
    if "generator" in state and isinstance(g, torch.Generator):
        g.set_state(torch.frombuffer(bytearray(state["generator"]), dtype=torch.uint8))
    if "epoch" in state:
        obj.epoch = int(state["epoch"])
    for name in _NESTED:
        inner = getattr(obj, name, None)
        if name in state and inner is not None and depth < 4:
            load_source_state(inner, state[name], depth + 1)


def describe(obj: Any) -> str:
    """``"BatchSampler(RandomSampler)"``: the kinds of sampler a loader iterates."""
    name = type(obj).__name__
    inner = getattr(obj, "sampler", None)
    return f"{name}({describe(inner)})" if isinstance(inner, Sampler) else name


def _epoch_attr(state: Mapping[str, Any] | None) -> Any:
    """The first integer ``epoch`` attribute in a source state (a DistributedSampler's)."""
    while state:
        if "epoch" in state:
            return state["epoch"]
        state = state.get("sampler") or state.get("batch_sampler")
    return None


def _globals() -> tuple[Any, ...]:
    np = sys.modules.get("numpy")
    return (torch.get_rng_state(), random.getstate(),
            np.random.get_state() if np is not None else None)


def _set_globals(states: tuple[Any, ...]) -> None:
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    np = sys.modules.get("numpy")
    if np is not None and states[2] is not None:
        np.random.set_state(states[2])


class SamplerOrder:
    """Epoch, position and epoch-start state of the loop over ``source`` (the index
    sampler the DataLoader iterates: its batch_sampler, or its sampler without batching)."""

    kind = "sampler"

    def __init__(self, source: Any, seed: int, *, tag_seeds: bool,
                 dataset_len: int | None = None) -> None:
        self.source = source
        self.sampler_kind = describe(source)
        self.dataset_len = dataset_len
        self.seed = int(seed)
        self.tag_seeds = tag_seeds
        self.epoch = 0
        self.position = 0
        self.completed: int | None = None
        self.generation = 0
        #: the epoch's iteration yields nothing (set_epoch of the epoch just used up)
        self.used_up = False
        #: after a restore at an epoch boundary: the sampler's epoch attribute then
        self._boundary_attr: Any = None
        self._reset_draw()

    def _reset_draw(self) -> None:
        self.start: dict[str, Any] | None = None
        self._it: Iterator[Any] | None = None
        self._rng: tuple[Any, ...] | None = None
        self._buf: deque[Any] = deque()  # drawn, not yet taken by the loop
        self._exhausted = False

    # ------------------------------------------------------------------ drawing
    def _draw(self, n: int = 1) -> list[Any]:
        """The next ``n`` indices of the epoch (fewer at its end), drawn privately."""
        saved = _globals()
        try:
            if self._rng is None:
                seed_globals(mix(self.seed, self.epoch, 0x5EED))
            else:
                _set_globals(self._rng)
            if self._it is None:
                self.start = source_state(self.source)
                self._it = iter(self.source)
            out = []
            for _ in range(n):
                try:
                    out.append(next(self._it))
                except StopIteration:
                    self._exhausted = True
                    break
            return out
        finally:
            self._rng = _globals()
            _set_globals(saved)

    def _begin(self) -> None:
        """Start the epoch's draw, skipping what the loop took before a restore."""
        if self._it is None:
            self._draw(0)
            if self.position:
                skipped = self._draw(self.position)
                if len(skipped) < self.position:
                    self.position = len(skipped)  # the epoch ended before: it is used up

    def opening(self) -> bool:
        """Before an iterator starts: False when this iteration yields nothing."""
        if self.used_up:
            self.used_up = False
            return False
        if self._boundary_attr is not None:
            attr = _epoch_attr(source_state(self.source))
            was, self._boundary_attr = self._boundary_attr, None
            if attr == was:  # the idiom's sampler.set_epoch(e) for the epoch just done
                return False
        self._begin()
        if self._exhausted and not self._buf:
            self._next_epoch()
            return False
        return True

    def indices(self) -> Iterator[Any]:
        """What one DataLoader iterator draws: the batches after the loop's position."""
        epoch, generation, k = self.epoch, self.generation, self.position
        while epoch == self.epoch and generation == self.generation:
            i = k - self.position
            if i < 0:
                return  # (the loop took past what this iterator handed out)
            if i >= len(self._buf):
                more = self._draw(1) if not self._exhausted else []
                if not more:
                    return
                self._buf.extend(more)
            idx = self._buf[i]
            yield tag(idx, mix(self.seed, self.epoch, k)) if self.tag_seeds else idx
            k += 1

    def took(self, batch: Any) -> Any:
        if self._buf:
            self._buf.popleft()
        self.position += 1
        if not self._buf and not self._exhausted:
            self._buf.extend(self._draw(1))  # look ahead: is that the epoch's last?
        if self._exhausted and not self._buf:
            self._next_epoch()
        return batch

    def ended(self) -> None:
        """The DataLoader iterator ran out: ``took`` has moved on already, except after an
        epoch without any batch."""
        if self._it is not None and self._exhausted and not self._buf:
            self._next_epoch()

    def _next_epoch(self) -> None:
        self.completed = self.epoch
        self.epoch += 1
        self.position = 0
        self._reset_draw()

    # ------------------------------------------------------------------ epochs
    def set_epoch(self, epoch: int) -> None:
        epoch = int(epoch)
        inner = _set_epoch_target(self.source)
        if inner is not None:
            inner.set_epoch(epoch)
        self._boundary_attr = None
        if epoch == self.epoch:
            return
        if (self.completed == epoch and self.epoch == epoch + 1 and self.position == 0
                and self._it is None):
            self.used_up = True
            return
        self.epoch, self.position, self.completed = epoch, 0, None
        self._reset_draw()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        start = self.start if self.start is not None else source_state(self.source)
        return {"kind": self.kind, "seed": self.seed, "epoch": self.epoch,
                "position": self.position, "completed_epoch": self.completed,
                "sampler": self.sampler_kind, "dataset_len": self.dataset_len,
                "start": start}

    def check_state(self, state: Any) -> None:
        if not isinstance(state, Mapping) or state.get("kind") != self.kind or any(
                k not in state for k in ("seed", "epoch", "position", "start")):
            saved = (f"kind {state.get('kind', 'ResumableSampler')!r}"
                     if isinstance(state, Mapping) else type(state).__name__)
            raise IncompatibleTargetError(
                f"the checkpoint's entry is not the state of a ResumableLoader over a "
                f"sampler or batch_sampler (found {saved}); restore it into a loader built "
                "the way the saved one was (same sampler kind)")
        kind = state.get("sampler", self.sampler_kind)
        if kind != self.sampler_kind:
            raise IncompatibleTargetError(
                f"the checkpoint's loader iterated a {kind}, this one a {self.sampler_kind}: "
                "its saved position and sampler state mean nothing here. Build the loader "
                "with the same sampler as the saved run, or leave the loader out of the state "
                "(restore with strict=False) to start the epoch over.")
        saved = state.get("dataset_len")
        if saved is not None and self.dataset_len is not None and saved != self.dataset_len:
            raise IncompatibleTargetError(
                f"the checkpoint's loader ran over {saved} samples, this dataset has "
                f"{self.dataset_len}: its saved position would point at other samples. Resume "
                "with the same dataset, or leave the loader out of the state (restore with "
                "strict=False) to start the epoch over.")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.check_state(state)
        start = state["start"]
        try:
            load_source_state(self.source, start)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise IncompatibleTargetError(
                f"the checkpoint's sampler state does not fit this loader's "
                f"{type(self.source).__name__} ({e}); restore into a loader with the same "
                "sampler as the saved one") from e
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        done = state.get("completed_epoch")
        self.completed = None if done is None else int(done)
        self.used_up = False
        at_boundary = self.position == 0 and self.completed == self.epoch - 1
        self._boundary_attr = _epoch_attr(start) if at_boundary else None
        self._reset_draw()
        self.generation += 1


def _set_epoch_target(obj: Any) -> Any:
    """The sampler whose ``set_epoch`` a loader's ``set_epoch`` forwards to."""
    for _ in range(4):
        if obj is None:
            return None
        if callable(getattr(obj, "set_epoch", None)):
            return obj
        obj = getattr(obj, "sampler", None)
    return None
