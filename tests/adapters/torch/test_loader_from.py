"""ResumableLoader.from_loader (what the trainer integrations swap in), and what the loader
refuses: each refusal says what to do."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
    WeightedRandomSampler,
)

import pitstop
from pitstop.adapters.torch import ResumableLoader, ResumableSampler


def data(n: int = 12) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def collate(items):
    return torch.stack([x for (x,) in items]) * 10


def init_fn(worker_id: int) -> None:
    pass


def ids(batch) -> list[int]:
    return (batch[0] if isinstance(batch, list) else batch).tolist()


def test_from_loader_keeps_the_loaders_arguments_and_resumes():
    plain = DataLoader(data(), batch_size=5, shuffle=True, drop_last=True, collate_fn=collate,
                       worker_init_fn=init_fn, generator=torch.Generator().manual_seed(9))
    loader = ResumableLoader.from_loader(plain)
    assert isinstance(loader, ResumableLoader) and loader.dataset is plain.dataset
    assert (loader.batch_size, loader.drop_last, loader.collate_fn) == (5, True, collate)
    assert loader.worker_init_fn.fn is init_fn
    assert isinstance(loader.sampler, ResumableSampler) and loader.sampler.shuffle
    assert loader.state_dict()["seed"] == 9  # the generator's seed, when none is given
    first = [ids(b) for b in loader]
    assert len(first) == 2 and all(x % 10 == 0 for b in first for x in b)
    again = ResumableLoader.from_loader(plain)
    it = iter(again)
    next(it)
    resumed = ResumableLoader.from_loader(plain, seed=1)
    resumed.load_state_dict(again.state_dict())
    assert [ids(b) for b in resumed] == first[1:]
    seq = ResumableLoader.from_loader(DataLoader(data(), batch_size=4))
    assert not seq.sampler.shuffle and [ids(b) for b in seq][0] == [0, 1, 2, 3]
    assert ResumableLoader.from_loader(seq).worker_init_fn.fn is None


def test_from_loader_keeps_another_sampler_or_batch_sampler():
    weighted = WeightedRandomSampler([1.0] * 12, num_samples=6)
    loader = ResumableLoader.from_loader(DataLoader(data(), batch_size=3, sampler=weighted),
                                         seed=2)
    assert loader.sampler is weighted and len(loader) == 2
    batches = BatchSampler(SequentialSampler(range(12)), 4, drop_last=False)
    loader = ResumableLoader.from_loader(DataLoader(data(), batch_sampler=batches))
    assert loader.batch_sampler is batches
    assert [ids(b) for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    replacing = RandomSampler(range(12), replacement=True)  # not a shuffle: kept as is
    assert ResumableLoader.from_loader(DataLoader(data(), sampler=replacing)).sampler \
        is replacing
    with pytest.raises(TypeError, match="DataLoader"):
        ResumableLoader.from_loader([1, 2])


class Counting(IterableDataset):
    def __init__(self) -> None:
        self.pos = 0

    def __iter__(self):
        start = self.pos
        for self.pos in range(start + 1, 7):
            yield self.pos - 1

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state) -> None:
        self.pos = state["pos"]


class Plain(IterableDataset):
    def __iter__(self):
        return iter(range(3))


def test_a_plain_dataloader_in_the_state_is_refused_with_from_loader_as_the_fix(manager):
    mgr = manager()
    for plain in (DataLoader(data(), batch_size=4, shuffle=True),
                  DataLoader(Counting(), batch_size=2, num_workers=2)):
        with pytest.raises(pitstop.UnsupportedStateError,
                           match=r"ResumableLoader\.from_loader\(loader\)"):
            mgr.save(1, {"loader": plain})
    loader = ResumableLoader.from_loader(DataLoader(Counting(), batch_size=2))
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]


def test_what_the_loader_refuses_says_what_to_do(manager):
    with pytest.raises(TypeError, match=r"Plain.*state_dict\(\)/load_state_dict\(\)"):
        ResumableLoader(Plain(), batch_size=2)
    with pytest.raises(TypeError, match="Sampler subclass"):
        ResumableLoader(data(), sampler=[0, 1, 2])
    with pytest.raises(ValueError, match="shuffle"):
        ResumableLoader(data(), shuffle=True, sampler=RandomSampler(range(12)))
    # a checkpoint of one kind of loader, restored into another kind or other data
    mgr = manager()
    weighted = ResumableLoader(data(), batch_size=3, sampler=WeightedRandomSampler([1.0] * 12, 6))
    mgr.save(1, {"loader": weighted})
    for target, match in (
            (ResumableLoader(data(), batch_size=3, sampler=RandomSampler(range(12))),
             "iterated a BatchSampler.WeightedRandomSampler., this one a "
             "BatchSampler.RandomSampler."),
            (ResumableLoader(data(10), batch_size=3,
                             sampler=WeightedRandomSampler([1.0] * 10, 6)), "12 samples"),
            (ResumableLoader(data(), batch_size=3, shuffle=True), "not a ResumableSampler"),
            (ResumableLoader(Counting(), batch_size=2), "IterableDataset")):
        with pytest.raises(pitstop.IncompatibleTargetError, match=match):
            mgr.restore({"loader": target})
    mgr.save(2, {"loader": ResumableLoader(data(), batch_size=3, shuffle=True)})
    with pytest.raises(pitstop.IncompatibleTargetError, match="kind 'ResumableSampler'"):
        mgr.restore({"loader": weighted})
    mgr.save(3, {"loader": ResumableLoader(Counting(), batch_size=2)})
    with pytest.raises(pitstop.IncompatibleTargetError, match="num_workers=0"):
        mgr.restore({"loader": ResumableLoader(Counting(), batch_size=2, num_workers=2)})
