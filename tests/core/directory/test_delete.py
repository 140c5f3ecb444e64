"""CheckpointManager.delete: one committed checkpoint, this directory's own, on request (the
TensorFlow adapter writes a step again as tf.train overwrites a path)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import pitstop


def open_mgr(path, **kw):
    return pitstop.CheckpointManager(path, save_on_signals=None, memory_tier=False, **kw)


def test_delete_then_save_the_same_step_again(tmp_path):
    with open_mgr(tmp_path / "c") as m:
        m.save(1, {"a": np.zeros(3)})
        m.save(2, {"a": np.ones(3)})
        m.delete(1)  # in flight or committed: waits, then deletes
        assert m.all_steps() == [2]
        m.save(1, {"a": np.full(3, 7.0)}).wait()
        assert m.all_steps() == [1, 2] and (m.load(1)["a"] == 7.0).all()
    with open_mgr(tmp_path / "c") as m:  # the index agrees after a restart
        assert m.all_steps() == [1, 2]


def test_delete_refuses_what_is_not_there_or_not_ours(tmp_path):
    with open_mgr(tmp_path / "a") as a:
        a.save(5, {"x": np.zeros(2)}).wait()
    with open_mgr(tmp_path / "b") as b:
        with pytest.raises(pitstop.CheckpointNotFoundError):
            b.delete(5)
        shutil.copytree(tmp_path / "a" / "step_0000000005", tmp_path / "b" / "step_0000000005")
        assert b.all_steps() == [5]
        with pytest.raises(pitstop.CheckpointError, match="deletes only its own"):
            b.delete(5)
        assert (tmp_path / "b" / "step_0000000005").exists()
        with pytest.raises(pitstop.InvalidArgumentError):
            b.delete("5")
    with open_mgr(tmp_path / "a", read_only=True) as r:
        with pytest.raises(pitstop.CheckpointError, match="read_only"):
            r.delete(5)


def test_a_run_directory_deleted_under_the_manager_is_named_as_such(tmp_path):
    """The failure of the next save says the directory is gone (not that committed
    checkpoints are intact), and a new manager starts the directory again."""
    m = open_mgr(tmp_path / "gone")
    try:
        m.save(1, {"a": np.zeros(3)}).wait()
        shutil.rmtree(tmp_path / "gone")
        with pytest.raises(pitstop.CheckpointWriteError, match="no longer exists"):
            m.save(2, {"a": np.ones(3)}).wait()
    finally:
        try:
            m.close()
        except pitstop.CheckpointError:
            pass
    with open_mgr(tmp_path / "gone") as again:
        again.save(3, {"a": np.ones(3)}).wait()
        assert again.all_steps() == [3]
