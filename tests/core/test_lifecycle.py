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
from pitstop.core.memtier import MemoryTier
from pitstop.core.names import parse_aside_name, step_name

PY = sys.executable
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
    del m
    gate.set()
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
        assert mgr.latest_step() == 40  # nothing moved until the new run saves
        # the run continues from 20, with other values (another data order, say)
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
], ids=["step-str", "step-none", "step-negative", "save-bool", "save-float", "restore-float",
        "metadata-str", "load-str"])
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

