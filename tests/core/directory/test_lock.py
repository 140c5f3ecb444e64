"""One writer per directory: a second writer (same process or another) is refused with a
clear DirectoryLockedError; a SIGKILLed holder never leaves the lock stuck (also when it had
forked children that outlive it); read-only managers restore while a writer holds it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import pitstop

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def open_mgr(directory, **kw) -> pitstop.CheckpointManager:
    kw.setdefault("memory_tier", False)
    kw.setdefault("save_on_signals", None)
    return pitstop.CheckpointManager(directory, **kw)


def spawn(code: str, directory) -> subprocess.Popen:
    """A Python child running ``code`` with ``d`` bound to the directory; it prints lines."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    prelude = (f"import os, sys, time, numpy as np, pitstop\nd = {str(directory)!r}\n")
    return subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(code)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def expect_line(proc: subprocess.Popen, prefix: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"child exited ({proc.wait()}): {proc.stderr.read()}")
        if line.startswith(prefix):
            return line.strip()
    raise AssertionError(f"no {prefix!r} line from the child")


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


HOLD = """
mgr = pitstop.CheckpointManager(d, memory_tier=False, save_on_signals=None)
mgr.save(1, {"w": np.arange(8.0), "epoch": 1}).result(timeout=60)
print("holding", os.getpid(), flush=True)
time.sleep(120)
"""


def test_second_writer_in_the_same_process_is_refused(tmp_path):
    d = tmp_path / "run"
    first = open_mgr(d)
    try:
        with pytest.raises(pitstop.DirectoryLockedError) as info:
            open_mgr(d)
        msg = str(info.value)
        assert str(d) in msg and "another writer" in msg and "read_only=True" in msg
        assert str(os.getpid()) in msg  # who holds it
        # the refused manager left nothing behind and the holder still works
        first.save(0, {"w": np.ones(3)}).result(timeout=30)
        # the same directory through another spelling of its path is the same directory
        with pytest.raises(pitstop.DirectoryLockedError):
            open_mgr(str(d) + "/./")
    finally:
        first.close()
    with open_mgr(d) as again:  # released on close
        assert again.all_steps() == [0]


def test_second_writer_in_another_process_is_refused_until_the_holder_is_killed(tmp_path):
    d = tmp_path / "run"
    holder = spawn(HOLD, d)
    try:
        pid = int(expect_line(holder, "holding").split()[1])
        with pytest.raises(pitstop.DirectoryLockedError, match=f'"pid": {pid}'):
            open_mgr(d)
        # a read-only manager restores and loads while the writer holds the directory
        with open_mgr(d, read_only=True) as ro:
            t = {"w": np.zeros(8), "epoch": 0}
            assert ro.restore(t) == 1 and t["w"].tolist() == list(range(8)) and t["epoch"] == 1
            assert ro.load()["epoch"] == 1
            with pytest.raises(pitstop.CheckpointError, match="read_only"):
                ro.save(2, t)
    finally:
        kill(holder)
    # SIGKILL: no cleanup ran in the holder, yet the lock is not stuck
    with open_mgr(d) as mgr:
        t = {"w": np.zeros(8), "epoch": 0}
        assert mgr.restore(t) == 1 and t["epoch"] == 1
        mgr.save(2, t).result(timeout=30)


def test_this_process_holding_refuses_another_process(tmp_path):
    d = tmp_path / "run"
    with open_mgr(d) as mgr:
        mgr.save(3, {"w": np.arange(4.0)}).result(timeout=30)
        child = spawn("""
            try:
                pitstop.CheckpointManager(d, memory_tier=False, save_on_signals=None)
                print("opened", flush=True)
            except pitstop.DirectoryLockedError as e:
                print("locked", e, flush=True)
            with pitstop.CheckpointManager(d, read_only=True) as ro:
                t = {"w": np.zeros(4)}
                print("restored", ro.restore(t), t["w"].tolist(), flush=True)
        """, d)
        try:
            assert str(os.getpid()) in expect_line(child, "locked")
            assert expect_line(child, "restored") == "restored 3 [0.0, 1.0, 2.0, 3.0]"
            assert child.wait(timeout=60) == 0
        finally:
            kill(child)


def test_lock_not_stuck_when_a_forked_child_outlives_the_killed_holder(tmp_path):
    # data-loader workers are forked from the training process; the lock must die with it.
    # The worker drops its copy of the lock in pitstop's after-fork handler, which runs in
    # the child before os.fork() returns there; the worker reports through a pipe once fork
    # has returned, and the holder says "holding" only after that report, so the holder is
    # never killed while the worker might still hold its copy (no sleep, no guess).
    d = tmp_path / "run"
    holder = spawn("""
        mgr = pitstop.CheckpointManager(d, memory_tier=False, save_on_signals=None)
        mgr.save(1, {"w": np.arange(8.0)}).result(timeout=60)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.write(w, b"forked")   # after-fork handlers ran: our copy of the lock is closed
            os.close(w)
            time.sleep(120)   # a worker, still running after its parent died
            os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            ready = f.read()
        print("holding", os.getpid(), pid, ready.decode() or "worker-died", flush=True)
        time.sleep(120)
    """, d)
    worker = None
    try:
        _, _, worker, ready = expect_line(holder, "holding").split()
        worker = int(worker)
        assert ready == "forked", "the forked worker never reported"
        with pytest.raises(pitstop.DirectoryLockedError):
            open_mgr(d)  # the holder itself still holds it
        kill(holder)
        os.kill(worker, 0)  # the worker outlives its parent (raises if it does not)
        with open_mgr(d) as mgr:
            assert mgr.all_steps() == [1]
        os.kill(worker, 0)  # ... and was alive all along: the lock was not freed by its death
    finally:
        kill(holder)
        if worker:
            try:
                os.kill(worker, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_restarted_writer_after_kill_cleans_up_and_continues(tmp_path):
    d = tmp_path / "run"
    holder = spawn(HOLD, d)
    try:
        expect_line(holder, "holding")
    finally:
        kill(holder)
    with open_mgr(d, keep_last=1) as mgr:
        mgr.save(2, {"w": np.arange(8.0) * 2, "epoch": 2}).result(timeout=30)
        assert mgr.all_steps() == [2]
    with open_mgr(d, read_only=True) as ro:
        assert ro.load()["epoch"] == 2
