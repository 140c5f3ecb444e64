"""The manager's lifecycle: a forked child touches nothing of the parent's, a script that
never calls close() loses no accepted save, a run that goes back to an older step never
mixes with the one it abandoned, saves of a step in flight and bad arguments are refused at
once, with errors a user can act on.

Scenarios that fork or exit run in a subprocess (a real fork, a real interpreter exit).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import pitstop
from pitstop.core.directory.names import parse_aside_name, step_name
from pitstop.core.save.memtier import MemoryTier

PY = sys.executable
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SHM = "/dev/shm"


def run_child(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-c", textwrap.dedent(code), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def open_mgr(directory, **kw) -> pitstop.CheckpointManager:
    kw.setdefault("memory_tier", False)
    kw.setdefault("save_on_signals", None)
    return pitstop.CheckpointManager(directory, **kw)


def state_of(step: int) -> dict:
    return {"w": np.arange(10_000, dtype=np.float64) * step, "meta": {"step": step}}


def tier_files(directory) -> list[str]:
    ident = json.loads((directory / ".pitstop" / "directory.json").read_text())["directory_id"]
    return MemoryTier(SHM, str(directory), ident).files()


# ------------------------------------------------------------------ fork
_FORK = """
    import gc, json, os, sys
    import numpy as np
    import pitstop
    d, save_first = sys.argv[1], sys.argv[2] == "1"
    mgr = pitstop.CheckpointManager(d, save_on_signals=None)   # memory tier on (default)
    def state_of(step):
        return {"w": np.arange(200_000, dtype=np.float64) * step, "meta": {"step": step}}
    if save_first:
        mgr.save(1, state_of(1)).wait()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                      # the child: every call refused, nothing touched
        os.close(r)
        out = {}
        for name, call in [
                ("save", lambda: mgr.save(50, state_of(50))),
                ("step", lambda: mgr.step(51, state_of(51))),
                ("restore", lambda: mgr.restore(state_of(0))),
                ("load", lambda: mgr.load()),
                ("latest_step", lambda: mgr.latest_step()),
                ("wait", lambda: mgr.wait())]:
            try:
                call()
                out[name] = "no error"
            except pitstop.CheckpointError as e:
                out[name] = str(e)
        mgr.close()                   # a no-op in the child
        with mgr:                     # leaving `with` touches nothing either
            pass
        own = pitstop.CheckpointManager(d, read_only=True)   # the child's own manager works
        out["own_latest"] = own.latest_step()
        os.write(w, json.dumps(out).encode())
        os.close(w)
        del mgr
        gc.collect()                  # the child's garbage collector ...
        sys.exit(0)                   # ... and its interpreter exit (atexit) touch nothing
    os.close(w)
    child = json.loads(os.read(r, 1 << 16).decode())
    _, status = os.waitpid(pid, 0)
    for s in range(2, 12):            # the parent goes on saving, every step
        mgr.save(s, state_of(s)).wait()
    print(json.dumps({"child": child, "status": status,
                      "tier": sorted(os.listdir("/dev/shm"))}))
    mgr.close()
