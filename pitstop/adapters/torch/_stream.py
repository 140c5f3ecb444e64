"""The training loop's position in an ``IterableDataset`` that has its own ``state_dict``.

With ``num_workers=0`` the dataset is iterated in the training process, one batch when the
loop asks: its ``state_dict()`` at a save is where the loop is. With worker processes each
worker iterates its own copy of the dataset (sharded by ``get_worker_info()`` as the dataset
decides), ahead of the loop. Each batch then comes back stamped with its worker's dataset
state right after it (``_fetch.Stamped``); the loader keeps, per worker, the stamp of the
last batch the *loop* took, and which worker that was. A resume starts the workers with
those states (each worker loads its own before iterating) and asks first the worker whose
turn was next, so the batches come in the uninterrupted run's order.

The dataset's contract: ``state_dict()`` says how far the iteration in progress went;
after ``load_state_dict(s)`` the next ``__iter__`` continues from ``s``; without one it
starts the stream over (each epoch starts from a copy that was never loaded, in a worker,
or from the same object, with ``num_workers=0``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from pitstop.adapters.torch._fetch import Stamped
from pitstop.adapters.torch._values_codec import decode, encode
from pitstop.core.errors import IncompatibleTargetError


def refuse_stateless(dataset: Any) -> None:
    """Raise TypeError, saying what to add, for an IterableDataset without a state."""
    if callable(getattr(dataset, "state_dict", None)) and callable(
            getattr(dataset, "load_state_dict", None)):
        return
    name = type(dataset).__name__
    raise TypeError(
        f"ResumableLoader cannot tell where the loop is in the IterableDataset {name}: it has "
        "no state_dict()/load_state_dict(). Add both to it: state_dict() returns how far the "
        "iteration in progress went (e.g. {'pos': items yielded}), load_state_dict(s) makes "
        "the next __iter__ continue from there (and a fresh __iter__ starts over). With "
        "worker processes each worker's copy is saved and restored separately (shard it with "
        "torch.utils.data.get_worker_info() as usual).")


class StreamProgress:
    """Epoch, batches taken, and per-worker dataset state of the loop over a stream."""

    kind = "stream"

    def __init__(self, dataset: Any, seed: int, num_workers: int) -> None:
        self.dataset = dataset
        self.seed = int(seed)
        self.num_workers = num_workers
        self.epoch = 0
        self.position = 0
        self.generation = 0
        self.completed: int | None = None
        #: worker id (str) -> {"count", "state"} of the last batch the loop took from it
        self.workers: dict[str, Any] = {}
        self.last_worker: int | None = None
        self._loaded_main: Any = None  # a restored state for the in-process dataset

    def opening(self) -> bool:
        if self.num_workers == 0 and self._loaded_main is not None:
            self.dataset.load_state_dict(decode(self._loaded_main))
            self._loaded_main = None
        return True

    def resume(self) -> dict[str, Any] | None:
        """What the workers about to start load: each one's saved state (None: fresh)."""
        return dict(self.workers) if self.workers else None

    def offset(self) -> int:
        """The worker that the next batch is asked of."""
        return 0 if self.last_worker is None else (self.last_worker + 1) % self.num_workers

    def took(self, batch: Any) -> Any:
        self.position += 1
        if isinstance(batch, Stamped):
            self.workers[str(batch.worker)] = {"count": batch.count, "state": batch.state}
            self.last_worker = batch.worker
            return batch.data
        return batch

    def ended(self) -> None:
        self.completed = self.epoch
        self.epoch += 1
        self.position = 0
        self.workers = {}
        self.last_worker = None

    def set_epoch(self, epoch: int) -> None:
        fn = getattr(self.dataset, "set_epoch", None)
        if callable(fn):
            fn(epoch)
        if int(epoch) != self.epoch:
            self.epoch, self.position, self.workers, self.last_worker = int(epoch), 0, {}, None

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind, "seed": self.seed, "epoch": self.epoch,
            "position": self.position, "completed_epoch": self.completed,
            "num_workers": self.num_workers, "workers": dict(self.workers),
            "last_worker": self.last_worker}
        if self.num_workers == 0:
            out["dataset"] = (self._loaded_main if self._loaded_main is not None
                              else encode(self.dataset.state_dict()) if self.position else None)
        return out

    def check_state(self, state: Any) -> None:
        if not isinstance(state, Mapping) or state.get("kind") != self.kind:
            raise IncompatibleTargetError(
                "the checkpoint's entry is not the state of a ResumableLoader over an "
                "IterableDataset; restore it into a loader built the way the saved one was")
        saved = int(state.get("num_workers", 0))
        if (saved == 0) != (self.num_workers == 0) or (saved and saved != self.num_workers):
            raise IncompatibleTargetError(
                f"the checkpoint's stream was read by {saved} worker process(es), this loader "
                f"has num_workers={self.num_workers}: each worker's copy of the dataset holds "
                f"its own shard and position. Resume with num_workers={saved}.")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.check_state(state)
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        done = state.get("completed_epoch")
        self.completed = None if done is None else int(done)
        self.workers = dict(state.get("workers") or {})
        last = state.get("last_worker")
        self.last_worker = None if last is None else int(last)
        self._loaded_main = state.get("dataset")
        self.generation += 1


class OffsetIter(_MultiProcessingDataLoaderIter):
    """torch's worker iterator, asking worker ``offset`` first (then round-robin as usual)."""

    def __init__(self, loader: Any, offset: int) -> None:
        self._pitstop_offset = offset
        super().__init__(loader)

    @property  # type: ignore[override]
    def _worker_queue_idx_cycle(self) -> Any:
        return self._pitstop_cycle

    @_worker_queue_idx_cycle.setter
    def _worker_queue_idx_cycle(self, cycle: Any) -> None:
        for _ in range(self._pitstop_offset):
            next(cycle)
        self._pitstop_offset = 0
        self._pitstop_cycle = cycle
