"""docs/migration.md, "From Orbax": every row, the same loop through Orbax's
``CheckpointManager`` and through pitstop's, side by side in this process: the same steps
kept, the same answers (``should_save``, ``latest_step``, ``best_step``), the same values
restored. Where a row names a difference, the test shows exactly that difference."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import pitstop
from pitstop.interop.orbax import import_orbax
from pitstop.interop.orbax_export import export_orbax

ocp = pytest.importorskip("orbax.checkpoint")

LOSSES = [5.0, 3.0, 4.0, 1.0, 6.0, 2.0, 7.0, 8.0, 9.0, 0.5, 10.0, 11.0]


def state_at(step: int) -> dict[str, Any]:
    """A tiny training state, a pure function of the step."""
    return {"w": jax.numpy.full((2, 3), step, jax.numpy.float32),
            "b": np.arange(4, dtype=np.int32) + step}


def orbax_loop(directory: Path, steps: Iterable[int], *, metrics: bool = False,
               force: Iterable[int] = (), **options: Any) -> dict[str, Any]:
    """Orbax's loop: ``save()`` at every step (Orbax decides), ``should_save`` asked first."""
    asked, forced = [], set(force)
    with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(**options)) as m:
        for s in steps:
            asked.append(m.should_save(s))
            m.save(s, args=ocp.args.StandardSave(state_at(s)), force=s in forced,
                   metrics={"loss": LOSSES[s]} if metrics else None)
        m.wait_until_finished()
        return {"kept": list(m.all_steps()), "should_save": asked, "latest": m.latest_step(),
                "best": m.best_step(), "preempted": m.reached_preemption(max(steps))}


def pitstop_loop(directory: Path, steps: Iterable[int], *, metrics: bool = False,
                 force: Iterable[int] = (), **kwargs: Any) -> dict[str, Any]:
    """The mapped loop: ``step()`` at every step (pitstop decides), ``save()`` where Orbax's
    loop forces one."""
    asked, forced = [], set(force)
    with pitstop.CheckpointManager(directory, on_busy="wait", **kwargs) as m:
        for s in steps:
            asked.append(m.should_save(s))
            loss = {"loss": LOSSES[s]} if metrics else None
            if s in forced:
                m.save(s, state_at(s), loss)
            else:
                m.step(s, state_at(s), loss)
        m.wait_until_finished()
        return {"kept": m.all_steps(), "should_save": asked, "latest": m.latest_step(),
                "best": m.best_step(), "preempted": m.reached_preemption(max(steps))}