"""


@pytest.mark.parametrize("save_first", [True, False], ids=["after-a-save", "before-any-save"])
def test_a_forked_child_touches_nothing_of_the_parents(tmp_path, save_first):
    d = tmp_path / "ckpt"
    r = run_child(_FORK, d, "1" if save_first else "0")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["status"] == 0
    for call in ("save", "step", "restore", "load", "latest_step", "wait"):
        assert "forked process" in out["child"][call] and "read_only=True" in out["child"][call]
    assert out["child"]["own_latest"] == (1 if save_first else None)
    # every one of the parent's saves is intact: hash-verified and with the parent's values
    with open_mgr(d, read_only=True) as ro:
        steps = ro.all_steps()
        assert steps == ([1] if save_first else []) + list(range(2, 12))
        for s in steps:
            got = ro.load(s)
            np.testing.assert_array_equal(got["w"], np.arange(200_000, dtype=np.float64) * s)
            assert got["meta"] == {"step": s}
    # the parent's clean close removed its tier files (the child deleted none of them early,
    # or the parent's later saves would have failed)
    assert not tier_files(d)


# ------------------------------------------------------------------ exit without close()
_NO_CLOSE = """
    import sys, time
    import numpy as np
    import pitstop
    d, mode = sys.argv[1], sys.argv[2]
    m = pitstop.CheckpointManager(d, save_on_signals=None)
    s = {"w": np.arange(1_000_000, dtype=np.float64)}
    m.save(1, s).wait()
    if mode == "fail":
        def boom(step):
            raise OSError(28, "No space left on device")
        m.hooks["before_write"] = boom
    if mode == "slow":
        m.hooks["before_write"] = lambda step: time.sleep(1)
    m.save(2, s)
    print("SAVED", flush=True)
    # the script ends: no close(), no `with`
