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
import time

import numpy as np
import pytest

import pitstop
from pitstop.core.save import engine as engine_mod

PY = sys.executable
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
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
    mgr.save(hold, st, user_metadata={"note": f"s{hold}"})
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
    from pitstop.core.save.memtier import MemoryTier
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
    # the frameworks the killed process's save recorded (pitstop inspect's "written by"),
    # not "not recorded: an older pitstop"
    with open(d / "step_0000000002" / "manifest.json") as f:
        assert json.load(f)["writer"]["frameworks"] == {"numpy": np.__version__}


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
        # an untrusted snapshot is deleted, not kept: what the tier holds now is at most the
        # next save's buffer, made ahead by the restore (no description, nothing in it yet)
        left = tier_files(ident)
        assert not [f for f in left if not f.endswith(".buf")], left
        for f in left:
            with open(f, "rb") as fh:
                assert not any(fh.read()), f"{f} still holds the untrusted snapshot's bytes"
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

    def new_files() -> set[str]:
        # other pytest processes (the framework suites run beside this one) may make tier
        # files of their own directories meanwhile: only theirs are left out
        return {f for f in set(os.listdir(SHM)) - before
                if not (f.startswith("pitstop-") and mgr.directory_id not in f)}

    try:
        mgr.hooks["before_write"] = lambda step: release.wait(60)
        h = mgr.save(1, state_of(1))
        assert not h.done()
        assert new_files() == set()  # mid-persist
        release.set()
        h.wait()
        mgr.save(2, state_of(2)).wait()
        assert new_files() == set()
        assert tier_files(mgr.directory_id) == []
    finally:
        release.set()
        mgr.close()


# ------------------------------------------------------------------ a snapshot save() returned for
_KILL_AFTER_SAVE = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import pitstop
    d = sys.argv[1]
    mgr = pitstop.CheckpointManager(d, save_on_signals=None)
    state = {"w": np.full(16 << 20, 1.0, np.float32), "meta": {"step": 1}}   # 64 MiB
    mgr.save(1, state).wait()
    state["w"][:] = 2.0
    state["meta"]["step"] = 2
    mgr.save(2, state)                      # returns after the snapshot: hashing just started
    os.kill(os.getpid(), signal.SIGKILL)    # no hook, nothing slowed down
""")


def test_sigkill_right_after_save_returns_loses_nothing(tmp_path, cleanup_shm):
    d = tmp_path / "ckpt"
    r = subprocess.run([PY, "-c", _KILL_AFTER_SAVE, str(d)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == -signal.SIGKILL, r.stderr
    ident = json.loads((d / ".pitstop" / "directory.json").read_text())["directory_id"]
    cleanup_shm.append(ident)
    assert not (d / "step_0000000002").exists()  # the kill came before its commit
    mgr = open_mgr(d)
    try:
        assert mgr.latest_step() == 2
        target = {"w": np.zeros(16 << 20, np.float32), "meta": {"step": -1}}
        assert mgr.restore(target) == 2
        assert target["meta"] == {"step": 2} and bool((target["w"] == 2.0).all())
        mgr.wait()
        assert mgr._committed() == [1, 2]  # and persisted, verified like any checkpoint
    finally:
        mgr.close()


def test_latest_step_names_the_recovered_step_from_construction(tmp_path, cleanup_shm,
                                                                monkeypatch):
    d = tmp_path / "ckpt"
    cleanup_shm.append(crash_during_persist(d, [1], 2))
    release = threading.Event()
    original_init = engine_mod.Engine.__init__

    def init(self, *a, **kw):  # hold the recovered snapshot's persist
        original_init(self, *a, **kw)
        self.hooks["before_write"] = lambda step: release.wait(60) if step == 2 else None

    monkeypatch.setattr(engine_mod.Engine, "__init__", init)
    mgr = open_mgr(d)
    try:
        assert mgr._committed() == [1]  # not on disk yet ...
        # ... but what restore() and load() would return: the Orbax-style loop
        # `start = latest_step() + 1; state = load()` must not repeat a step
        assert mgr.latest_step() == 2 and mgr.all_steps() == [1, 2]
        assert_is_state(mgr.load(), 2)
        assert_is_state(mgr.load(2), 2)
        assert mgr.metadata(2).step == 2
        # when save() was called, kept by the tier: after step 1's commit, before this test
        saved_at = mgr.metadata(2).created_unix
        assert mgr.metadata(1).created_unix <= saved_at <= time.time()
        assert mgr.metadata(2).user_metadata == {"note": "s2"}  # the tier keeps it too
        target = zero_state()
        assert mgr.restore(target) == 2 and mgr.latest_step() == 2
        release.set()
        mgr.wait()
        assert mgr._committed() == [1, 2] and mgr.latest_step() == 2
        assert mgr.metadata(2).created_unix == saved_at  # the commit keeps the save's time
    finally:
        release.set()
        mgr.close()


# ------------------------------------------------------------------ a tier too small
def _mount_tmpfs(path, size: str, ro: bool = False) -> bool:
    if os.geteuid() != 0:
        return False
    os.makedirs(path, exist_ok=True)
    opts = f"size={size}" + (",ro" if ro else "")
    return subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _assert_fallback_warning(text: str, fix: tuple[str, ...] = ("--shm-size",
                                                               "medium: Memory")) -> None:
    for part in ("memory tier cannot hold", "16.0 MiB", "memory_tier=False", *fix):
        assert part in text, (part, text)


@pytest.mark.parametrize("ro", [False, True], ids=["full", "read-only"])
def test_a_small_tier_never_stops_a_save(tmp_path, caplog, ro):
    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, "8m", ro):
        pytest.skip("cannot mount a tmpfs here (the file-size-limit variant still runs)")
    try:
        caplog.set_level(logging.WARNING, logger="pitstop")
        state = {"w": np.arange(4 << 20, dtype=np.float32)}  # 16 MiB > 8 MiB
        with open_mgr(tmp_path / "ckpt", memory_tier=str(mnt)) as mgr:
            with pytest.warns(UserWarning) as seen:
                assert mgr.save(1, state).result(timeout=60).committed
            state["w"] += 1
            assert mgr.save(2, state).result(timeout=60).committed
            texts = [str(w.message) for w in seen if "memory tier" in str(w.message)]
            assert len(texts) == 1
            _assert_fallback_warning(texts[0], ("not writable",) if ro else (
                "--shm-size", "medium: Memory"))
            assert "8.0 MiB" in texts[0]
            assert sum("memory tier cannot hold" in r.getMessage()
                       for r in caplog.records) == 1  # once, not per save
            target = {"w": np.zeros(4 << 20, np.float32)}
            assert mgr.restore(target) == 2
            np.testing.assert_array_equal(target["w"], np.arange(4 << 20, dtype=np.float32) + 1)
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


_FSIZE_CHILD = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    import pitstop
    d, tier = sys.argv[1], sys.argv[2]
    # no file may grow past 8 MiB: the 16 MiB tier buffer fails with EFBIG; the data files
    # (four of 4 MiB) fit
    resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, resource.RLIM_INFINITY))
    state = {f"w{i}": np.full(1 << 20, i, np.float32) for i in range(4)}
    with pitstop.CheckpointManager(d, memory_tier=tier, writer_threads=4,
                                   save_on_signals=None) as mgr:
        print(json.dumps(mgr.save(1, state).result(timeout=60).committed), flush=True)
""")


