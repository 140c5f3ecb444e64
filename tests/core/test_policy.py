"""When to save (steps, seconds, best metric, Young/Daly), the non-finite guard, rollback,
"latest" and retention only after a commit, and the cost of a step that does not save."""

from __future__ import annotations

import gc
import logging
import math
import re
import sys
import threading
import time
import tracemalloc

import numpy as np
import pytest

import pitstop
from pitstop.core.policy import CheckpointInfo, KeepLast, to_delete


class Gate:
    def __init__(self, steps=None) -> None:
        self.steps = steps
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, step: int) -> None:
        if self.steps is None or step in self.steps:
            self.entered.set()
            assert self.release.wait(60)


@pytest.fixture
def managers(tmp_path):
    made = []

    def make(directory=None, gate: Gate | None = None, **kw) -> pitstop.CheckpointManager:
        kw.setdefault("memory_tier", False)
        kw.setdefault("save_on_signals", None)
        m = pitstop.CheckpointManager(directory or tmp_path / "ckpt", **kw)
        if gate is not None:
            m.hooks["before_write"] = gate
        made.append((m, gate))
        return m

    yield make
    for m, gate in made:
        if gate is not None:
            gate.release.set()
        try:
            m.close()
        except pitstop.CheckpointError:
            pass


def small_state(v: float = 0.0) -> dict:
    return {"w": np.full(256, v, np.float32), "b": np.full(4, v, np.float64),
            "step": int(v)}


def run(mgr, steps, state=None, metrics_of=None) -> list[int]:
    """Call mgr.step for each step (waiting for each save); return the steps that saved."""
    saved = []
    for s in steps:
        st = state if state is not None else small_state(s)
        h = mgr.step(s, st, metrics_of(s) if metrics_of else None)
        if h is not None:
            h.wait()
            if h.committed:
                saved.append(s)
    return saved


# ------------------------------------------------------------------ cadence
def test_save_every_steps(managers):
    mgr = managers(save_every_steps=5)
    assert run(mgr, range(0, 23)) == [0, 5, 10, 15, 20]
    assert mgr.all_steps() == [0, 5, 10, 15, 20]
    np.testing.assert_array_equal(mgr.load(15)["w"], small_state(15)["w"])


def test_save_every_seconds(managers):
    interval = 0.15
    mgr = managers(save_every_seconds=interval)
    times = []
    t_created = time.monotonic()
    s = 0
    while len(times) < 3 and time.monotonic() - t_created < 30:
        h = mgr.step(s, small_state(s))
        if h is not None:
            times.append(time.monotonic())
            h.wait()
        s += 1
        time.sleep(0.005)
    assert len(times) == 3
    assert len(mgr.all_steps()) == 3
    assert mgr.all_steps()[0] > 0  # nothing at once: the first save comes after the interval
    gaps = np.diff([t_created] + times)
    assert (gaps >= interval).all()  # never more often than asked


def test_save_on_metric_improvement(managers):
    losses = [5.0, 4.0, 6.0, 3.0, 3.0, 7.0, 2.0, 2.5]
    mgr = managers(keep_best=10, best_metric="loss", best_mode="min")
    saved = run(mgr, range(len(losses)), metrics_of=lambda s: {"loss": losses[s]})
    assert saved == [0, 1, 3, 6]
    assert mgr.metadata(6).metrics == {"loss": 2.0}


def test_save_on_metric_improvement_max_mode_combined_with_steps(managers):
    acc = [0.1, 0.2, 0.15, 0.15, 0.3, 0.25, 0.2, 0.2, 0.2, 0.2]
    mgr = managers(keep_best=10, best_metric="acc", best_mode="max", save_every_steps=4)
    saved = run(mgr, range(len(acc)), metrics_of=lambda s: {"acc": acc[s]})
    # improvements: 0, 1, 4 ; every 4 steps: 0, 4, 8
    assert saved == [0, 1, 4, 8]


def test_best_metric_survives_a_restart(managers, tmp_path):
    mgr = managers(keep_best=3, best_metric="loss")
    run(mgr, range(3), metrics_of=lambda s: {"loss": [3.0, 2.0, 2.5][s]})
    mgr.close()
    mgr = managers(keep_best=3, best_metric="loss")
    # 2.5 is not better than the committed best 2.0; 1.0 is
    assert run(mgr, [3, 4], metrics_of=lambda s: {"loss": {3: 2.5, 4: 1.0}[s]}) == [4]


