"""Data progress: the next batch after a resume is the one that would have come next."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import pitstop
from pitstop.adapters.torch import ResumableLoader, ResumableSampler
from pitstop.adapters.torch._adapter import SamplerAdapter

N, BS = 21, 4  # 6 batches per epoch, the last one partial


def dataset(n: int = N) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def ids(batch) -> list[int]:
    return batch[0].tolist()


def take(it, k):
    return [ids(next(it)) for _ in range(k)]


def stream(loader, k):
    """The next ``k`` batches, crossing epoch boundaries like a step-driven training loop."""
    out = []
    while len(out) < k:
        for batch in loader:
            out.append(ids(batch))
            if len(out) == k:
                break
    return out


def test_same_order_as_distributed_sampler():
    for rank in (0, 1):
        ours = ResumableSampler(dataset(), seed=3, num_replicas=2, rank=rank)
        theirs = DistributedSampler(dataset(), num_replicas=2, rank=rank, seed=3)
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_and_across_epochs(workers):
    ref = ResumableLoader(dataset(), batch_size=BS, shuffle=True, seed=5, num_workers=workers)
    expected = stream(ref, 16)
    for cut in (1, 5, 6, 9):
        first = ResumableLoader(dataset(), batch_size=BS, shuffle=True, seed=5,
                                num_workers=workers)
        assert stream(first, cut) == expected[:cut]
        state = first.state_dict()
        assert (state["epoch"], state["position"]) == (cut // 6, cut % 6 * BS)
        resumed = ResumableLoader(dataset(), batch_size=BS, shuffle=True, seed=0,
                                  num_workers=workers)
        resumed.load_state_dict(state)
        assert stream(resumed, 16 - cut) == expected[cut:], cut


def test_position_counts_batches_the_loop_took_not_prefetched_ones():
    loader = ResumableLoader(dataset(40), batch_size=2, shuffle=True, num_workers=2,
                             prefetch_factor=4)
    it = iter(loader)
    next(it)
    next(it)
    # the workers have pulled up to 2 * 4 batches of indices by now; the loop took 2
    assert loader.state_dict()["position"] == 4
    assert loader.position == 4 and loader.epoch == 0


def test_iterating_does_not_touch_the_global_generator():
    """A plain DataLoader draws its workers' base seed from the global generator on every
    iter(): a resumed run (one extra iter() mid-epoch) would drift. Ours does not draw."""
    plain = DataLoader(dataset(), batch_size=BS, num_workers=0)
    before = torch.get_rng_state()
    iter(plain)
    assert not torch.equal(before, torch.get_rng_state())  # the drift we avoid

    ours = ResumableLoader(dataset(), batch_size=BS, shuffle=True, num_workers=0)
    before = torch.get_rng_state()
    stream(ours, 8)
    assert torch.equal(before, torch.get_rng_state())


def test_worker_base_seed_is_a_function_of_seed_and_epoch():
    a = ResumableLoader(dataset(), batch_size=BS, shuffle=True, seed=1, num_workers=0)
    seeds_a = []
    for _ in range(2):
        it = iter(a)
        seeds_a.append(it.it._base_seed)
        list(it)
    b = ResumableLoader(dataset(), batch_size=BS, shuffle=True, seed=1, num_workers=0)
    b.load_state_dict({**a.state_dict(), "epoch": 1, "position": 8})  # resumed mid-epoch 1
    assert iter(b).it._base_seed == seeds_a[1]


def test_drop_last_and_epoch_boundaries():
    loader = ResumableLoader(dataset(), batch_size=BS, shuffle=False, drop_last=True)
    assert len(loader) == 5
    assert stream(loader, 5)[-1] == [16, 17, 18, 19]
    # the epoch is complete after its last full batch: the next one starts epoch 1
    assert (loader.epoch, loader.position) == (1, 0)
    assert stream(loader, 1) == [[0, 1, 2, 3]]


def test_epoch_loop_with_set_epoch_resumes_mid_epoch():
    loader = ResumableLoader(dataset(), batch_size=BS, shuffle=True, seed=2)
    seen = []
    for epoch in range(loader.epoch, 2):
        loader.set_epoch(epoch)
        for batch in loader:
            seen.append((epoch, ids(batch)))
    resumed = ResumableLoader(dataset(), batch_size=BS, shuffle=True, seed=2)
    resumed.load_state_dict({**resumed.state_dict(), "seed": 2, "epoch": 0, "position": 12})
    again = []
    for epoch in range(resumed.epoch, 2):
        resumed.set_epoch(epoch)
        for batch in resumed:
            again.append((epoch, ids(batch)))
    assert again == seen[3:]


def test_plain_sampler_with_a_single_process_loader():
    s = ResumableSampler(dataset(), seed=4)
    loader = DataLoader(dataset(), batch_size=BS, sampler=s)
    it = iter(loader)
    first = take(it, 2)
    state = s.state_dict()
    assert state["position"] == 2 * BS
    rest = [ids(b) for b in it]
    s2 = ResumableSampler(dataset(), seed=0)
    s2.load_state_dict(state)
    assert [ids(b) for b in DataLoader(dataset(), batch_size=BS, sampler=s2)] == rest
    assert first + rest == [ids(b) for b in DataLoader(dataset(), batch_size=BS,
                                                       sampler=ResumableSampler(dataset(), seed=4))]


def test_changed_dataset_is_an_error_that_says_what_to_do():
    s = ResumableSampler(dataset(10))
    saved = ResumableSampler(dataset(12)).state_dict()
    with pytest.raises(pitstop.IncompatibleTargetError, match="12 samples.*has 10.*same dataset"):
        s.load_state_dict(saved)
    # the same refusal up front, from the checkpoint's values alone, for sampler and loader
    for target in (s, ResumableLoader(dataset(10), batch_size=BS)):
        with pytest.raises(pitstop.IncompatibleTargetError, match="same dataset"):
            SamplerAdapter().check(target, saved)
        SamplerAdapter().check(target, ResumableSampler(dataset(10)).state_dict())
    with pytest.raises(pitstop.IncompatibleTargetError, match="not a ResumableSampler"):
        SamplerAdapter().check(s, {"last_epoch": 3})
    assert (s.epoch, s.position) == (0, 0)


def test_changed_dataset_through_the_manager_is_a_checkpoint_error(manager):
    loader = ResumableLoader(dataset(12), batch_size=BS, shuffle=True)
    stream(loader, 2)
    mgr = manager()
    mgr.save(1, {"loader": loader})
    with pytest.raises(pitstop.IncompatibleTargetError, match="same dataset"):
        mgr.restore({"loader": ResumableLoader(dataset(10), batch_size=BS)})


def test_changed_dataset_is_refused_before_anything_is_restored(manager):
    loader = ResumableLoader(dataset(12), batch_size=BS, shuffle=True)
    mgr = manager()
    mgr.save(1, {"w": torch.ones(3), "loader": loader})
    target = {"w": torch.zeros(3), "loader": ResumableLoader(dataset(10), batch_size=BS)}
    with pytest.raises(pitstop.IncompatibleTargetError, match="same dataset"):
        mgr.restore(target)
    assert torch.equal(target["w"], torch.zeros(3))  # untouched


@pytest.mark.parametrize("batch_size", [BS, None])
def test_a_sampler_under_a_prefetching_dataloader_says_to_use_resumable_loader(batch_size):
    """With worker processes the DataLoader draws indices ahead of the loop: the sampler's
    position overstates progress (a resume would skip batches). That is said, with the fix."""
    s = ResumableSampler(dataset(40), seed=7)
    it = iter(DataLoader(dataset(40), sampler=s, batch_size=batch_size, num_workers=2))
    next(it)
    (caveat,) = SamplerAdapter().caveats(s)
    assert "pitstop.adapters.torch.ResumableLoader" in caveat and "num_workers=2" in caveat
    del it


def test_no_caveat_where_the_position_is_exact():
    s = ResumableSampler(dataset(40), seed=7)
    it = iter(DataLoader(dataset(40), sampler=s, batch_size=BS, num_workers=0))
    next(it)
    assert SamplerAdapter().caveats(s) == []  # one process: drawn when the loop asks
    loader = ResumableLoader(dataset(40), batch_size=BS, num_workers=2)
    it2 = iter(loader)
    next(it2)
    assert SamplerAdapter().caveats(loader) == []  # the loader counts what the loop took
    assert SamplerAdapter().caveats(loader.sampler) == []
    del it, it2


def test_the_first_save_warns_about_a_prefetched_sampler(manager):
    s = ResumableSampler(dataset(40), seed=7)
    it = iter(DataLoader(dataset(40), sampler=s, batch_size=BS, num_workers=2))
    next(it)
    mgr = manager()
    with pytest.warns(UserWarning, match=r"pitstop\.adapters\.torch\.ResumableLoader"):
        mgr.save(1, {"sampler": s})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, not at every save
        mgr.save(2, {"sampler": s})
    del it


def test_elastic_resume_keeps_the_global_sample_count():
    s = ResumableSampler(dataset(40), num_replicas=4, rank=0)
    state = {**s.state_dict(), "position": 6}  # 24 samples consumed globally
    s2 = ResumableSampler(dataset(40), num_replicas=2, rank=1)
    s2.load_state_dict(state)
    assert s2.position == 12


def test_rejects_what_it_cannot_track():
    with pytest.raises(TypeError, match="batch_size"):
        ResumableLoader(dataset(), batch_sampler=[[0, 1]])
    with pytest.raises(TypeError, match="ResumableSampler"):
        ResumableLoader(dataset(), sampler=range(N))


def test_a_plain_dataloader_in_the_state_says_what_to_use(manager):
    with pytest.raises(pitstop.UnsupportedStateError, match="ResumableLoader"):
        manager().save(1, {"loader": DataLoader(dataset(), batch_size=BS)})