def test_a_file_size_limit_on_the_tier_never_stops_a_save(tmp_path):
    tier = tmp_path / "tier"
    tier.mkdir()
    r = subprocess.run([PY, "-c", _FSIZE_CHILD, str(tmp_path / "ckpt"), str(tier)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "true"
    _assert_fallback_warning(r.stderr, ("ulimit -f",))
    assert "File too large" in r.stderr or "Errno 27" in r.stderr
    assert os.listdir(tier) == []
    with pitstop.CheckpointManager(tmp_path / "ckpt", read_only=True) as ro:
        assert ro.all_steps() == [1]
        assert float(ro.load(1)["w3"][0]) == 3.0


_NOMEM_CHILD = textwrap.dedent("""
    import resource, sys
    import numpy as np
    import pitstop
    d = sys.argv[1]
    mgr = pitstop.CheckpointManager(d, memory_tier=False, save_on_signals=None)
    state = {"w": np.ones(64 << 20, np.float32)}          # 256 MiB, allocated before the limit
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (vm + (64 << 20), resource.RLIM_INFINITY))
    try:
        mgr.save(1, state)
        print("SAVED")
    except pitstop.CheckpointError as e:
        print("ERROR", type(e).__name__, repr(e.__cause__), str(e))
""")


def test_no_memory_for_the_staging_buffer_is_a_checkpoint_error(tmp_path):
    r = subprocess.run([PY, "-c", _NOMEM_CHILD, str(tmp_path / "ckpt")], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ERROR CheckpointError"), r.stdout + r.stderr
    assert "staging buffer" in r.stdout and "256.0 MiB" in r.stdout


def test_a_tier_that_fills_up_later_never_fails_a_save(tmp_path, caplog):
    mnt = tmp_path / "tier"
    if not _mount_tmpfs(mnt, "4m"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        caplog.set_level(logging.WARNING, logger="pitstop")
        state = {"w": np.arange(256 << 10, dtype=np.float32)}  # 1 MiB: the buffer fits
        with open_mgr(tmp_path / "ckpt", memory_tier=str(mnt), keep_last=1) as mgr:
            assert mgr.save(1, state).result(timeout=60).committed
            filler = mnt / "filler"  # another program's shared memory takes the rest
            subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k"],
                           capture_output=True)
            for step in (2, 3):
                assert mgr.save(step, state).result(timeout=60).committed
            mgr.wait()
            assert mgr.all_steps() == [3]  # retention saw every commit
            filler.unlink()
        assert any("description could not be written" in r.getMessage()
                   for r in caplog.records)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_memory_tier_off_removes_the_snapshot_a_killed_job_left(tmp_path, cleanup_shm, caplog):
    """A job killed mid-persist leaves its snapshot in /dev/shm; the next manager, opened
    with memory_tier=False, never read or removed it (it stayed until a reboot). Now it is
    removed, and the lost step is named with how to recover it instead."""
    d = tmp_path / "ckpt"
    ident = crash_during_persist(d, [1], 2)
    cleanup_shm.append(ident)
    assert tier_files(ident)
    with caplog.at_level(logging.WARNING, logger="pitstop"):
        open_mgr(d, memory_tier=False).close()
    assert tier_files(ident) == []
    assert "step(s) 2" in caplog.text and "memory_tier=True" in caplog.text, caplog.text
