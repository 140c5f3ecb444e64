"""ResumableLoader over every kind of data the trainers use: any sampler, a batch_sampler,
an IterableDataset with its own state_dict. Interrupted at a random step (the seed is in
the failure message) and restored through a manager, the loader yields exactly the
batches (ids and the random augmentation drawn while loading them) of an uninterrupted
run, across epoch boundaries, with and without worker processes."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    get_worker_info,
)

import pitstop
from pitstop.adapters.torch import ResumableLoader

N, BS, STEPS, EPOCHS = 10, 3, 11, 6


class Augmented(Dataset):
    """Item i: ``[i, a random augmentation drawn with torch's global generator]``."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i):
        return torch.tensor([int(i), int(torch.randint(0, 1 << 30, ()))])


class Stream(IterableDataset):
    """0..N-1, sharded over the workers, with its position as state; augmented too."""

    def __init__(self) -> None:
        self.pos = 0  # items of this shard yielded by the iteration in progress
        self.loaded = None

    def _shard(self):
        info = get_worker_info()
        w, n = (0, 1) if info is None else (info.id, info.num_workers)
        return list(range(w, N, n))

    def __iter__(self):
        start, self.loaded = (self.loaded or 0), None
        for pos, i in enumerate(self._shard()[start:], start + 1):
            self.pos = pos
            yield torch.tensor([i, int(torch.randint(0, 1 << 30, ()))])

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state) -> None:
        self.loaded = self.pos = state["pos"]


class PythonRandomSampler(Sampler[int]):
    """A user's sampler drawing from Python's global generator."""

    def __iter__(self):
        order = list(range(N))
        random.shuffle(order)
        return iter(order)

    def __len__(self) -> int:
        return N


class StatefulSampler(Sampler[int]):
    """A user's sampler with its own state: a counter that rotates the order per epoch."""

    def __init__(self) -> None:
        self.turn = 0

    def __iter__(self):
        self.turn += 1
        return iter([(i * 7 + self.turn) % N for i in range(N)])

    def __len__(self) -> int:
        return N

    def state_dict(self):
        return {"turn": self.turn}

    def load_state_dict(self, state) -> None:
        self.turn = state["turn"]


class Buckets(Sampler[list]):
    """A user's bucketing batch sampler: batches of similar ids, in a random bucket order."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __iter__(self):
        buckets = [[0, 1, 2], [3, 4], [5, 6, 7], [8, 9]]
        for b in torch.randperm(len(buckets), generator=self.generator).tolist():
            yield buckets[b]

    def __len__(self) -> int:
        return 4


KINDS = {
    "resumable-sampler": lambda: dict(batch_size=BS, shuffle=True),
    "random": lambda: dict(batch_size=BS, sampler=RandomSampler(range(N))),
    "random-generator": lambda: dict(batch_size=BS, sampler=RandomSampler(
        range(N), generator=torch.Generator().manual_seed(3))),
    "random-replacement": lambda: dict(batch_size=BS, sampler=RandomSampler(
        range(N), replacement=True, num_samples=8)),
    "weighted": lambda: dict(batch_size=BS, sampler=WeightedRandomSampler(
        [1.0] * 5 + [3.0] * 5, num_samples=9)),
    "subset": lambda: dict(batch_size=BS, sampler=SubsetRandomSampler([1, 3, 4, 6, 8, 9])),
    "distributed": lambda: dict(batch_size=2, sampler=DistributedSampler(
        range(N), num_replicas=2, rank=1, shuffle=True, seed=4)),
    "python-random": lambda: dict(batch_size=BS, sampler=PythonRandomSampler()),
    "stateful": lambda: dict(batch_size=BS, sampler=StatefulSampler()),
    "batch-sampler": lambda: dict(batch_sampler=BatchSampler(RandomSampler(range(N)), BS,
                                                             drop_last=True)),
    "bucketing": lambda: dict(batch_sampler=Buckets(torch.Generator().manual_seed(5))),
    "unbatched": lambda: dict(batch_size=None, sampler=RandomSampler(range(N))),
    "stream": lambda: dict(batch_size=2),
}


def make(kind: str, workers: int) -> ResumableLoader:
    kw = KINDS[kind]()
    data = Stream() if kind == "stream" else Augmented()
    # persistent workers: started once per loader (the test's time), reset every epoch
    return ResumableLoader(data, seed=11, num_workers=workers, persistent_workers=workers > 0,
                           **kw)


def rows(batch) -> list:
    return batch.reshape(-1, 2).tolist()


def train(kind, loader, mgr, stop=None):
    """The DistributedSampler idiom (set_epoch, on the sampler itself for 'distributed'),
    with the epoch counter and the global generators in the state. Returns the batches of
    each step; ends after step ``stop`` (saved there)."""
    state = {"loader": loader, "epoch": 0, "rng": pitstop.RNG()}
    restored = mgr.restore(state)
    step = 0 if restored is None else restored + 1
    seen = []
    for epoch in range(state["epoch"], EPOCHS):
        state["epoch"] = epoch
        if kind == "distributed":
            loader.sampler.set_epoch(epoch)
        else:
            loader.set_epoch(epoch)
        for batch in loader:
            torch.rand(3)  # the loop's own draws (dropout) between the loads
            random.random()
            seen.append(rows(batch))
            if step == stop:
                mgr.save(step, state)
                return seen
            step += 1
            if step == STEPS:
                return seen
    return seen


@pytest.fixture(scope="module")
def references():
    return {}


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "workers"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_an_interrupted_loader_resumes_with_the_batches_of_an_uninterrupted_one(
        kind, workers, manager, references):
    torch.manual_seed(0)
    random.seed(0)
    key = (kind, workers)
    if key not in references:
        with manager() as ref:
            references[key] = train(kind, make(kind, workers), ref)
    expected = references[key]
    assert len(expected) == STEPS
    seed = random.SystemRandom().randrange(1 << 30)
    stop = random.Random(seed).randrange(STEPS - 1)
    torch.manual_seed(0)
    random.seed(0)
    mgr = manager()
    first = train(kind, make(kind, workers), mgr, stop=stop)
    mgr.close()
    torch.manual_seed(123)  # the new process's generators: restored from the checkpoint
    random.seed(123)
    rest = train(kind, make(kind, workers), manager())
    assert first + rest == expected, f"seed {seed}: stopped after step {stop}"


@pytest.mark.parametrize("kind", ["distributed", "stream"])
def test_stopped_after_any_step_including_an_epochs_last_it_resumes_exactly(kind, tmp_path):
    """Every cut, in-process (cheap): right after an epoch's last batch the loop's epoch
    counter still names that epoch, and set_epoch of it must not train it again."""
    def manager_at(where):
        return pitstop.CheckpointManager(tmp_path / where, save_on_signals=None,
                                         memory_tier=False, async_save=False)

    torch.manual_seed(0)
    with manager_at("ref") as ref:
        expected = train(kind, make(kind, 0), ref)
    for stop in range(STEPS - 1):
        torch.manual_seed(0)
        with manager_at(f"stop{stop}") as mgr:
            first = train(kind, make(kind, 0), mgr, stop=stop)
        with manager_at(f"stop{stop}") as mgr:
            rest = train(kind, make(kind, 0), mgr)
        assert first + rest == expected, f"stopped after step {stop}"