def test_improvement_skipped_while_busy_is_saved_at_the_next_chance(managers):
    gate = Gate({0})
    mgr = managers(gate=gate, keep_best=5, best_metric="loss", on_busy="skip")
    st = small_state()
    mgr.step(0, st, {"loss": 5.0})
    assert gate.entered.wait(30)
    # an improvement arrives while step 0 persists: skipped (the engine is busy)...
    assert mgr.step(1, st, {"loss": 4.0}) is None
    gate.release.set()
    mgr.wait()
    # ...so the same, still-unsaved improvement must be saved at the next step
    h = mgr.step(2, st, {"loss": 4.0})
    assert h is not None
    h.wait()
    assert mgr.all_steps() == [0, 2]


def _logged_intervals(caplog) -> list[tuple[float, float]]:
    out = []
    for r in caplog.records:
        m = re.search(r"automatic save interval ([\d.]+) s \(Young/Daly: save cost ([\d.]+) s",
                      r.getMessage())
        if m:
            out.append((float(m.group(1)), float(m.group(2))))
    return out


def test_automatic_interval_is_young_daly_of_the_measured_cost(managers, caplog):
    caplog.set_level(logging.INFO, logger="pitstop")
    mtbf = 1e9
    mgr = managers(mtbf_seconds=mtbf)
    state = small_state()
    saved = run(mgr, range(0, 50), state=state)
    assert saved == [0]  # the first step measures the cost; the interval is then long
    cost = mgr.stats[0].stall_s
    expected = math.sqrt(2 * cost * mtbf)
    assert mgr._auto.interval_s == pytest.approx(expected)
    logged = _logged_intervals(caplog)
    assert len(logged) == 1
    interval, logged_cost = logged[0]
    assert interval == pytest.approx(expected, abs=0.051)
    assert logged_cost == pytest.approx(cost, abs=0.0006)


def test_automatic_interval_saves_when_due(managers):
    # a tiny MTBF gives an interval below the 1 s floor: saves come every ~1 s
    mgr = managers(mtbf_seconds=1e-3)
    t0 = time.monotonic()  # the save's time is taken after this
    first = mgr.step(0, small_state())
    assert first is not None
    first.wait()
    assert mgr._auto.interval_s == 1.0
    s = 1
    while mgr.all_steps() == [0] and time.monotonic() - t0 < 30:
        h = mgr.step(s, small_state(s))
        if h is not None:
            h.wait()
            assert time.monotonic() - t0 >= 1.0  # not before the interval
        s += 1
        time.sleep(0.01)
    assert len(mgr.all_steps()) == 2


def test_automatic_interval_measures_again_after_a_restart(managers):
    mgr = managers(save_every_steps=1)
    run(mgr, [0])
    mgr.close()
    mgr = managers(mtbf_seconds=1e9)
    state = small_state()
    assert mgr.restore(state) == 0
    # no cost measured in this process yet: the first step saves to measure it
    assert run(mgr, range(1, 20), state=state) == [1]
    assert mgr._auto.interval_s is not None


# ------------------------------------------------------------------ non-finite guard
def test_nonfinite_metric_is_not_saved(managers):
    mgr = managers(nonfinite_guard=True, save_every_steps=1)
    assert run(mgr, [0]) == [0]
    h = mgr.step(1, small_state(1), {"loss": float("nan")})
    assert h is not None and not h.committed and h.stats.skipped
    h = mgr.save(2, small_state(2), {"loss": np.float32("inf")})
    assert h.wait() and not h.committed
    assert mgr.all_steps() == [0]


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_arrays_are_not_saved(managers, compression, bad):
    mgr = managers(nonfinite_guard=True, save_every_steps=1, compression=compression)
    assert run(mgr, [0]) == [0]
    st = small_state(1)
    st["b"][2] = bad
    h = mgr.step(1, st, {"loss": 1.0})
    h.wait()
    assert not h.committed and "NaN or Inf" in h.stats.skipped
    assert mgr.all_steps() == [0]
    assert mgr.metadata(0).all_finite is True


def test_rollback_restores_newest_all_finite(managers):
    mgr = managers(nonfinite_guard=True, save_every_steps=2, keep_last=2)
    state = small_state()
    for s in range(0, 12):
        state["w"][:] = s if s < 7 else np.nan  # training diverges at step 7
        state["step"] = s
        h = mgr.step(s, state, {"loss": 1.0})
        if h is not None:
            h.wait()
    assert mgr.all_steps() == [4, 6]  # 8 and 10 were not saved
    assert mgr.rollback(state) == 6
    assert (state["w"] == 6).all() and state["step"] == 6


