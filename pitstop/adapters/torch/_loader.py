""":class:`ResumableLoader`: a ``DataLoader`` whose ``state_dict`` is where the loop is.

What the position is kept by depends on the data (each keeps the promises of the module
docstring of ``_sampler``: worker seeds fixed per ``(seed, epoch)`` without touching the
global generator, workers that leave SIGTERM/SIGINT to the main process, a restore during
a loop restarts the running iterator, every batch handed out counts):

- a :class:`ResumableSampler` (the default, ``shuffle=`` as in ``DataLoader``): its
  ``(seed, epoch, position)``, no replay at all;
- any other sampler or batch_sampler: ``_order.SamplerOrder`` (the sampler's state at the
  epoch's start, replayed as indices on resume);
- an ``IterableDataset`` with ``state_dict``: ``_stream.StreamProgress`` (per worker).

With worker processes every batch of indices carries a seed of ``(seed, epoch, batch)``
that the worker seeds its generators with before loading it (``_fetch``): random
augmentations in ``__getitem__`` repeat after a resume.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from pitstop.adapters.torch._fetch import mix, tag
from pitstop.adapters.torch._order import SamplerOrder
from pitstop.adapters.torch._sampler import ResumableSampler, mix_epoch
from pitstop.adapters.torch._stream import OffsetIter, StreamProgress, refuse_stateless
from pitstop.adapters.torch._workers import WorkerInit, start_workers


class _SamplerProgress:
    """The position of a :class:`ResumableSampler`, as the loader's progress."""

    kind = "ResumableSampler"

    def __init__(self, sampler: ResumableSampler, per_batch: int, drop_last: bool) -> None:
        self.sampler = sampler
        self.per_batch = per_batch
        self.drop_tail = per_batch if drop_last else 0

    seed = property(lambda self: self.sampler.seed)
    epoch = property(lambda self: self.sampler.epoch)
    position = property(lambda self: self.sampler.position)
    generation = property(lambda self: self.sampler.generation)

    def opening(self) -> bool:
        s = self.sampler
        if s.position >= s.num_samples:
            s._next_epoch()
            return False
        return True

    def took(self, batch: Any) -> Any:
        self.sampler._consume(self.per_batch, self.drop_tail)
        return batch

    def ended(self) -> None:
        pass

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def check_state(self, state: Any) -> None:
        self.sampler.check_state(state)

    def load_state_dict(self, state: Any) -> None:
        self.sampler.load_state_dict(state)


class _Tagged:
    """The index sampler of a ResumableSampler loader, each batch tagged with its seed."""

    def __init__(self, inner: Any, progress: _SamplerProgress) -> None:
        self.inner, self.progress = inner, progress

    def __iter__(self) -> Iterator[Any]:
        p = self.progress
        seed, epoch, k = p.seed, p.epoch, p.position // p.per_batch
        for i, idx in enumerate(self.inner):
            yield tag(idx, mix(seed, epoch, k + i))

    def __len__(self) -> int:
        return len(self.inner)


class _Indices:
    """The index sampler of a loader over any other sampler (``SamplerOrder.indices``)."""

    def __init__(self, order: SamplerOrder) -> None:
        self.order = order

    def __iter__(self) -> Iterator[Any]:
        return self.order.indices()

    def __len__(self) -> int:
        return len(self.order.source)


def _check_sampler(name: str, obj: Any) -> None:
    if obj is None or isinstance(obj, Sampler):
        return
    if name == "sampler":
        raise TypeError(
            f"sampler must be a torch.utils.data.Sampler (a ResumableSampler, RandomSampler, "
            f"DistributedSampler, your own Sampler subclass...), got {type(obj).__name__}: "
            "pitstop saves what a sampler's order depends on, which it cannot find in a "
            "plain iterable. Wrap a fixed list of indices as SubsetRandomSampler(...) or a "
            "Sampler subclass.")
    raise TypeError(
        f"batch_sampler must be a torch.utils.data.Sampler yielding lists of indices (e.g. "
        f"BatchSampler(sampler, batch_size, drop_last), or your Sampler subclass), got "
        f"{type(obj).__name__}; or pass batch_size (and sampler) instead")


