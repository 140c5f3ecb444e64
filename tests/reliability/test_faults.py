"""Resource faults counted in trials (benchmarks/reliability/faults.py) at a reduced count,
and the defects they found, kept as tests of their own."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import pitstop  # noqa: E402
from benchmarks.reliability import faults  # noqa: E402


def _mount(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True).returncode == 0


def test_a_tier_that_fills_up_warns_once_however_it_shows(tmp_path, caplog):
    """A tier filled by another program fails the description of the next snapshot, then
    cannot hold a larger one: one warning (with the fix) for both, and every save commits."""
    mnt = tmp_path / "tier"
    if not _mount(mnt, "1m"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        caplog.set_level(logging.WARNING, logger="pitstop")
        small = {"w": np.arange(16 << 10, dtype=np.float32)}   # 64 KiB: the buffer fits
        big = {"w": np.arange(64 << 10, dtype=np.float32)}     # 256 KiB: a new buffer
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with pitstop.CheckpointManager(tmp_path / "run", memory_tier=str(mnt),
                                           save_on_signals=None) as mgr:
                assert mgr.save(1, small).result(timeout=60).committed
                with open(mnt / "other-program", "wb", buffering=0) as f:
                    try:
                        while True:
                            f.write(b"\0" * 4096)
                    except OSError:
                        pass
                assert mgr.save(2, small).result(timeout=60).committed  # no description
                assert mgr.save(3, big).result(timeout=60).committed    # no buffer
                target = {"w": np.zeros(64 << 10, np.float32)}
                assert mgr.restore(target) == 3
                np.testing.assert_array_equal(target["w"], big["w"])
        logged = [r.getMessage() for r in caplog.records if "memory tier" in r.getMessage()]
        assert len(logged) == 1, logged
        assert "description" in logged[0] and "could not be written" in logged[0]
        assert "--shm-size" in logged[0] and "memory_tier=False" in logged[0]
        assert len([w for w in seen if "memory tier" in str(w.message)]) == 1
        assert os.listdir(mnt) == ["other-program"]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_an_index_write_on_a_full_disk_leaves_no_temporary(tmp_path):
    """The index is written after a commit; on a full disk that write fails (a warning, the
    save stays committed), and its temporary is removed at once, not at the next open."""
    mnt = tmp_path / "disk"
    if not _mount(mnt, "256k"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        with pitstop.CheckpointManager(mnt / "run", memory_tier=False, save_on_signals=None,
                                       durable=False) as mgr:
            mgr.save(0, {"w": np.zeros(8)}).result(timeout=60)
            storage = mgr.storage
            with open(mnt / "filler", "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(b"\0" * 4096)
                except OSError:
                    pass
            with pytest.raises(OSError):
                storage.write_meta("index.json", b"x" * 65536, durable=False)
            assert [e for e in os.listdir(mnt / "run" / ".pitstop") if ".tmp-" in e] == []
            (mnt / "filler").unlink()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


# ------------------------------------------------------------------ the scenarios, reduced

SEED = int(os.environ.get("PITSTOP_TORTURE_SEED", int.from_bytes(os.urandom(3), "little")))


def _run(name: str, trials: int, tmp_path: Path):
    res = faults.SCENARIOS[name](trials, SEED, tmp_path)
    print(res.line(), f"(seed {SEED})")
    assert res.failures == 0, (f"seed {SEED} (PITSTOP_TORTURE_SEED={SEED} repeats it):\n"
                               + "\n".join(res.details))
    return res


def test_full_disk_fails_clearly_and_keeps_what_is_committed(tmp_path):
    res = _run("full_disk", 6, tmp_path)
    assert res.trials == 6
    assert res.counts["failed_saves"] >= 6  # every trial filled its disk
    assert res.counts["commits_after_free"] == 6
    assert res.counts.get("tmpfs_trials", 0) + res.counts.get("fsize_trials", 0) == 6


def test_permission_denied_fails_clearly_and_saves_resume(tmp_path):
    res = _run("permission_denied", 8, tmp_path)
    if res.trials == 0:
        pytest.skip("; ".join(res.details))
    assert res.counts["commits_after_restore"] == res.trials
    assert res.counts.get("failed_saves", 0) + res.counts.get(
        "index_refused_saves_committed", 0) > 0


def test_io_errors_at_the_storage_layer(tmp_path):
    res = _run("io_error", 12, tmp_path)
    assert res.trials == 12
    met = sum(res.counts.get(k, 0) for k in ("failed_saves", "bookkeeping_faults_absorbed",
                                              "read_errors_raised"))
    assert met > 0 and met + res.counts.get("fault_not_reached", 0) >= 12


def test_a_full_memory_tier_never_fails_a_save(tmp_path):
    res = _run("full_shm", 5, tmp_path)
    if res.trials == 0:
        pytest.skip("; ".join(res.details))
    assert res.counts["tier_stepped_aside"] > 0


def test_full_disk_falls_back_to_a_file_size_limit(tmp_path):
    """Where no tmpfs can be mounted the same promise runs under RLIMIT_FSIZE in a child."""
    res = faults._fsize_fallback(faults.Result("full_disk"), 3, SEED, tmp_path)
    print(res.line(), f"(seed {SEED})")
    assert res.failures == 0, f"seed {SEED}:\n" + "\n".join(res.details)
    assert res.counts["fsize_trials"] == 3 and res.counts["failed_saves"] >= 3
    assert res.counts["commits_after_free"] == 3


def test_an_io_error_in_the_middle_of_a_restore_says_what_it_overwrote(tmp_path):
    """An EIO while the arrays stream in leaves the target partly restored: the error says
    which entries and to restore again; nothing is moved aside; a retry is exact."""
    storage = faults.FaultyStorage(str(tmp_path / "run"))
    state = {"a": np.full(1000, 1.0), "b": np.full(1000, 2.0), "c": np.full(1000, 3.0)}
    with pitstop.CheckpointManager(storage, memory_tier=False, save_on_signals=None,
                                   writer_threads=1) as mgr:
        mgr.save(1, state).result(timeout=60)
    # (a new manager: the one that saved would read its staging buffer, not the disk)
    with pitstop.CheckpointManager(storage, memory_tier=False, save_on_signals=None,
                                   writer_threads=1) as mgr:
        target = {k: np.zeros(1000) for k in state}
        storage.arm("read", 3, errno.EIO)  # the manifest, a, then b fails
        with pytest.raises(pitstop.CheckpointError) as info:
            mgr.restore(target)
        e = info.value
        assert not isinstance(e, pitstop.CorruptCheckpointError)
        assert e.overwritten == ["a", "b"]
        assert "Input/output error" in str(e) and "overwritten 2 entries" in str(e)
        assert "restore again" in str(e)
        assert (target["a"] == 1).all() and (target["c"] == 0).all()
        assert mgr.all_steps() == [1]
        assert mgr.restore(target) == 1
        for k in state:
            np.testing.assert_array_equal(target[k], state[k])


class _Outage(faults.FaultyStorage):
    """Every save fails while ``down`` (a directory made immutable)."""

    down = False
    begun: list[str] = []

    def begin(self, name):
        self.begun.append(name)
        if self.down:
            raise OSError(errno.EPERM, "Operation not permitted (injected outage)")
        return super().begin(name)


def test_a_loop_that_catches_save_errors_through_an_outage_loses_no_attempt(tmp_path):
    """The save() that reports an earlier background failure raised before attempting its
    own step, so a loop that catches the error and goes on lost every other save of an
    outage (and the first one after it). Now every step is attempted, and the error says so
    and carries the accepted step's handle."""
    storage = _Outage(str(tmp_path / "run"))
    storage.begun = []
    with pitstop.CheckpointManager(storage, memory_tier=False, save_on_signals=None) as mgr:
        storage.down = True
        handles, reported = {}, []
        for s in range(1, 6):
            if s == 5:
                storage.down = False
            try:
                handles[s] = mgr.save(s, {"w": np.full(4, float(s))})
            except pitstop.CheckpointError as e:
                reported.append(e)
                handles[s] = e.handle
                assert any(f"step {s} was accepted" in n for n in e.__notes__), e.__notes__
            while not handles[s].done():  # (wait() would report the failure itself)
                time.sleep(0.01)
        assert handles[5].result().step == 5
    assert storage.begun == [
        "step_0000000001", "step_0000000002", "step_0000000003", "step_0000000004",
        "step_0000000005"], storage.begun
    assert len(reported) == 4