"""


@pytest.mark.parametrize("mode", ["plain", "slow"])
def test_exit_without_close_commits_accepted_saves(tmp_path, mode):
    d = tmp_path / "ckpt"
    r = run_child(_NO_CLOSE, d, mode)
    assert r.returncode == 0, r.stderr
    assert "SAVED" in r.stdout
    with open_mgr(d, read_only=True) as ro:
        assert ro.all_steps() == [1, 2]
        np.testing.assert_array_equal(ro.load(2)["w"], np.arange(1_000_000, dtype=np.float64))
    assert not tier_files(d), "a clean exit leaves nothing in /dev/shm"
    assert "was not closed" in r.stderr and "[2]" in r.stderr


def test_exit_without_close_says_loudly_which_save_was_lost(tmp_path):
    d = tmp_path / "ckpt"
    r = run_child(_NO_CLOSE, d, "fail")
    assert r.returncode == 0, r.stderr
    assert "was lost" in r.stderr and "step 2" in r.stderr and "No space left" in r.stderr
    with open_mgr(d, read_only=True) as ro:
        assert ro.all_steps() == [1]


def test_a_dropped_manager_commits_and_releases_its_lock(tmp_path):
    d = tmp_path / "ckpt"
    m = open_mgr(d)
    gate = threading.Event()
    m.hooks["before_write"] = lambda step: gate.wait(30)
    m.save(1, state_of(1))
    ref = __import__("weakref").ref(m)

    def release_when_dropped() -> None:
        # the finalizer runs once the weak reference is dead, and waits for the held save
        while ref() is not None and not gate.is_set():
            gate.wait(0.01)
        gate.set()

    releaser = threading.Thread(target=release_when_dropped)
    releaser.start()
    del m
    gate.set()
    releaser.join()
    gc.collect()
    assert ref() is None, "nothing may keep a dropped manager alive"
    again = open_mgr(d)  # the lock was released (no DirectoryLockedError naming our own pid)
    try:
        assert again.all_steps() == [1]
    finally:
        again.close()


# ------------------------------------------------------------------ rolled-back runs
def test_a_rolled_back_run_never_mixes_with_the_abandoned_one(tmp_path, caplog):
    d = tmp_path / "ckpt"
    caplog.set_level(logging.WARNING, logger="pitstop")
    with open_mgr(d, save_every_steps=10, on_busy="wait") as mgr:
        for s in range(0, 41):
            mgr.step(s, state_of(s))
        mgr.wait()
        assert mgr.all_steps() == [0, 10, 20, 30, 40]
        state = state_of(-1)
        assert mgr.restore(state, step=20) == 20
        # the run goes on from 20: this manager no longer names the abandoned steps ...
        assert mgr.latest_step() == 20 and mgr.all_steps() == [0, 10, 20]
        # ... which stay on disk until the run's first step() or save()
        assert (d / step_name(40)).is_dir()
        # the run continues from 20, with other values (another data order, say)
        with pytest.warns(UserWarning, match="abandoned were moved aside"):
            for s in range(21, 36):
                h = mgr.step(s, state_of(1000 + s))
                if s == 30:
                    assert h is not None, "step 30 of the new run must be saved"
                    h.wait()
        mgr.wait()
        assert mgr.all_steps() == [0, 10, 20, 30]
    moved = [e for e in os.listdir(d) if parse_aside_name(e)]
    assert sorted(parse_aside_name(e) for e in moved) == [(30, "abandoned"), (40, "abandoned")]
    text = " ".join(r.getMessage() for r in caplog.records)
    assert step_name(30) in text and step_name(40) in text and "abandoned" in text
    # a crash now resumes the new run's step 30, never the abandoned step 40
    with open_mgr(d) as mgr:
        state = state_of(-1)
        assert mgr.restore(state) == 30
        np.testing.assert_array_equal(state["w"], state_of(1030)["w"])
    # what was moved aside is kept whole (never deleted in silence)
    for e in moved:
        assert os.path.isfile(os.path.join(d, e, "manifest.json"))


def test_rollback_then_training_moves_the_bad_future_aside(tmp_path):
    d = tmp_path / "ckpt"
    with open_mgr(d, nonfinite_guard=True) as mgr:
        mgr.save(1, state_of(1)).wait()
        mgr.save(2, state_of(2)).wait()
        bad = state_of(3)
        bad["w"][5] = np.nan
        assert mgr.save(3, bad).result(timeout=30).skipped  # the guard keeps it out
        mgr.save(4, state_of(4), metrics={"loss": 1.0}).wait()
        state = state_of(0)
        assert mgr.rollback(state) == 4
        assert mgr.restore(state, step=2) == 2
        with pytest.warns(UserWarning, match="abandoned were moved aside"):
            mgr.save(3, state_of(300)).wait()
        assert mgr.all_steps() == [1, 2, 3]
        assert mgr.restore(state_of(0)) == 3


# ------------------------------------------------------------------ a step saved twice
def test_saving_a_step_still_in_flight_is_refused_at_once(tmp_path):
    d = tmp_path / "ckpt"
    gate = threading.Event()
    entered = threading.Event()

    def hold(step):
        entered.set()
        assert gate.wait(30)

    with pitstop.CheckpointManager(d, save_every_steps=100, save_on_signals=None) as mgr:
        mgr.hooks["before_write"] = hold
        assert mgr.step(200, state_of(200)) is not None
        assert entered.wait(30)
        with pytest.raises(pitstop.StepExistsError, match="already being saved"):
            mgr.save(200, state_of(200))
        assert mgr.latest_step() == 200  # the final-save check the message suggests
        gate.set()
        mgr.wait()
        with pytest.raises(pitstop.StepExistsError, match="already exists"):
            mgr.save(200, state_of(200))
        assert mgr.all_steps() == [200]
    assert not tier_files(d)


# ------------------------------------------------------------------ metrics
@pytest.mark.parametrize("bad", [None, "n/a", np.array([1.0, 2.0]), True])
def test_a_ranking_metric_that_is_not_a_number_is_refused_before_writing(tmp_path, bad):
    d = tmp_path / "ckpt"
    with open_mgr(d, keep_best=2, best_metric="val_loss") as mgr:
        with pytest.raises(ValueError, match="val_loss") as info:
            mgr.save(1, state_of(1), metrics={"val_loss": bad})
        assert isinstance(info.value, pitstop.CheckpointError)
        with pytest.raises(ValueError, match="val_loss"):
            mgr.step(1, state_of(1), metrics={"val_loss": bad})
        assert mgr.all_steps() == [] and not os.listdir(d / ".pitstop") == []
        # nothing was written: the retry with a number saves that very step
        assert mgr.save(1, state_of(1), metrics={"val_loss": 0.5}).result(timeout=30).committed


@pytest.mark.parametrize("metrics, match", [
    ([("loss", 1.0)], "mapping"),
    ({"loss": np.ones(3)}, "'loss'.*single number"),
    ({"loss": object()}, "'loss'"),
    ({1: 2.0}, "names must be strings"),
])
def test_malformed_metrics_are_refused_naming_them(tmp_path, metrics, match):
    with open_mgr(tmp_path / "ckpt") as mgr:
        with pytest.raises(pitstop.InvalidArgumentError, match=match):
            mgr.save(1, state_of(1), metrics=metrics)
        assert mgr.all_steps() == []
        mgr.save(1, state_of(1), metrics={"loss": np.float32(0.5), "tag": "ok", "n": None})
        mgr.wait()
        assert mgr.metadata(1).metrics == {"loss": 0.5, "tag": "ok", "n": None}


# ------------------------------------------------------------------ arguments and paths
@pytest.mark.parametrize("directory", [None, "", "   "])
def test_a_missing_directory_name_is_refused(tmp_path, directory, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="directory"):
        pitstop.CheckpointManager(directory)
    assert os.listdir(tmp_path) == []


def test_directory_problems_are_checkpoint_errors_naming_the_path(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(pitstop.CheckpointError, match="not a directory") as info:
        pitstop.CheckpointManager(f)
    assert str(f) in str(info.value) and isinstance(info.value.__cause__, OSError)
    d = tmp_path / "d"
    d.mkdir()
    (d / ".pitstop").write_text("x")
    with pytest.raises(pitstop.CheckpointError, match=".pitstop") as info:
        pitstop.CheckpointManager(d)
    bad = tmp_path / "bad"
    (bad / ".pitstop").mkdir(parents=True)
    (bad / ".pitstop" / "directory.json").write_text("[1, 2]")
    with pytest.raises(pitstop.CheckpointError, match="directory.json") as info:
        pitstop.CheckpointManager(bad)
    assert "Remove that file" in str(info.value)
    # a reader is not stopped by it
    assert pitstop.CheckpointManager(bad, read_only=True).all_steps() == []


def test_a_read_only_file_system_is_a_checkpoint_error(tmp_path):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs",
                                            str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with open_mgr(mnt / "ck") as mgr:
            mgr.save(1, state_of(1)).wait()
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with pytest.raises(pitstop.CheckpointError, match="read_only=True"):
            pitstop.CheckpointManager(mnt / "ck")
        with pitstop.CheckpointManager(mnt / "ck", read_only=True) as ro:
            assert ro.latest_step() == 1
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.parametrize("call", [
    lambda m: m.step("x", state_of(1)),
    lambda m: m.step(None, state_of(1)),
    lambda m: m.step(-1, state_of(1)),
    lambda m: m.save(True, state_of(1)),
    lambda m: m.save(1.0, state_of(1)),
    lambda m: m.restore(state_of(1), step=4.0),
    lambda m: m.metadata("4"),
    lambda m: m.load(step="1"),
    lambda m: m.save(10 ** 20, state_of(1)),
    lambda m: m.step(np.int64(10 ** 18), state_of(1)),
], ids=["step-str", "step-none", "step-negative", "save-bool", "save-float", "restore-float",
        "metadata-str", "load-str", "save-too-large", "step-too-large"])
def test_bad_steps_are_value_errors(tmp_path, call):
    with open_mgr(tmp_path / "ckpt") as mgr:
        mgr.save(1, state_of(1)).wait()
        with pytest.raises(pitstop.InvalidArgumentError, match="step"):
            call(mgr)


def test_integral_numpy_steps_are_accepted_everywhere(tmp_path):
    with open_mgr(tmp_path / "ckpt", save_every_steps=2) as mgr:
        mgr.save(np.int64(1), state_of(1)).wait()
        assert mgr.step(np.int32(2), state_of(2)).result(timeout=30).committed
        assert mgr.all_steps() == [1, 2] and all(type(s) is int for s in mgr.all_steps())
        assert mgr.restore(state_of(0), step=np.uint8(1)) == 1
        assert mgr.metadata(np.int64(2)).step == 2
        assert mgr.load(np.int16(1))["meta"] == {"step": 1}


def test_unknown_step_is_not_found_not_corrupt(tmp_path):
    with open_mgr(tmp_path / "ckpt") as mgr:
        mgr.save(1, state_of(1)).wait()
        with pytest.raises(pitstop.CheckpointNotFoundError, match="999"):
            mgr.metadata(999)


@pytest.mark.parametrize("kw, match", [
    ({"compression": "lz4"}, "compression"),
    ({"hash_algorithm": "md5"}, "hash_algorithm"),
    ({"on_busy": "drop"}, "on_busy"),
    ({"best_mode": "up"}, "best_mode"),
    ({"keep_last": 0}, "keep_last"),
    ({"save_on_signals": ["SIGNOPE"]}, "SIGNOPE"),
    ({"max_in_flight": 0}, "max_in_flight"),
    ({"save_every_steps": 1.5}, "save_every_steps"),
    ({"keep_last": 1.5}, "keep_last"),
    ({"save_every_seconds": float("nan")}, "save_every_seconds"),
    ({"mtbf_seconds": -1}, "mtbf_seconds"),
    ({"memory_tier": 123}, "memory_tier"),
    ({"writer_threads": 0}, "writer_threads"),
    ({"copy_threads": 0}, "copy_threads"),
    ({"save_on_signals": ["SIG_DFL"]}, "SIG_DFL"),
])
def test_bad_constructor_arguments_are_refused_at_once(tmp_path, kw, match):
    with pytest.raises(pitstop.InvalidArgumentError, match=match):
        pitstop.CheckpointManager(tmp_path / "ckpt", **kw)
    # and nothing holds the directory afterwards
    with open_mgr(tmp_path / "ckpt") as mgr:
        mgr.save(1, state_of(1)).wait()


@pytest.mark.parametrize("make", ["deep", "cycle", "deep-values", "cycle-values"])
def test_deep_or_self_containing_states_are_refused_clearly(tmp_path, make):
    leaf: object = np.zeros(2) if make in ("deep", "cycle") else 1
    if make.startswith("deep"):
        state: dict = {}
        node = state
        for _ in range(400):
            node["k"] = {}
            node = node["k"]
        node["x"] = leaf
    else:
        loop: list = [leaf]
        loop.append(loop)
        state = {"a": loop}
    with open_mgr(tmp_path / "ckpt") as mgr:
        with pytest.raises(pitstop.UnsupportedStateError,
                           match="cycle" if "cycle" in make else "deep") as info:
            mgr.save(1, state)
        assert "state entry 'a" in str(info.value) or "state entry 'k" in str(info.value)
        assert mgr.all_steps() == []


def test_after_fork_signal_handlers_are_the_programs_own(tmp_path):
    """Forked workers (DataLoader, multiprocessing) never run pitstop's handlers: Ctrl+C
    there does what it would do without pitstop (here: KeyboardInterrupt), silently."""
    code = """
        import os, signal, sys, time
        import pitstop
        mgr = pitstop.CheckpointManager(sys.argv[1], memory_tier=False)
        pid = os.fork()
        if pid == 0:
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
                os._exit(1)
            except KeyboardInterrupt:
                os._exit(42)
        _, status = os.waitpid(pid, 0)
        print("CHILD", os.waitstatus_to_exitcode(status), flush=True)
        mgr.close()
    """
    r = run_child(code, tmp_path / "ckpt")
    assert r.returncode == 0, r.stderr
    assert "CHILD 42" in r.stdout
    assert "SIGINT received" not in r.stderr



# ------------------------------------------------------------------ found by probing (issue 9)
def _run(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-c", textwrap.dedent(code), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          start_new_session=True)


def test_a_save_the_guard_skipped_never_comes_back_from_the_memory_tier(tmp_path):
    code = """
        import os, signal, sys, time, numpy as np, pitstop
        mgr = pitstop.CheckpointManager(sys.argv[1], nonfinite_guard=True,
                                        save_on_signals=None)
        state = {"w": np.ones(1000)}
        mgr.save(10, state).wait()
        state["w"][5] = np.nan
        if sys.argv[2] == "skipped":
            assert mgr.save(20, state).result().skipped
        else:  # killed before the guard looked at it: described, not yet checked
            mgr.hooks["before_persist"] = lambda step: time.sleep(60)
            mgr.save(20, state)
        os.kill(os.getpid(), signal.SIGKILL)
    """
    for case in ("skipped", "unchecked"):
        d = tmp_path / case
        r = _run(code, d, case)
        assert r.returncode == -9, r.stderr
        with open_mgr(d, nonfinite_guard=True, memory_tier=None) as mgr:
            state = {"w": np.zeros(1000)}
            assert mgr.latest_step() == 10 and mgr.restore(state) == 10, case
            assert not np.isnan(state["w"]).any()
            mgr.wait()
            assert mgr.all_steps() == [10], case


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float16"])
def test_the_non_finite_guard_sees_nan_in_low_precision_floats(tmp_path, dtype):
    import ml_dtypes
    dt = np.dtype(getattr(ml_dtypes, dtype, dtype))
    with open_mgr(tmp_path / "ck", nonfinite_guard=True) as mgr:
        mgr.save(1, {"w": np.ones(4, dt)}).wait()
        bad = np.ones(4, dt)
        bad[2] = np.nan
        assert mgr.save(2, {"w": bad}).result(timeout=30).skipped
        assert mgr.all_steps() == [1]


def test_the_final_step_recipe_after_going_back_to_an_older_step(tmp_path):
    """restore(step=N), train on with step() to the last step (no periodic save due), then
    the documented `if mgr.latest_step() != last: mgr.save(last, state)`: the new run's last
    state is what a restart restores."""
    d = tmp_path / "ck"
    with open_mgr(d) as mgr:  # run A
        for s in (500, 999):
            mgr.save(s, {"w": np.full(4, float(s)), "run": "A"}).wait()
    state = {"w": np.zeros(4), "run": "?"}
    with open_mgr(d, save_every_steps=1000) as mgr:  # run B
        assert mgr.restore(state, step=500) == 500
        assert mgr.latest_step() == 500
        state["run"] = "B"
        with pytest.warns(UserWarning, match="abandoned were moved aside"):
            for step in range(501, 1000):
                mgr.step(step, state)
        if mgr.latest_step() != 999:
            mgr.save(999, state)
    with open_mgr(d) as mgr:
        check = {"w": np.zeros(4), "run": "?"}
        assert mgr.restore(check) == 999 and check["run"] == "B"


def test_a_manager_collected_on_its_own_thread_still_commits_and_lets_go(tmp_path):
    """A manager in a reference cycle, dropped mid-save, collected by the GC on pitstop's
    persist thread: no deadlock; the save commits, the lock is released."""
    code = """
        import gc, sys, threading, time, numpy as np, pitstop
        d = sys.argv[1]
        class Trainer:
            def __init__(self):
                self.mgr = pitstop.CheckpointManager(d, memory_tier=False, save_on_signals=None)
                self.mgr.trainer = self        # a cycle, as in many trainer classes
        t = Trainer()
        t.mgr.hooks["before_write"] = lambda step: gc.collect()  # GC on the persist thread
        t.mgr.save(1, {"w": np.ones(1000)})
        del t
        deadline = time.time() + 30
        while any(th.name == "pitstop-persist" for th in threading.enumerate()):
            assert time.time() < deadline, "the persist thread never ended"
            time.sleep(0.05)
        again = pitstop.CheckpointManager(d, memory_tier=False, save_on_signals=None)
        print("STEPS", again.all_steps())
        again.close()
    """
    r = _run(code, tmp_path / "ck", timeout=90)
    assert r.returncode == 0, r.stderr
    assert "STEPS [1]" in r.stdout


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_a_multiprocessing_worker_commits_its_saves_when_it_leaves(tmp_path, method):
    code = """
        import multiprocessing as mp, sys, time, numpy as np, pitstop
        MGR = None
        def work(d):
            global MGR
            MGR = pitstop.CheckpointManager(d, memory_tier=False, save_on_signals=None)
            MGR.hooks["before_write"] = lambda s: time.sleep(0.3)
            MGR.save(1, {"w": np.ones(1000)})   # and the worker returns: no close()
        if __name__ == "__main__":
            p = mp.get_context(sys.argv[2]).Process(target=work, args=(sys.argv[1],))
            p.start(); p.join()
            with pitstop.CheckpointManager(sys.argv[1], read_only=True) as ro:
                print("EXIT", p.exitcode, "STEPS", ro.all_steps())
    """
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(code))
    r = subprocess.run([PY, str(script), str(tmp_path / "ck"), method], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "EXIT 0 STEPS [1]" in r.stdout, r.stdout + r.stderr


def test_two_saves_in_flight_both_survive_a_kill(tmp_path):
    code = """
        import os, signal, sys, time, numpy as np, pitstop
        mgr = pitstop.CheckpointManager(sys.argv[1], max_in_flight=2, save_on_signals=None)
        mgr.hooks["before_write"] = lambda step: time.sleep(60)
        mgr.save(10, {"w": np.full(1000, 10.0)})
        mgr.save(11, {"w": np.full(1000, 11.0)})
        os.kill(os.getpid(), signal.SIGKILL)
    """
    d = tmp_path / "ck"
    assert _run(code, d).returncode == -9
    with open_mgr(d, memory_tier=None, keep_every_steps=10) as mgr:
        assert mgr.all_steps() == [10, 11]
        mgr.wait()
        assert mgr._committed() == [10, 11]
        assert float(mgr.load(10)["w"][0]) == 10.0 and float(mgr.load(11)["w"][0]) == 11.0


def test_a_writer_whose_directory_was_replaced_never_writes_into_the_new_one(tmp_path):
    import shutil
    d = tmp_path / "ck"
    old = open_mgr(d)
    try:
        old.save(1, state_of(1)).wait()
        shutil.rmtree(d)
        new = open_mgr(d)  # the path is free: a new run takes it
        try:
            new.save(5, state_of(5)).wait()
            with pytest.raises(pitstop.CheckpointWriteError, match="deleted or replaced"):
                old.save(7, state_of(7)).wait()
            assert new.all_steps() == [5]
        finally:
            new.close()
    finally:
        old.close()  # the failure was reported by its handle, once


def test_a_moved_run_directory_recovers_its_memory_tier_snapshot(tmp_path):
    code = """
        import os, signal, sys, time, numpy as np, pitstop
        mgr = pitstop.CheckpointManager(sys.argv[1], save_on_signals=None)
        mgr.save(1, {"w": np.full(100, 1.0)}).wait()
        mgr.hooks["before_write"] = lambda step: time.sleep(60)
        mgr.save(2, {"w": np.full(100, 2.0)})
        os.kill(os.getpid(), signal.SIGKILL)
    """
    d = tmp_path / "ck"
    assert _run(code, d).returncode == -9
    moved = tmp_path / "moved"
    os.rename(d, moved)
    with open_mgr(moved, memory_tier=None) as mgr:
        state = {"w": np.zeros(100)}
        assert mgr.restore(state) == 2 and float(state["w"][0]) == 2.0
    assert not tier_files(moved)  # recovered, persisted, and cleaned up on close


def test_close_racing_a_save_on_another_thread_leaves_nothing_hanging(tmp_path):
    for trial in range(5):
        d = tmp_path / f"ck{trial}"
        mgr = pitstop.CheckpointManager(d, save_on_signals=None)
        started = threading.Event()
        box: dict = {}
        t = threading.Thread(target=_save_into, args=(mgr, started, box))
        t.start()
        assert started.wait(10)
        mgr.close()
        t.join(30)
        assert not t.is_alive()
        if "h" in box:  # taken before close(): committed by it
            assert box["h"].wait(10) and box["h"].committed
        else:
            assert "closed" in str(box["e"])
        assert not tier_files(d)


def test_bad_arguments_found_by_probing_are_refused(tmp_path):
    with pytest.raises(pitstop.InvalidArgumentError, match="NUL"):
        pitstop.CheckpointManager(str(tmp_path / "a\0b"))
    with pytest.raises(pitstop.InvalidArgumentError, match="save_policy"):
        pitstop.CheckpointManager(tmp_path / "c", save_policy=object())
    with pytest.raises(pitstop.InvalidArgumentError, match="retention"):
        pitstop.CheckpointManager(tmp_path / "c", retention=[object()])
    with pytest.raises(pitstop.InvalidArgumentError, match="on_save"):
        pitstop.CheckpointManager(tmp_path / "c", on_save=42)
    with pytest.raises(pitstop.InvalidArgumentError, match="SIGKILL"):
        pitstop.CheckpointManager(tmp_path / "c", save_on_signals=["SIGTERM", "SIGKILL"])
    assert signal_is_default("SIGTERM")  # nothing left installed by a refused constructor
    assert not (tmp_path / "c").exists()  # and nothing written
    with open_mgr(tmp_path / "ok") as mgr:
        h = mgr.save(1, state_of(1))
        with pytest.raises(pitstop.InvalidArgumentError, match="timeout"):
            mgr.wait(timeout="x")
        with pytest.raises(pitstop.InvalidArgumentError, match="timeout"):
            h.wait(timeout="x")


def signal_is_default(name: str) -> bool:
    import signal as sig
    return sig.getsignal(getattr(sig, name)) in (sig.SIG_DFL, sig.default_int_handler)


def test_rollback_without_checked_checkpoints_says_so(tmp_path):
    with open_mgr(tmp_path / "ck") as mgr:
        assert mgr.rollback(state_of(0)) is None  # nothing saved: nothing to restore
        mgr.save(1, state_of(1)).wait()
        with pytest.raises(pitstop.CheckpointNotFoundError, match="nonfinite_guard"):
            mgr.rollback(state_of(0))


def test_latest_step_names_a_save_the_moment_save_returns(tmp_path):
    with open_mgr(tmp_path / "ck", keep_last=2) as mgr:
        for s in range(300):
            mgr.save(s, {"w": np.full(8, float(s))})
            assert mgr.latest_step() == s


def test_two_threads_saving_the_same_step_one_is_refused_at_once(tmp_path):
    for trial in range(10):
        with open_mgr(tmp_path / f"ck{trial}") as mgr:
            results: list = []
            barrier = threading.Barrier(2)
            threads = [threading.Thread(target=_save_step_1, args=(mgr, barrier, results))
                       for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert sum(isinstance(r, pitstop.StepExistsError) for r in results) == 1
            mgr.wait()  # no failure in the background


def _save_into(mgr, started, box) -> None:
    started.set()
    try:
        box["h"] = mgr.save(1, state_of(1))
    except pitstop.CheckpointError as e:
        box["e"] = e


def _save_step_1(mgr, barrier, results) -> None:
    barrier.wait()
    try:
        results.append(mgr.save(1, state_of(1)))
    except pitstop.StepExistsError as e:
        results.append(e)
