"""Data progress: the next batch after a resume is the one that would have come next."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import pitstop
from pitstop.adapters.torch import ResumableLoader, ResumableSampler
from pitstop.adapters.torch._values import SamplerAdapter

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


# --------------------------------------------------------------- set_epoch after an epoch's end
def epoch_loop(manager, loader, epochs, stop_after=None):
    """The DistributedSampler idiom with the epoch counter in the state, saved every step:
    ``for epoch in range(state["epoch"], E): loader.set_epoch(epoch); for batch in loader``.
    Returns the (epoch, batch) pairs trained on; stops after step ``stop_after``."""
    state = {"loader": loader, "epoch": 0}
    seen = []
    mgr = manager(save_every_steps=1)
    restored = mgr.restore(state)
    step = 0 if restored is None else restored + 1
    for epoch in range(state["epoch"], epochs):
        loader.set_epoch(epoch)
        state["epoch"] = epoch
        for batch in loader:
            seen.append((epoch, ids(batch)))
            mgr.step(step, state)
            if step == stop_after:
                return seen
            step += 1
    return seen


@pytest.mark.parametrize("drop_last", [False, True])
def test_set_epoch_loop_resumed_after_any_step_trains_each_batch_once(tmp_path, drop_last):
    """Saved right after an epoch's last batch, the loader had moved on to the next epoch
    while the loop's counter still said the old one: set_epoch of that epoch on resume must
    not replay it. The same at every other step."""
    def make():
        return ResumableLoader(dataset(10), batch_size=4, shuffle=True, seed=3,
                               drop_last=drop_last)

    made = []

    def manager_at(path):
        def make_manager(**kw):
            m = pitstop.CheckpointManager(path, save_on_signals=None, memory_tier=False,
                                          async_save=False, **kw)
            made.append(m)
            return m
        return make_manager

    try:
        reference = epoch_loop(manager_at(tmp_path / "ref"), make(), 3)
        for stop in range(len(reference) - 1):
            where = tmp_path / f"stop{stop}"
            first = epoch_loop(manager_at(where), make(), 3, stop_after=stop)
            for m in made:
                m.close()
            resumed = epoch_loop(manager_at(where), make(), 3)
            assert first + resumed == reference, stop
    finally:
        for m in made:
            m.close()
    per_epoch = 2 if drop_last else 3
    assert [e for e, _ in reference] == [e for e in range(3) for _ in range(per_epoch)]


def test_set_epoch_otherwise_keeps_distributed_sampler_semantics():
    loader = ResumableLoader(dataset(8), batch_size=4, shuffle=True, seed=1)
    e0 = [ids(b) for b in loader]
    assert (loader.epoch, loader.position) == (1, 0)  # moved on by itself
    loader.set_epoch(0)  # the epoch just completed, nothing of epoch 1 taken: used up
    assert (loader.epoch, loader.position) == (0, 8)
    assert [ids(b) for b in loader] == []
    assert (loader.epoch, loader.position) == (1, 0)
    loader.set_epoch(1)  # the current epoch: the position is kept
    e1 = [ids(b) for b in loader]
    assert e1 != e0 and len(e1) == 2
    loader.set_epoch(0)  # any other epoch starts from its beginning, as DistributedSampler
    assert [ids(b) for b in loader] == e0
    it = iter(loader)  # epoch 1 now; once a batch of it is taken, epoch 0 is a rewind
    next(it)
    loader.set_epoch(0)
    assert [ids(b) for b in loader] == e0
    assert len(loader) == 2
    # the sampler alone (a single-process DataLoader) behaves the same
    s = ResumableSampler(dataset(8), seed=1)
    assert len(list(s)) == 8 and (s.epoch, s.position) == (1, 0)
    s.set_epoch(0)
    assert list(s) == [] and (s.epoch, s.position) == (1, 0)


def test_a_state_saved_before_completed_epoch_existed_loads():
    loader = ResumableLoader(dataset(8), batch_size=4, shuffle=True, seed=1)
    e0 = [ids(b) for b in loader]
    old = {k: v for k, v in loader.state_dict().items() if k != "completed_epoch"}
    assert (old["epoch"], old["position"]) == (1, 0)
    resumed = ResumableLoader(dataset(8), batch_size=4, shuffle=True)
    resumed.load_state_dict(old)
    resumed.set_epoch(0)  # at the start of epoch 1: it had moved on from epoch 0
    assert [ids(b) for b in resumed] == []
    mid = ResumableLoader(dataset(8), batch_size=4, shuffle=True)
    mid.load_state_dict({**old, "epoch": 0, "position": 4})
    assert [ids(b) for b in mid] == e0[1:]


# --------------------------------------------------------------- restore inside the loop
@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)],
                         ids=["in-process", "workers", "persistent-workers"])
def test_rollback_inside_the_loop_continues_from_the_restored_position(manager, workers,
                                                                        persistent):
    """restore()/rollback() inside ``for batch in loader`` (a NaN loss noticed there): the
    running iterator goes on from the restored position, with the batches a run resumed
    there would get, and later saves describe what was trained on."""
    def make():
        return ResumableLoader(dataset(40), batch_size=4, shuffle=True, seed=6,
                               num_workers=workers, persistent_workers=persistent)

    expected = stream(make(), 12)
    loader = make()
    state = {"loader": loader}
    mgr = manager(nonfinite_guard=True)
    seen, rolled = [], False
    step = 0
    while len(seen) < 12:
        for batch in loader:
            seen.append(ids(batch))
            if step == 4 and not rolled:
                rolled = True
                seen = seen[:2]  # the steps after the checkpoint of step 1 are redone
                assert mgr.rollback(state) == 1
                step = 2
                continue
            if step == 1:
                mgr.save(step, state, metrics={"loss": 1.0}).wait()
            step += 1
            if len(seen) == 12:
                break
    assert seen == expected
    # what a save now holds is where the loop is: a run resumed from it goes on exactly
    mgr.save(step, state, metrics={"loss": 1.0}).wait()
    resumed = make()
    mgr.restore({"loader": resumed})
    assert (resumed.epoch, resumed.position) == (1, 8)
    assert stream(resumed, 4) == stream(make(), 16)[12:]
