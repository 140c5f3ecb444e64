"""The names Orbax users call on a manager: ``should_save``, ``best_step``,
``reached_preemption``, ``wait_until_finished``, the ``OnSteps`` policy (against Orbax itself, loop by loop:
tests/adapters/jax/test_migration_orbax.py; with real processes: tests/adapters/jax/test_multiprocess.py)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from thread_ranks import ranks

import pitstop
from pitstop.core.runtime.coordination import Coordinator


def manager(d: Path, **kw: Any) -> pitstop.CheckpointManager:
    return pitstop.CheckpointManager(d, **{"save_on_signals": None, "memory_tier": False,
                                           "on_busy": "wait", **kw})


def state(step: int) -> dict[str, Any]:
    return {"w": np.full(3, step, np.float32)}


def test_should_save_says_what_step_does(tmp_path: Path) -> None:
    with manager(tmp_path / "a", save_every_steps=3) as mgr:
        said, saved = [], []
        for s in range(8):
            said.append(mgr.should_save(s))
            saved.append(mgr.step(s, state(s)) is not None)
        assert said == saved == [s % 3 == 0 for s in range(8)]
        mgr.wait_until_finished()
        assert mgr.all_steps() == [0, 3, 6]
        assert not mgr.should_save(6)  # it has a checkpoint: step() would not save it again
    with manager(tmp_path / "b", keep_last=2) as mgr:
        assert not mgr.should_save(0)  # no save policy: step() saves only on a signal
        mgr._signals.pending = signal.SIGUSR1  # ("checkpoint now": not a preemption)
        assert mgr.should_save(0) and not mgr.reached_preemption(0)
        mgr._signals.pending = None
    with manager(tmp_path / "c", keep_best=1, best_metric="loss") as mgr:
        assert mgr.should_save(0, {"loss": 1.0})  # saves at an improvement
        assert not mgr.should_save(0)
    with pitstop.CheckpointManager(tmp_path / "a", read_only=True) as mgr:
        assert not mgr.should_save(9)


@pytest.mark.parametrize("mode, best", [("min", 3), ("max", 4)])
def test_best_step_ranks_by_best_metric_newest_of_equals(tmp_path: Path, mode: str,
                                                         best: int) -> None:
    losses = {0: 5.0, 1: 2.0, 2: 9.0, 3: 2.0, 4: 9.0}
    with manager(tmp_path / mode, best_metric="loss", best_mode=mode) as mgr:
        assert mgr.best_step() is None
        mgr.save(9, state(9))  # no metric: never the best
        assert mgr.best_step() is None
        for s, v in losses.items():
            mgr.save(s, state(s), {"loss": v})
        assert mgr.best_step() == best  # the save in flight counts
    with manager(tmp_path / "plain") as mgr:
        mgr.save(2, state(2))
        mgr.save(1, state(1))
        assert mgr.best_step() == mgr.latest_step() == 2


def test_reached_preemption_is_agreed_by_every_rank(tmp_path: Path) -> None:
    """A terminating signal one rank received is every rank's answer at that step."""
    def job(rank: int, coord: Coordinator) -> Any:
        mgr = pitstop.CheckpointManager(tmp_path / "ck", distributed=coord,
                                        save_on_signals=None, memory_tier=False)
        try:
            before = mgr.reached_preemption(1)
            if rank == 1:
                mgr._signals.pending = signal.SIGTERM
            after = mgr.reached_preemption(2)
            return before, after, mgr._signals.pending
        finally:
            mgr._signals.pending = None  # (acting on it would end this test process)
            mgr.close()

    assert ranks(2, job) == [(False, True, signal.SIGTERM)] * 2


def test_on_steps_saves_the_steps_it_names_and_refuses_what_is_not_a_step(tmp_path: Path
                                                                        ) -> None:
    with manager(tmp_path / "d", save_policy=pitstop.OnSteps([2, 5])) as mgr:
        for s in range(7):
            mgr.step(s, state(s))
        mgr.wait()
        assert mgr.all_steps() == [2, 5]
    for bad in (3, [1.5], [-1], [True]):
        with pytest.raises(pitstop.InvalidArgumentError, match="OnSteps"):
            pitstop.OnSteps(bad)


