"""The multi-rank protocol of the core, with ranks as threads of this process joined by an
in-memory coordinator (the real ones, on torch.distributed and JAX, are tested with real
processes in tests/adapters/torch/test_distributed.py and tests/adapters/jax/test_multiprocess.py)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from thread_ranks import ranks

import pitstop
from pitstop.core.format.validate import parse
from pitstop.core.runtime.coordination import CoordinationError, Coordinator, Holding, plan


def manager(d: Path, coord: Coordinator | None, **kw: Any) -> pitstop.CheckpointManager:
    kw = {"save_on_signals": None, "memory_tier": False, **kw}
    return pitstop.CheckpointManager(d, distributed=coord if coord else False, **kw)


def state_of(rank: int) -> dict[str, Any]:
    return {"w": np.arange(1000, dtype=np.float32), "b": np.ones(10), "mine": np.full(3, rank),
            "info": {"rank": rank}}


# --------------------------------------------------------------------------- the plan
def test_replicated_state_is_split_between_ranks_and_written_once() -> None:
    held = [[Holding(f"k{i}", 100, "h") for i in range(10)] for _ in range(2)]
    writes, writer = plan(held)
    assert writes[0] | writes[1] == {f"k{i}" for i in range(10)}
    assert not writes[0] & writes[1]
    assert len(writes[0]) == len(writes[1]) == 5
    # consecutive runs: rank 0 takes the first half
    assert writes[0] == {f"k{i}" for i in range(5)}
    assert set(writer.values()) == {0, 1}


def test_what_differs_is_written_by_its_own_rank() -> None:
    held = [[Holding("w", 800, "same"), Holding("mine", 8, f"r{r}")] for r in range(3)]
    writes, writer = plan(held)
    assert [writer[("mine", f"r{r}")] for r in range(3)] == [0, 1, 2]
    assert sum("w" in w for w in writes) == 1


# --------------------------------------------------------------------------- saves
def test_two_ranks_save_one_checkpoint_and_restore_their_own_parts(tmp_path: Path) -> None:
    d = tmp_path / "ck"

    def job(rank: int, coord: Coordinator) -> Any:
        with manager(d, coord, keep_last=2) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, state_of(rank)).wait()

    ranks(2, job)
    # the leader's retention (after the commit: another rank may still list step 1 for a
    # moment after its wait() returned)
    with pitstop.CheckpointManager(d, read_only=True) as mgr:
        assert mgr.all_steps() == [2, 3]
    raw = (d / "step_0000000003" / "manifest.json").read_bytes()
    m = parse(raw, "m")
    assert m.world == 2 and m.rank_specific() == ["info", "mine"]
    assert m.view(1).arrays["w"] is m.arrays["w"]  # stored once
    assert sorted({f.split("-")[1] for f in m.files}) == ["r00000", "r00001"]
    # the schema of docs/format.md knows the world section
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((Path(__file__).parents[3] / "docs" / "manifest.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(json.loads(raw))

    def resume(rank: int, coord: Coordinator) -> Any:
        state = {"w": np.zeros(1000, np.float32), "b": np.zeros(10), "mine": np.zeros(3, int),
                 "info": {}}
        with manager(d, coord) as mgr:
            return mgr.restore(state), state["mine"].tolist(), state["info"]

    assert ranks(2, resume) == [(3, [0, 0, 0], {"rank": 0}), (3, [1, 1, 1], {"rank": 1})]
    # three ranks from a two-rank save: rank 2 gets rank 0's own entries, and is told
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got = ranks(3, resume)
    assert [g[1] for g in got] == [[0] * 3, [1] * 3, [0] * 3]
    assert any("'info', 'mine'" in str(w.message) for w in said)


def test_a_rank_whose_write_fails_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    d = tmp_path / "ck"

    def job(rank: int, coord: Coordinator) -> Any:
        with manager(d, coord) as mgr:
            mgr.save(1, state_of(rank)).wait()
            if rank == 1:
                def full(step: int) -> None:
                    raise OSError(28, "No space left on device")
                mgr.hooks["before_write"] = full
            try:
                mgr.save(2, state_of(rank)).wait()
            except pitstop.CheckpointWriteError as e:
                error = str(e)
            mgr.hooks.clear()
            mgr.save(3, state_of(rank)).wait()  # the next save goes through
            return error, mgr.all_steps()

    for error, steps in ranks(2, job):
        assert "rank 1: OSError: [Errno 28] No space left on device" in error
        assert "not committed" in error
        assert steps == [1, 3]
    assert sorted(p.name for p in d.iterdir()) == [".pitstop", "step_0000000001",
                                                   "step_0000000003"]


def test_the_nonfinite_guard_of_one_rank_skips_the_step_on_every_rank(tmp_path: Path) -> None:
    d = tmp_path / "ck"

    def job(rank: int, coord: Coordinator) -> Any:
        with manager(d, coord, nonfinite_guard=True) as mgr:
            state = state_of(rank)
            if rank == 1:
                state["b"][3] = np.nan
            h = mgr.save(1, state)
            h.wait()
            return h.stats.skipped, mgr.all_steps()

    for skipped, steps in ranks(2, job):
        assert "rank(s) [1]" in skipped and steps == []


def test_a_corrupt_file_of_one_rank_makes_every_rank_fall_back(tmp_path: Path) -> None:
    d = tmp_path / "ck"

    def job(rank: int, coord: Coordinator) -> Any:
        with manager(d, coord) as mgr:
            mgr.save(1, state_of(rank)).wait()
            mgr.save(2, {**state_of(rank), "mine": np.full(3, 10 + rank)}).wait()

    ranks(2, job)
    m = parse((d / "step_0000000002" / "manifest.json").read_bytes(), "m")
    entry = m.ranks[0].arrays["mine"]  # rank 1's own tensor
    path = d / "step_0000000002" / entry.file
    raw = bytearray(path.read_bytes())
    raw[entry.offset] ^= 0xFF
    path.write_bytes(bytes(raw))

    def resume(rank: int, coord: Coordinator) -> Any:
        state = {"w": np.zeros(1000, np.float32), "b": np.zeros(10), "mine": np.zeros(3, int),
                 "info": {}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with manager(d, coord) as mgr:
                return mgr.restore(state), state["mine"].tolist(), mgr.all_steps()

    assert ranks(2, resume) == [(1, [0] * 3, [1]), (1, [1] * 3, [1])]
    assert any(p.name.startswith("step_0000000002.corrupt") for p in d.iterdir())


def test_ranks_saving_different_steps_are_refused_on_every_rank(tmp_path: Path) -> None:
    def job(rank: int, coord: Coordinator) -> Any:
        with manager(tmp_path / "ck", coord) as mgr:
            try:
                mgr.save(5 + rank, state_of(rank)).wait()
            except CoordinationError as e:
                return str(e), mgr.all_steps()

    for text, steps in ranks(2, job):
        assert "rank 0: 5, rank 1: 6" in text and steps == []


def test_a_step_is_saved_by_every_rank_when_any_rank_wants_it(tmp_path: Path) -> None:
    """``save_every_seconds`` decides on each rank's clock: they save together."""
    class Odd(pitstop.EveryNSteps):
        def __init__(self, rank: int) -> None:
            super().__init__(1)
            self.rank = rank

        def should_save(self, step: int, ctx: Any) -> bool:
            return step % 2 == self.rank  # rank 0 wants even steps, rank 1 odd ones

    def job(rank: int, coord: Coordinator) -> Any:
        with manager(tmp_path / "ck", coord, save_policy=Odd(rank), on_busy="wait") as mgr:
            for step in range(4):
                mgr.step(step, state_of(rank))
            mgr.wait()
            return mgr.all_steps()

    assert ranks(2, job) == [[0, 1, 2, 3]] * 2