def side_by_side(tmp_path: Path, steps: Iterable[int], orbax: dict[str, Any],
                 ours: dict[str, Any], **common: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    steps = list(steps)
    return (orbax_loop(tmp_path / "orbax", steps, **orbax, **common),
            pitstop_loop(tmp_path / "pitstop", steps, **ours, **common))


# ----------------------------------------------------------------------------- the rows
@pytest.mark.parametrize("interval", [None, 3])
def test_max_to_keep_and_save_interval_keep_the_same_steps(tmp_path: Path,
                                                           interval: int | None) -> None:
    """``max_to_keep=3`` (+ ``save_interval_steps``, 1 by default) and ``save()`` at every
    step, as ``keep_last=3, save_every_steps=`` the same (1 when Orbax's is left out) and
    ``step()``; ``save(..., force=True)`` as ``save()``."""
    orbax = {"max_to_keep": 3} | ({"save_interval_steps": interval} if interval else {})
    theirs, ours = side_by_side(tmp_path, range(10), orbax,
                                {"keep_last": 3, "save_every_steps": interval or 1},
                                force=[4] if interval else [])
    assert ours == theirs
    assert theirs["kept"] == ([4, 6, 9] if interval else [7, 8, 9])


def test_a_manager_without_save_every_saves_nothing_on_step(tmp_path: Path) -> None:
    """The row's warning: ``keep_last=3`` alone is not Orbax's ``max_to_keep=3``: pitstop has
    no save interval by default, so ``step()`` saves only on a signal, and says so once."""
    with pytest.warns(UserWarning, match="saves only on a signal"):
        ours = pitstop_loop(tmp_path / "p", range(4), keep_last=3)
    assert ours["kept"] == [] and ours["should_save"] == [False] * 4


def test_orbax_saves_the_first_step_of_an_empty_directory_pitstop_its_multiples(
        tmp_path: Path) -> None:
    """The difference the row names: Orbax also saves the first step it is called with while
    the directory is empty; pitstop only the multiples of ``save_every_steps``."""
    theirs, ours = side_by_side(tmp_path, range(1, 8), {"save_interval_steps": 3},
                                {"save_every_steps": 3})
    assert theirs["kept"] == [1, 3, 6] and ours["kept"] == [3, 6]


def test_save_on_steps_is_on_steps(tmp_path: Path) -> None:
    theirs, ours = side_by_side(
        tmp_path, range(12), {"save_interval_steps": 5, "save_on_steps": {3, 7}},
        {"save_every_steps": 5, "save_policy": pitstop.OnSteps({3, 7})})
    assert ours == theirs
    assert theirs["kept"] == [0, 3, 5, 7, 10]


def test_keep_period_is_keep_every_steps(tmp_path: Path) -> None:
    theirs, ours = side_by_side(
        tmp_path, range(14), {"max_to_keep": 2, "keep_period": 4, "save_interval_steps": 2},
        {"keep_last": 2, "keep_every_steps": 4, "save_every_steps": 2})
    assert ours == theirs
    assert theirs["kept"] == [0, 4, 8, 10, 12]


def test_best_fn_is_best_metric_and_pitstop_also_keeps_the_newest(tmp_path: Path) -> None:
    """``best_fn=lambda m: m["loss"], best_mode="min", max_to_keep=3``: ``keep_best=3,
    best_metric="loss", best_mode="min"`` keeps Orbax's three best and ``best_step()`` says
    the same; pitstop also keeps the newest (the one a resume needs), which Orbax deletes
    here. At an interval, ``retention=[KeepBest(...)]`` saves what Orbax saves (keep_best
    also saves at each improvement)."""
    loss: Callable[[Any], float] = lambda m: m["loss"]  # noqa: E731
    theirs, ours = side_by_side(
        tmp_path, range(12), {"max_to_keep": 3, "best_fn": loss, "best_mode": "min"},
        {"keep_best": 3, "best_metric": "loss", "best_mode": "min", "save_every_steps": 1},
        metrics=True)
    assert theirs["kept"] == [3, 5, 9] and ours["kept"] == [3, 5, 9, 11]
    assert ours["best"] == theirs["best"] == 9
    assert ours["should_save"] == theirs["should_save"]

    steps = range(0, 12)
    theirs = orbax_loop(tmp_path / "o2", steps, metrics=True, max_to_keep=2, best_fn=loss,
                        best_mode="min", save_interval_steps=2)
    ours = pitstop_loop(tmp_path / "p2", steps, metrics=True, save_every_steps=2,
                        retention=[pitstop.KeepBest(2, "loss", "min")], best_metric="loss",
                        best_mode="min")
    assert theirs["kept"] == [0, 2] and ours["kept"] == [0, 2, 10]
    assert ours["best"] == theirs["best"] == 2 and ours["should_save"] == theirs["should_save"]
    # (keep_best at the same interval saves at improvements too: steps 1 and 3 here)
    extra = pitstop_loop(tmp_path / "p3", range(4), metrics=True, save_every_steps=2,
                         keep_best=2, best_metric="loss", best_mode="min")
    assert extra["kept"] == [1, 3]
    assert pitstop_loop(tmp_path / "p4", range(2))["best"] is None  # nothing saved


def test_best_step_without_best_fn_is_the_latest(tmp_path: Path) -> None:
    theirs, ours = side_by_side(tmp_path, range(5), {"save_interval_steps": 2},
                                {"save_every_steps": 2})
    assert ours["best"] == theirs["best"] == ours["latest"] == theirs["latest"] == 4


def test_restore_and_the_directories_each_way(tmp_path: Path) -> None:
    """``restore(step, args=StandardRestore(abstract))`` as ``load(step, target=abstract)``
    or ``restore(state)`` in place: the same values. ``import_orbax`` of Orbax's directory
    holds the steps and values Orbax restores; ``export_orbax`` of pitstop's is restored by
    Orbax as pitstop loads it."""
    theirs, ours = side_by_side(tmp_path, range(5), {"max_to_keep": 2, "save_interval_steps": 2},
                                {"keep_last": 2, "save_every_steps": 2})
    assert ours["kept"] == theirs["kept"] == [2, 4]
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state_at(0))
    with ocp.CheckpointManager(tmp_path / "orbax") as m:
        want = m.restore(2, args=ocp.args.StandardRestore(abstract))
    with pitstop.CheckpointManager(tmp_path / "pitstop", read_only=True) as m:
        got = m.load(2, target=abstract)
        live = state_at(0)
        assert m.restore(live) == 4
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))
        np.testing.assert_array_equal(np.asarray(live[k]), np.asarray(state_at(4)[k]))
    assert import_orbax(tmp_path / "orbax", tmp_path / "imported") == [2, 4]
    with pitstop.CheckpointManager(tmp_path / "imported", read_only=True) as m:
        imported = m.load(2)
    path = export_orbax(tmp_path / "pitstop", 4, tmp_path / "exported")
    back = ocp.StandardCheckpointer().restore(path)
    for k in want:
        np.testing.assert_array_equal(np.asarray(imported[k]), np.asarray(want[k]))
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(state_at(4)[k]))