def test_a_step_that_can_never_save_says_so_once(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """``keep_last=3`` alone (Orbax's ``max_to_keep=3`` read as if its interval were
    pitstop's) makes ``step()`` save only on a signal: the first step says so, with the fix,
    once; a manager with a policy says nothing."""
    with manager(tmp_path / "a", keep_last=3) as mgr:
        with pytest.warns(UserWarning, match="saves only on a signal.*save_every_steps=N"):
            assert mgr.step(0, state(0)) is None
        with caplog.at_level("WARNING", logger="pitstop"):
            caplog.clear()
            for s in range(1, 4):
                assert mgr.step(s, state(s)) is None
        assert not [r for r in caplog.records if "saves only on a signal" in r.getMessage()]
        assert mgr.all_steps() == []
    with manager(tmp_path / "b", save_every_steps=2) as mgr:
        with caplog.at_level("WARNING", logger="pitstop"):
            caplog.clear()
            mgr.step(0, state(0))
        assert not [r for r in caplog.records if "saves only on a signal" in r.getMessage()]


def test_on_steps_takes_numpy_steps_as_orbax_save_on_steps_does(tmp_path: Path) -> None:
    """``save_on_steps=set(np.arange(0, 100, 25))`` works in Orbax (its steps are hashed as
    ints); ``OnSteps`` of the same numpy integers saves those steps (a float is refused)."""
    import numpy as np
    with manager(tmp_path / "d", save_policy=pitstop.OnSteps(np.arange(1, 7, 3))) as mgr:
        for s in range(7):
            mgr.step(s, state(s))
        mgr.wait()
        assert mgr.all_steps() == [1, 4]
    assert pitstop.OnSteps({np.int64(3)}).steps == {3}
    with pytest.raises(pitstop.InvalidArgumentError, match="OnSteps"):
        pitstop.OnSteps([np.float32(3)])


def test_should_save_is_agreed_by_every_rank_as_orbax_s(tmp_path: Path) -> None:
    """Orbax's loop ``if mgr.should_save(step): mgr.save(step, ...)`` on every process (its
    should_save is a preemption sync point of all processes): a signal one rank received, or
    a rank's own interval, is every rank's answer, so the ranks save the same steps instead
    of one rank waiting in a save the others never make."""
    def job(rank: int, coord: Coordinator) -> Any:
        mgr = pitstop.CheckpointManager(tmp_path / "ck", distributed=coord,
                                        save_every_steps=3 if rank == 0 else 4,
                                        save_on_signals=None, memory_tier=False)
        try:
            asked = []
            for s in range(1, 6):
                if rank == 1 and s == 2:
                    mgr._signals.pending = signal.SIGUSR1  # ("checkpoint now")
                asked.append(mgr.should_save(s))
                if asked[-1]:
                    mgr.save(s, state(s))
            mgr.wait()
            return asked, mgr.all_steps()
        finally:
            mgr._signals.pending = None
            mgr.close()

    assert ranks(2, job) == [([False, True, True, True, False], [2, 3, 4])] * 2


def test_on_steps_of_a_huge_range_is_lazy_as_orbax_s_container(tmp_path: Path) -> None:
    """Orbax's ``save_on_steps`` is any container (``step in steps``): a range of 10**15
    steps costs nothing there; ``OnSteps`` of it is not materialised (before: a set of every
    step, which never finishes)."""
    every7 = pitstop.OnSteps(range(0, 10**15, 7))
    with manager(tmp_path / "d", save_policy=every7) as mgr:
        for s in range(9):
            mgr.step(s, state(s))
        mgr.wait()
        assert mgr.all_steps() == [0, 7]
    for bad in (range(-3, 5), range(5, -3, -1)):
        with pytest.raises(pitstop.InvalidArgumentError, match="OnSteps"):
            pitstop.OnSteps(bad)
    assert pitstop.OnSteps(range(10, 0, -1)).steps == range(10, 0, -1)