class ResumableLoader(DataLoader):
    """A ``DataLoader`` whose ``state_dict`` is exactly where the training loop is.

    Same arguments as ``DataLoader`` plus ``seed`` (shuffle order and worker seeds). Put it
    in the checkpointed state; after ``restore`` the next ``iter(loader)`` yields the batch
    that would have come next, also with ``num_workers > 0``. ``sampler`` may be any
    ``Sampler`` (a :class:`ResumableSampler` needs no replay), ``batch_sampler`` any
    batch sampler, and the dataset an ``IterableDataset`` with ``state_dict()`` /
    ``load_state_dict()``. Iterating again after breaking out of a loop also continues
    where the loop stopped (every batch handed out counts, a peek with
    ``next(iter(loader))`` too), and a restore while a loop runs takes effect in that loop
    (its iterator starts over at the restored position). Its worker processes ignore a
    SIGTERM/SIGINT sent to the whole process group (the training process saves, then
    exits as the signal asks); ``worker_init_fn`` is wrapped for that and still called.
    """

    def __init__(self, dataset: Any, batch_size: int | None = 1, shuffle: bool = False, *,
                 seed: int = 0, sampler: Sampler[Any] | None = None,
                 drop_last: bool = False, generator: torch.Generator | None = None,
                 **kwargs: Any) -> None:
        batch_sampler = kwargs.get("batch_sampler")
        _check_sampler("sampler", sampler)
        _check_sampler("batch_sampler", batch_sampler)
        # dedicated generator for the workers' base seed (see the module docstring)
        self.seed_generator = generator if generator is not None else torch.Generator()
        workers = int(kwargs.get("num_workers", 0) or 0)
        if workers and kwargs.get("in_order") is False:
            raise ValueError(
                "ResumableLoader needs in_order=True with worker processes: with "
                "in_order=False batches reach the loop as workers finish them, so no count "
                "of batches taken says which ones were trained on. Drop in_order=False.")
        if isinstance(dataset, IterableDataset):
            refuse_stateless(dataset)
            super().__init__(dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
                             drop_last=drop_last, generator=self.seed_generator, **kwargs)
            self._progress: Any = StreamProgress(dataset, seed, workers)
            return
        if sampler is None and batch_sampler is None:
            sampler = ResumableSampler(dataset, shuffle=shuffle, seed=seed)
        elif shuffle:
            raise ValueError("pass shuffle to the sampler (a ResumableSampler's shuffle=), "
                             "not to the loader, when you give a sampler or batch_sampler")
        if isinstance(sampler, ResumableSampler) and batch_sampler is None:
            sampler._tracked = True
            super().__init__(dataset, batch_size=batch_size, sampler=sampler,
                             drop_last=drop_last, generator=self.seed_generator, **kwargs)
            self._progress = _SamplerProgress(sampler, batch_size or 1, drop_last)
            if workers:
                self._indices: Any = _Tagged(DataLoader._index_sampler.fget(self),  # type: ignore[attr-defined]
                                             self._progress)
            return
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                         generator=self.seed_generator, **kwargs)
        source = DataLoader._index_sampler.fget(self)  # type: ignore[attr-defined]
        size = len(dataset) if callable(getattr(dataset, "__len__", None)) else None
        self._progress = SamplerOrder(source, seed, tag_seeds=workers > 0, dataset_len=size)
        self._indices = _Indices(self._progress)

    @classmethod
    def from_loader(cls, loader: DataLoader, *, seed: int | None = None) -> ResumableLoader:
        """A ResumableLoader equivalent to ``loader`` (same dataset, batching, sampler,
        workers, collate_fn...), whose ``state_dict`` is the loop's position. A plain
        ``RandomSampler`` (``shuffle=True``) becomes a :class:`ResumableSampler`'s
        shuffle; any other sampler or batch_sampler is kept. ``seed`` (default: the
        loader's generator's initial seed, else torch's) seeds the order and the workers."""
        from pitstop.adapters.torch._from_loader import loader_arguments
        return cls(**loader_arguments(loader, seed))

    @property  # type: ignore[override]
    def _index_sampler(self) -> Any:
        indices = self.__dict__.get("_indices")
        return indices if indices is not None else DataLoader._index_sampler.fget(self)  # type: ignore[attr-defined]

    @property  # type: ignore[override]
    def worker_init_fn(self) -> WorkerInit:
        """The ``worker_init_fn`` torch calls in each worker: it leaves SIGTERM and SIGINT to
        the main process (see ``_workers``), then calls the one you passed (``.fn``)."""
        return self._worker_init

    @worker_init_fn.setter
    def worker_init_fn(self, fn: Callable[[int], Any] | None) -> None:
        self._worker_init = fn if isinstance(fn, WorkerInit) else WorkerInit(fn)

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return int(self._progress.epoch)

    @property
    def position(self) -> int:
        """How far the training loop is into this epoch: samples with a ResumableSampler,
        batches (items without batching) otherwise."""
        return int(self._progress.position)

    def set_epoch(self, epoch: int) -> None:
        """``DistributedSampler.set_epoch`` (also forwarded to the sampler or the
        IterableDataset that has one): keeps the position when ``epoch`` is current."""
        self._progress.set_epoch(epoch)

    def __iter__(self) -> _TrackedIter:  # type: ignore[override]
        return _TrackedIter(self)

    def _get_iterator(self) -> Any:
        p = self._progress
        if isinstance(p, StreamProgress) and self.num_workers > 0:
            self.check_worker_number_rationality()
            return OffsetIter(self, p.offset())
        return super()._get_iterator()

    def _open(self) -> Iterator[Any]:
        """The DataLoader iterator for the epoch and position (an empty one for an epoch
        already used up: see ``ResumableSampler.set_epoch``)."""
        p = self._progress
        if not p.opening():
            return _NOTHING
        # worker seeds depend on (seed, epoch) only; persistent workers are seeded once
        self.seed_generator.manual_seed(mix_epoch(p.seed, 0 if self.persistent_workers
                                                  else p.epoch))
        self._worker_init.stream_resume = (p.resume() if isinstance(p, StreamProgress)
                                           else None)
        if self.num_workers > 0:
            # workers (and the helper processes they need) start with SIGTERM/SIGINT
            # blocked, so none reaches them before their worker_init_fn hands both to the
            # main process (see _workers)
            return start_workers(self.multiprocessing_context, super().__iter__)
        return super().__iter__()

    def state_dict(self) -> dict[str, Any]:
        return self._progress.state_dict()  # type: ignore[no-any-return]

    def check_state(self, state: Any) -> None:
        """Raise :class:`pitstop.IncompatibleTargetError` when ``state`` cannot be loaded."""
        self._progress.check_state(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._progress.load_state_dict(state)


class _Nothing:
    """The iterator of an epoch used up already."""

    def __iter__(self) -> _Nothing:
        return self

    def __next__(self) -> Any:
        raise StopIteration

    def __len__(self) -> int:
        return 0


_NOTHING = _Nothing()


class _TrackedIter:
    """The DataLoader iterator, counting what it hands to the training loop. When the
    position is restored meanwhile (``restore`` or ``rollback`` inside the loop), it starts
    over from the restored position: the batches after it are those of a run resumed
    there (the old iterator's workers are shut down, its prefetched batches dropped)."""

    def __init__(self, loader: ResumableLoader) -> None:
        self.loader = loader
        self.progress = loader._progress
        self.generation = self.progress.generation
        self.it = loader._open()

    def __iter__(self) -> _TrackedIter:
        return self

    @property
    def used_up(self) -> bool:
        """True for the iteration of an epoch used up already (a resume saved right after
        its last batch): it yields nothing, and the next iteration starts the next epoch."""
        return self.it is _NOTHING

    def __next__(self) -> Any:
        if self.generation != self.progress.generation:
            self._restart()
        try:
            batch = next(self.it)
        except StopIteration:
            if self.it is not _NOTHING:
                self.progress.ended()
            raise
        return self.progress.took(batch)

    def _restart(self) -> None:
        old = self.it
        stream = isinstance(self.progress, StreamProgress)
        if not self.loader.persistent_workers or stream:
            # (persistent ones are reset and reused, except a stream's: its workers load
            # their saved states when they start)
            shutdown = getattr(old, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            if stream and self.loader.persistent_workers:
                self.loader._iterator = None
        self.generation = self.progress.generation
        self.it = self.loader._open()

    def __len__(self) -> int:
        return len(self.it)  # type: ignore[arg-type]