def test_reached_preemption_is_a_signal_pitstop_saves_on(tmp_path: Path) -> None:
    """Without a preemption both say False (above, ``preempted``). A SIGTERM makes
    ``reached_preemption`` True; the next ``step()`` saves that step, as Orbax saves at its
    preemption sync point, and then leaves as the signal asks (here: the program's own
    handler, which only notes it)."""
    noted: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: noted.append(signum))
    try:
        mgr = pitstop.CheckpointManager(tmp_path / "p", save_every_steps=100)
        mgr.step(0, state_at(0))
        assert not mgr.reached_preemption(1) and not mgr.should_save(1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert mgr.reached_preemption(1) and mgr.should_save(1)
        assert noted == []  # noted by pitstop, not yet acted on
        mgr.step(1, state_at(1))
        assert noted == [signal.SIGTERM] and mgr.closed
        with pitstop.CheckpointManager(tmp_path / "p", read_only=True) as reader:
            assert reader.all_steps() == [0, 1]
    finally:
        signal.signal(signal.SIGTERM, before)


def row_kwargs(orbax_cell: str) -> dict[str, Any]:
    """The keyword arguments the Orbax section of docs/migration.md gives, in the first code
    span of the pitstop column, for the row whose Orbax column starts with ``orbax_cell``:
    the row copied literally."""
    import re
    text = (Path(__file__).parents[3] / "docs" / "migration.md").read_text()
    section = text.split("## From Orbax", 1)[1]
    for line in section.splitlines():
        cells = line.split(" | ")
        if line.startswith(f"| `{orbax_cell}") and len(cells) >= 2:
            span = re.search(r"`([^`]*)`", cells[1]).group(1)  # type: ignore[union-attr]
            span = span.removeprefix("pitstop.CheckpointManager(dir, ").removesuffix(")")
            return eval(f"dict({span})", {"pitstop": pitstop})  # noqa: S307 (our own docs)
    raise AssertionError(f"no row for {orbax_cell!r} in docs/migration.md")


@pytest.mark.parametrize("cell", ["ocp.CheckpointManagerOptions(max_to_keep=3)",
                                  "best_fn="])
def test_the_rows_copied_literally_keep_orbax_steps_while_saves_persist(
        tmp_path: Path, cell: str) -> None:
    """The pitstop column of a row, copied as it is, with each save still persisting when
    the next step is due (its write held until the loop is at that step), as on a real
    disk: the same steps as Orbax's loop (whose save waits for the one in flight), nothing
    skipped."""
    kwargs = row_kwargs(cell)
    best = cell == "best_fn="
    released: set[int] = set()
    import threading
    cond = threading.Condition()

    def hold(step: int) -> None:
        with cond:
            assert cond.wait_for(lambda: step in released, 60), step

    with pitstop.CheckpointManager(tmp_path / "p", save_on_signals=None, memory_tier=False,
                                   **kwargs) as m:
        m.hooks["before_write"] = hold
        for s in range(10):
            with cond:
                released.add(s - 1)
                cond.notify_all()
            m.step(s, state_at(s), {"loss": LOSSES[s]} if best else None)
        with cond:
            released.add(9)
            cond.notify_all()
        m.wait_until_finished()
        assert m.skipped_saves == 0
        kept = m.all_steps()
    loss: Callable[[Any], float] = lambda m: m["loss"]  # noqa: E731
    theirs = orbax_loop(tmp_path / "o", range(10), metrics=best, max_to_keep=3,
                        **({"best_fn": loss, "best_mode": "min"} if best else {}))
    # (keep_best: pitstop also keeps the newest, 9, which is one of Orbax's best here)
    assert kept == theirs["kept"] == ([3, 5, 9] if best else [7, 8, 9])