def test_rollback_waits_for_a_pending_save(managers):
    gate = Gate({6})
    mgr = managers(gate=gate, nonfinite_guard=True)
    state = small_state(4)
    mgr.save(4, state).wait()
    state = small_state(6)
    mgr.save(6, state)
    assert gate.entered.wait(30)
    threading.Timer(0.3, gate.release.set).start()
    state["w"][:] = np.nan
    assert mgr.rollback(state) == 6  # the newest all-finite checkpoint, once committed
    assert (state["w"] == 6).all()


def test_retention_never_evicts_newest_all_finite(managers, tmp_path):
    mgr = managers(nonfinite_guard=True)
    mgr.save(1, small_state(1)).wait()
    mgr.save(2, small_state(2)).wait()
    mgr.close()
    # the same run, later without the guard, writes diverged checkpoints
    mgr = managers(keep_last=1)
    for s in (3, 4, 5):
        st = small_state(s)
        st["w"][:] = np.nan
        mgr.save(s, st).wait()
    assert mgr.all_steps() == [2, 5]  # keep_last=1 keeps 5; 2 is the newest all-finite
    state = small_state()
    assert mgr.rollback(state) == 2
    assert (state["w"] == 2).all()


def test_to_delete_protects_newest_and_newest_finite():
    cps = [CheckpointInfo(1, {}, all_finite=True), CheckpointInfo(2, {}, all_finite=True),
           CheckpointInfo(3, {}, all_finite=False), CheckpointInfo(4, {}, all_finite=False)]
    assert to_delete(cps, [KeepLast(1)]) == [1, 3]


# ------------------------------------------------------------------ commit-time effects
def test_latest_and_retention_move_only_after_commit(managers, tmp_path):
    gate = Gate({3})
    mgr = managers(gate=gate, keep_last=1)
    mgr.save(1, small_state(1)).wait()
    mgr.save(2, small_state(2)).wait()
    assert mgr.all_steps() == [2] and mgr.latest_step() == 2
    index_before = (tmp_path / "ckpt" / ".pitstop" / "index.json").read_bytes()
    h = mgr.save(3, small_state(3))
    assert gate.entered.wait(30)
    # snapshot taken: nothing committed and retention has not run; the manager already
    # names step 3 (restore() and load() would wait for it and return it)
    assert mgr._committed() == [2]
    assert mgr.latest_step() == 3 and mgr.all_steps() == [2, 3]
    assert (tmp_path / "ckpt" / ".pitstop" / "index.json").read_bytes() == index_before
    ro = pitstop.CheckpointManager(tmp_path / "ckpt", read_only=True)
    assert ro.latest_step() == 2
    gate.release.set()
    h.wait()
    assert mgr.latest_step() == 3 and mgr.all_steps() == [3]


# ------------------------------------------------------------------ cheap steps
def _policy_rich_manager(managers):
    return managers(save_every_steps=1_000_000, save_every_seconds=1e6, keep_best=2,
                    best_metric="loss", mtbf_seconds=1e9, nonfinite_guard=True)


def test_non_saving_steps_touch_no_file(managers):
    mgr = _policy_rich_manager(managers)
    state = small_state()
    metrics = {"loss": 1.0}
    h = mgr.step(0, state, metrics)  # saves (step 0, first metric, cost measurement)
    assert h is not None
    h.wait()
    main = threading.get_ident()
    events: list[str] = []
    watching = [True]

    def hook(event, args):
        if watching[0] and threading.get_ident() == main and (
                event in ("open", "os.listdir", "os.scandir", "os.stat", "os.remove",
                          "os.rename", "os.mkdir") or event.startswith("os.")):
            events.append(event)

    sys.addaudithook(hook)
    try:
        for s in range(1, 1001):
            assert mgr.step(s, state, metrics) is None
    finally:
        watching[0] = False
    assert events == []


def test_non_saving_steps_do_not_grow_the_heap(managers):
    mgr = _policy_rich_manager(managers)
    state = small_state()
    metrics = {"loss": 1.0}
    mgr.step(0, state, metrics).wait()
    for s in range(1, 100):  # warm up
        mgr.step(s, state, metrics)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for s in range(100, 20_100):
            mgr.step(s, state, metrics)
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    flt = [tracemalloc.Filter(True, "*pitstop*")]
    diff = after.filter_traces(flt).compare_to(before.filter_traces(flt), "filename")
    grown = sum(d.size_diff for d in diff)
    # 20,000 calls: any per-call leak would be hundreds of KiB
    assert grown < 1024, [str(d) for d in diff[:5]]
