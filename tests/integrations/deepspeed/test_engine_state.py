"""engine_state: a DeepSpeed engine saved and restored through pitstop, bitwise, and the
misuses a DeepSpeed user may try."""

from __future__ import annotations

import warnings

import ds_helpers as h
import pytest
import torch

import pitstop
from pitstop.integrations.deepspeed import engine_state


def _state(engine, loader, client=None):
    return {"engine": engine_state(engine, client_state=client), "loader": loader,
            "rng": pitstop.RNG()}


@pytest.mark.parametrize("stage", [0])  # ZeRO-2: test_kill_resume; ZeRO-1: test_import
def test_restore_resumes_bitwise(ds_dist, tmp_path, stage):
    """Saved at step 3 of 8, restored into an engine built from other weights: the steps
    after it, the weights, moments, fp32 partitions, lr and counters are the reference's."""
    engine, loader = h.build(stage)
    client = {"epoch_note": "a", "best": 1.5}
    state = _state(engine, loader, client)
    with pitstop.CheckpointManager(tmp_path, save_every_steps=100, on_busy="wait") as mgr:
        h.train(engine, loader, mgr, state, 8, stop_at=3)
        mgr.save(3, state).wait()
        client["best"] = 0.25  # changed after the save: the restore puts 1.5 back
        ref = h.train(engine, loader, mgr, state, 8)
    want = h.snapshot(engine)

    engine2, loader2 = h.build(stage, seed=7)
    client2: dict = {}
    state2 = _state(engine2, loader2, client2)
    with pitstop.CheckpointManager(tmp_path, read_only=True) as mgr:
        mgr.restore(state2, step=3)
        assert (engine2.global_steps, engine2.micro_steps) == (4, 4 * h.ACCUMULATION)
        assert client2 == {"epoch_note": "a", "best": 1.5}
        got = h.train(engine2, loader2, _NoSave(), state2, 8)
    assert got == ref and sorted(got) == list(range(4, 8))
    h.assert_same(want, h.snapshot(engine2))


class _NoSave:
    """A manager stand-in after the restore: the loop's saves are not what is tested."""

    def restore(self, state):
        return 3

    def step(self, step, state, metrics=None):
        return None


def test_other_stage_or_world_is_refused_before_anything_changes(ds_dist, tmp_path):
    engine, loader = h.build(1)
    state = _state(engine, loader)
    with pitstop.CheckpointManager(tmp_path, on_busy="wait") as mgr:
        h.train(engine, loader, mgr, state, 2)
        mgr.save(1, state).wait()
    other, loader0 = h.build(0, seed=3)
    before = h.snapshot(other)
    with pitstop.CheckpointManager(tmp_path, read_only=True) as mgr, \
            pytest.raises(pitstop.CheckpointError) as e:
        mgr.restore(_state(other, loader0))
    assert "fp32_groups" in str(e.value)
    h.assert_same(before, h.snapshot(other))
    # an engine of another data-parallel world (as after a restart on fewer ranks): refused
    # by name, before anything is restored
    engine2, loader2 = h.build(1, seed=3)
    before = h.snapshot(engine2)
    engine2.dp_world_size = 2
    with pitstop.CheckpointManager(tmp_path, read_only=True) as mgr, \
            pytest.raises(pitstop.CheckpointError, match="saved by 1 data-parallel") as e:
        mgr.restore(_state(engine2, loader2), step=1)
    assert "nothing was changed" in str(e.value)
    engine2.dp_world_size = 1
    h.assert_same(before, h.snapshot(engine2))


def test_misuse_is_said(ds_dist):
    """Not an engine, a DeepSpeed dataloader (no position), a client_state that is not a
    dict, ZeRO-3: each said by name."""
    with pytest.raises(pitstop.InvalidArgumentError, match="deepspeed.initialize"):
        engine_state(torch.nn.Linear(2, 2))
    engine, loader = h.build(0, dataloader=True)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        engine_state(engine)
    assert any("training_dataloader" in str(w.message) for w in said)
    with pytest.raises(pitstop.InvalidArgumentError, match="client_state"):
        engine_state(engine, client_state=[1])
    import deepspeed

    model = torch.nn.Linear(4, 4)
    zero3, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters()),
        config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}})
    with pytest.raises(pitstop.UnsupportedStateError, match="Stage3.*stages 1 and 2"):
        engine_state(zero3)


def test_nonfinite_guard_rolls_the_engine_back(ds_dist, tmp_path):
    """A step that blew up (NaN in the ZeRO master weights) is saved flagged; rollback()
    puts the engine back at the newest finite step, counters included."""
    engine, loader = h.build(1)
    state = _state(engine, loader)
    with pitstop.CheckpointManager(tmp_path, save_every_steps=1, on_busy="wait",
                                   nonfinite_guard=True) as mgr:
        h.train(engine, loader, mgr, state, 3)
        mgr.wait()
        want = h.snapshot(engine)
        engine.optimizer.single_partition_of_fp32_groups[0].data[0] = float("nan")
        engine.global_steps += 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pitstop says the save holds a NaN
            mgr.save(3, state).wait()
        assert mgr.rollback(state) == 2
    h.assert_same(want, h.snapshot(engine))
