"""The read-ahead window of a restore: a small array between large ones (a torch optimizer's
``step`` beside its moments) reads a small window, not 8 MiB it throws away; small arrays
that follow one another still cost a few large reads."""

from __future__ import annotations

import numpy as np
import pytest

import pitstop
import pitstop.core.restore.files as files


@pytest.fixture
def reads(monkeypatch):
    """The size of every read a restore makes through a data file's descriptor."""
    sizes: list[int] = []
    orig = files._pread

    def counting(fd, out, offset):
        sizes.append(out.nbytes)
        return orig(fd, out, offset)

    monkeypatch.setattr(files, "_pread", counting)
    return sizes


def _open(d):
    return pitstop.CheckpointManager(d, memory_tier=False, save_on_signals=None)


def test_a_small_array_between_large_ones_reads_a_small_window(tmp_path, reads):
    # 8 x (a 4-byte counter, two 2 MiB moments): as Adam's state lies in a data file
    big = 1 << 19  # float32 elements: 2 MiB
    state = {f"s{i}": {"a": np.full(big, i, np.float32), "b": np.full(big, -i, np.float32),
                       "step": np.array(float(i), np.float32).reshape(1)} for i in range(8)}
    data = sum(v.nbytes for s in state.values() for v in s.values())
    with _open(tmp_path / "ck") as mgr:
        mgr.save(1, state).wait()
    target = {k: {n: np.zeros_like(v) for n, v in s.items()} for k, s in state.items()}
    with _open(tmp_path / "ck") as mgr:  # a restart: from the files
        assert mgr.restore(target) == 1
    for k, s in state.items():
        for n, v in s.items():
            np.testing.assert_array_equal(target[k][n], v)
    # before: each counter read an 8 MiB window (64 MiB for 32 MiB of data)
    assert sum(reads) <= data + 8 * files.WINDOW_MIN, (sum(reads), data)


def test_small_arrays_in_a_row_are_read_in_growing_windows(tmp_path, reads):
    # fewer than RUN_MIN per file: each goes through the window one by one
    n = 40
    state = {f"x{i:02d}": np.full(64 << 10, i, np.uint8) for i in range(n)}  # 64 KiB each
    with _open(tmp_path / "ck") as mgr:
        mgr.save(1, state).wait()
    target = {k: np.zeros_like(v) for k, v in state.items()}
    with _open(tmp_path / "ck") as mgr:
        assert mgr.restore(target) == 1
    for k, v in state.items():
        np.testing.assert_array_equal(target[k], v)
    # 2.5 MiB in windows of 256 KiB, 512 KiB, 1 MiB, ...: a handful of reads, not 40
    assert 0 < len(reads) <= 6, reads
    assert sum(reads) <= 2 * n * (64 << 10) + files.WINDOW, reads
