"""DirectoryReader reads a directory as a read-only manager does (load, load(target=...),
metadata, the steps, a checkpoint's reader) without any writer part: it takes no lock (a
live writer keeps its own), starts no engine and holds no memory tier."""

from __future__ import annotations

import numpy as np
import pytest

import pitstop
from pitstop.core.manager import DirectoryReader


def _saved(directory, steps=(1, 2)):
    mgr = pitstop.CheckpointManager(directory, memory_tier=False, save_on_signals=None)
    for s in steps:
        mgr.save(s, {"w": np.full(4, float(s)), "step": s}, metrics={"loss": 1.0 / s}).wait()
    return mgr  # still open: it holds the writer's lock


def test_reads_what_a_read_only_manager_reads_while_the_writer_holds_the_lock(tmp_path):
    writer = _saved(tmp_path / "ck")
    try:
        reader = DirectoryReader(tmp_path / "ck")
        assert not hasattr(reader, "_engine") and not hasattr(reader, "pool")
        ro = pitstop.CheckpointManager(tmp_path / "ck", read_only=True, save_on_signals=None)
        try:
            assert reader.all_steps() == ro.all_steps() == [1, 2]
            assert reader.latest_step() == 2
            for step in (None, 1):
                a, b = reader.load(step), ro.load(step)
                np.testing.assert_array_equal(a["w"], b["w"])
                assert a["step"] == b["step"]
            assert reader.metadata(1).metrics == ro.metadata(1).metrics == {"loss": 1.0}
            target = {"w": np.zeros(4), "step": 0}
            got = reader.load(1, target=target)
            np.testing.assert_array_equal(got["w"], np.full(4, 1.0))
            assert target["w"].sum() == 0  # the target is left as it was
            assert reader.checkpoint(2).manifest.step == 2
        finally:
            ro.close()
        # the writer's lock was never taken from it: it saves on
        writer.save(3, {"w": np.zeros(4), "step": 3}).wait()
        assert reader.all_steps() == [1, 2, 3]
    finally:
        writer.close()


def test_missing_step_and_empty_directory(tmp_path):
    _saved(tmp_path / "ck", steps=(1,)).close()
    with DirectoryReader(tmp_path / "ck") as reader:
        with pytest.raises(pitstop.CheckpointNotFoundError, match="step 7"):
            reader.load(7)
        with pytest.raises(pitstop.CheckpointNotFoundError, match="step 7"):
            reader.checkpoint(7)
    (tmp_path / "empty").mkdir()
    reader = DirectoryReader(tmp_path / "empty")
    assert reader.latest_step() is None
    with pytest.raises(pitstop.CheckpointNotFoundError):
        reader.load()


def test_bad_directory_is_refused_as_the_manager_refuses_it():
    with pytest.raises(pitstop.InvalidArgumentError, match="directory must name"):
        DirectoryReader("")
