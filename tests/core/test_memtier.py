"""The in-memory tier: a snapshot in /dev/shm outlives a killed process, and is trusted only
when it is provably the newest, intact state of this very directory."""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import pitstop
from pitstop.core import engine as engine_mod

PY = sys.executable
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHM = "/dev/shm"

pytestmark = pytest.mark.skipif(not os.access(SHM, os.W_OK), reason="no writable /dev/shm")


def state_of(step: int) -> dict:
    return {"w": np.arange(100_000, dtype=np.float32) * step,
            "m": {"v": np.full((64, 3), step, dtype=np.float64)},
            "meta": {"epoch": step, "tag": f"s{step}"}}


def zero_state() -> dict:
    return {"w": np.zeros(100_000, np.float32), "m": {"v": np.zeros((64, 3), np.float64)},
            "meta": {"epoch": -1, "tag": ""}}


def assert_is_state(got: dict, step: int) -> None:
    want = state_of(step)
    np.testing.assert_array_equal(got["w"], want["w"])
    np.testing.assert_array_equal(got["m"]["v"], want["m"]["v"])
    assert got["meta"] == want["meta"]


_CHILD = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import pitstop
    d, commit, hold, compression = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    def state_of(step):
        return {"w": np.arange(100_000, dtype=np.float32) * step,
                "m": {"v": np.full((64, 3), step, dtype=np.float64)},
                "meta": {"epoch": step, "tag": f"s{step}"}}
    mgr = pitstop.CheckpointManager(d, save_on_signals=None,
                                    compression=None if compression == "none" else compression)
    def hold_persist(step):
        if step == hold:
            print("HOLD", mgr.directory_id, flush=True)
            time.sleep(600)
    mgr.hooks["before_write"] = hold_persist
    for s in commit:
        mgr.save(s, state_of(s)).wait()
    st = state_of(hold)
    mgr.save(hold, st)
    st["w"][:] = -1          # training goes on and changes everything at once
    st["meta"]["epoch"] = -1
    time.sleep(600)
""")


def crash_during_persist(directory, commit, hold, compression="none") -> str:
    """Run a child that commits ``commit``, snapshots ``hold`` and is SIGKILLed while that
    persist is held. Returns the directory id."""
    p = subprocess.Popen([PY, "-c", _CHILD, str(directory), json.dumps(commit), str(hold),
                          compression], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=ROOT)
    try:
        line = p.stdout.readline()
        assert line.startswith("HOLD"), p.stderr.read()
        ident = line.split()[1]
        # the sealed snapshot sits where the docs say it does
        assert os.path.exists(f"{shm_prefix(directory, ident)}-0.buf")
        assert os.path.exists(f"{shm_prefix(directory, ident)}-0.json")
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    assert p.returncode == -signal.SIGKILL
    return ident


def shm_prefix(directory, ident: str) -> str:
    """Where the tier keeps a directory's files: its id and a hash of its real path."""
    from pitstop.core.memtier import MemoryTier
    return MemoryTier(SHM, str(directory), ident).prefix


def tier_files(ident: str) -> list[str]:
    return sorted(glob.glob(f"{SHM}/pitstop-{ident}-*"))


@pytest.fixture
def cleanup_shm():
    idents: list[str] = []
    yield idents
    for ident in idents:
        for f in tier_files(ident):
            os.unlink(f)


def open_mgr(directory, **kw) -> pitstop.CheckpointManager:
    kw.setdefault("save_on_signals", None)
    return pitstop.CheckpointManager(directory, **kw)


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_killed_during_persist_restart_restores_snapshot_from_memory(tmp_path, cleanup_shm,
                                                                     compression):
    d = tmp_path / "ckpt"
    ident = crash_during_persist(d, [1], 2, compression)
    cleanup_shm.append(ident)
    assert [e for e in os.listdir(d) if e.startswith("step_")] == ["step_0000000001"]

    mgr = open_mgr(d, compression=None if compression == "none" else compression)
    try:
        target = zero_state()
        restored = mgr.restore(target)
        assert restored == 2
        assert_is_state(target, 2)  # the values of the snapshot moment, exactly
        # restore() read memory without waiting for the disk; the persist finishes behind it
        mgr.wait()
        # ...and step 2 is now committed on disk, verified like any checkpoint
        assert mgr.all_steps() == [1, 2]
        assert_is_state(mgr.load(2), 2)
        assert mgr.metadata(2).step == 2
        assert mgr.latest_step() == 2
        # training continues normally after the recovery
        mgr.save(3, state_of(3)).wait()
        assert mgr.all_steps() == [1, 2, 3]
    finally:
        mgr.close()
    assert tier_files(ident) == []  # close() removes the tier
    ro = pitstop.CheckpointManager(d, read_only=True)
    assert_is_state(ro.load(2), 2)


def test_recovered_snapshot_is_persisted_even_without_restore(tmp_path, cleanup_shm):
    d = tmp_path / "ckpt"
    cleanup_shm.append(crash_during_persist(d, [1], 2))
    mgr = open_mgr(d)
    try:
        mgr.wait()
        assert mgr.all_steps() == [1, 2]
        assert_is_state(mgr.load(2), 2)
    finally:
        mgr.close()


def test_save_right_after_recovery_does_not_clobber_the_recovered_persist(
        tmp_path, cleanup_shm, monkeypatch):
    d = tmp_path / "ckpt"
    cleanup_shm.append(crash_during_persist(d, [1], 2))
    # hold the persist of the recovered snapshot (it is submitted inside the constructor)
    release = threading.Event()
    original_init = engine_mod.Engine.__init__

    def init(self, *a, **kw):
        original_init(self, *a, **kw)
        self.hooks["before_write"] = lambda step: release.wait(60) if step == 2 else None

    monkeypatch.setattr(engine_mod.Engine, "__init__", init)
    mgr = open_mgr(d)
    try:
        threading.Timer(0.3, release.set).start()
        # same layout: without care this snapshot lands in the buffer step 2 is written from
        mgr.save(3, state_of(3)).wait()
        assert mgr.all_steps() == [1, 2, 3]
        assert_is_state(mgr.load(2), 2)
        assert_is_state(mgr.load(3), 3)
    finally:
        release.set()
        mgr.close()


@pytest.mark.parametrize("case", ["older", "equal"])
def test_tier_not_trusted_unless_newer_than_committed(tmp_path, cleanup_shm, caplog, case):
    d = tmp_path / "ckpt"
    if case == "older":
        ident = crash_during_persist(d, [3], 2)  # committed 3, snapshot of 2 in memory
        newest = 3
    else:
        ident = crash_during_persist(d, [1], 2)
        meta_path = f"{shm_prefix(d, ident)}-0.json"
        with open(meta_path) as f:
            meta = json.load(f)
        meta["step"] = 1  # claims the committed step (its bytes are step 2's)
        with open(meta_path, "w") as f:
            json.dump(meta, f)
        newest = 1
    cleanup_shm.append(ident)
    caplog.set_level(logging.INFO, logger="pitstop")
    mgr = open_mgr(d)
    try:
        target = zero_state()
        assert mgr.restore(target) == newest
        assert_is_state(target, newest)
        assert mgr.all_steps() == [newest]
        assert tier_files(ident) == []  # an untrusted snapshot is deleted, not kept
        assert any("not newer than the committed step" in r.getMessage()
                   for r in caplog.records)
    finally:
        mgr.close()


def test_tier_not_trusted_when_hash_does_not_verify(tmp_path, cleanup_shm, caplog):
    d = tmp_path / "ckpt"
    ident = crash_during_persist(d, [1], 2)
    cleanup_shm.append(ident)
    buf = f"{shm_prefix(d, ident)}-0.buf"
    with open(buf, "r+b") as f:
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 0x01]))
    caplog.set_level(logging.WARNING, logger="pitstop")
    mgr = open_mgr(d)
    try:
        target = zero_state()
        assert mgr.restore(target) == 1
        assert_is_state(target, 1)
        assert mgr.all_steps() == [1]  # the corrupt snapshot was not persisted either
        assert any("unusable" in r.getMessage() and "hash" in r.getMessage()
                   for r in caplog.records)
    finally:
        mgr.close()


def test_tier_not_trusted_for_another_directory(tmp_path, cleanup_shm, caplog):
    d = tmp_path / "ckpt"
    ident = crash_during_persist(d, [1], 2)
    cleanup_shm.append(ident)
    copy = tmp_path / "copy"
    shutil.copytree(d, copy)  # same directory id, different directory
    original = tier_files(ident)
    assert original
    mgr = open_mgr(copy)
    try:
        target = zero_state()
        assert mgr.restore(target) == 1
        assert_is_state(target, 1)
        assert mgr.all_steps() == [1]
        mgr.save(5, state_of(5)).wait()  # the copy's own tier buffer is its own
    finally:
        mgr.close()
    # the copy neither used nor touched the original's snapshot; the original still recovers
    assert set(original) <= set(tier_files(ident))
    mgr = open_mgr(d)
    try:
        target = zero_state()
        assert mgr.restore(target) == 2
        assert_is_state(target, 2)
    finally:
        mgr.close()


def test_close_removes_tier_files(tmp_path):
    mgr = open_mgr(tmp_path / "ckpt")
    ident = mgr.directory_id
    try:
        mgr.save(1, state_of(1)).wait()
        files = tier_files(ident)
        prefix = shm_prefix(tmp_path / "ckpt", ident)
        assert f"{prefix}-0.buf" in files
        assert f"{prefix}-0.json" in files
        with open(f"{prefix}-0.json") as f:
            meta = json.load(f)
        assert meta["step"] == 1 and meta["committed"] is True
    finally:
        mgr.close()
    assert tier_files(ident) == []


def test_memory_tier_off_writes_nothing_to_shm(tmp_path):
    before = set(os.listdir(SHM))
    release = threading.Event()
    mgr = open_mgr(tmp_path / "ckpt", memory_tier=False)
    try:
        mgr.hooks["before_write"] = lambda step: release.wait(60)
        h = mgr.save(1, state_of(1))
        assert not h.done()
        assert set(os.listdir(SHM)) - before == set()  # mid-persist
        release.set()
        h.wait()
        mgr.save(2, state_of(2)).wait()
        assert set(os.listdir(SHM)) - before == set()
        assert tier_files(mgr.directory_id) == []
    finally:
        release.set()
        mgr.close()
