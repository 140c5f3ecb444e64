"""Lifecycle and misuse of the tf.train-style wrapper: what a failed save leaves behind."""

from __future__ import annotations

import errno
import os

import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
tf = pytest.importorskip("tensorflow")

import pitstop  # noqa: E402
from pitstop.adapters.tf import Checkpoint, CheckpointManager  # noqa: E402
from pitstop.core.storage import local  # noqa: E402


@pytest.fixture
def full_disk(monkeypatch):
    """``full_disk(True)``: every commit fails with ENOSPC (in the background), until
    ``full_disk(False)``."""
    real = local._LocalTransaction.commit
    on = [False]

    def commit(self, manifest):
        if on[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, manifest)

    monkeypatch.setattr(local._LocalTransaction, "commit", commit)

    def switch(value: bool) -> None:
        on[0] = value

    return switch


def test_a_save_that_fails_in_the_background_is_not_recorded(tmp_path, full_disk):
    v = tf.Variable([1.0, 2.0])
    ckpt = Checkpoint(v=v)
    d = str(tmp_path / "run")
    manager = CheckpointManager(ckpt, d, max_to_keep=2, memory_tier=False)
    try:
        first = manager.save()
        manager.sync()
        full_disk(True)
        assert manager.save() == f"{d}/ckpt-2"
        with pytest.raises(pitstop.CheckpointError):
            manager.sync()
        full_disk(False)
        # as tf.train after a save that raised: the failed one is neither latest nor listed
        assert manager.latest_checkpoint == first
        assert manager.checkpoints == [first]
        v.assign([0.0, 0.0])
        assert manager.restore_or_initialize() == first
        assert v.numpy().tolist() == [1.0, 2.0]
        # and it does not count towards max_to_keep: the good checkpoint 1 is kept (the
        # restore set save_counter back to 1, as tf.train's does, so this is ckpt-2 again)
        third = manager.save()
        manager.sync()
        assert third == f"{d}/ckpt-2"
        assert manager.checkpoints == [first, third]
        assert sorted(n for n in os.listdir(d) if not n.startswith(".")) == \
            ["ckpt-1", "ckpt-2"]
    finally:
        manager.close()
    again = CheckpointManager(Checkpoint(v=tf.Variable([0.0, 0.0])), d, max_to_keep=2)
    try:
        assert again.checkpoints == [first, third]
        assert again.latest_checkpoint == third
    finally:
        again.close()


def test_a_save_that_raises_leaves_the_managers_state_as_it_was(tmp_path):
    ckpt = Checkpoint(v=tf.Variable([1.0, 2.0]))
    d = str(tmp_path / "run")
    manager = CheckpointManager(ckpt, d, max_to_keep=1, memory_tier=False)
    try:
        first = manager.save()
        with pytest.raises(ValueError):
            manager.save(checkpoint_number=-1)
        assert manager.latest_checkpoint == first
        assert manager.checkpoints == [first]
        manager.sync()
        assert os.path.isdir(first)
        assert manager.restore_or_initialize() == first
    finally:
        manager.close()


def test_a_refused_restore_is_not_followed_by_a_partial_restore_warning(tmp_path, caplog):
    import gc
    path = Checkpoint(v=tf.Variable([1.0, 2.0])).write(str(tmp_path / "one"))
    target = tf.Variable([7.0, 8.0, 9.0])
    wrong = Checkpoint(v=target)
    with pytest.raises(pitstop.IncompatibleTargetError, match="VARIABLE_VALUE"):
        wrong.restore(path)
    gc.collect()
    assert target.numpy().tolist() == [7.0, 8.0, 9.0]  # nothing changed
    assert "expect_partial" not in caplog.text


def test_a_manager_made_after_a_restore_by_path_saves(tmp_path):
    d = str(tmp_path / "run")
    first = CheckpointManager(Checkpoint(v=tf.Variable([1.0])), d, max_to_keep=3)
    first.save()
    first.close()
    # a restarted job: restore by path (tf.train's idiom), then a manager on that directory
    ckpt = Checkpoint(v=tf.Variable([0.0]))
    status = ckpt.restore(f"{d}/ckpt-1")
    manager = CheckpointManager(ckpt, d, max_to_keep=3)
    try:
        assert manager.save() == f"{d}/ckpt-2"
        assert ckpt.save(f"{d}/ckpt") == f"{d}/ckpt-3"
        manager.sync()
        ckpt.sync()
    finally:
        manager.close()
    status.assert_consumed()
    assert sorted(n for n in os.listdir(d) if not n.startswith(".")) == \
        ["ckpt-1", "ckpt-2", "ckpt-3"]


HOW = ["latest_checkpoint", "path"]


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory):
    """A run directory per ``how``, each left by one job (killed once, after a save into each
    returned) with its ckpt-2 in the memory tier only."""
    from tf_helpers import killed_after_saves

    dirs = {how: str(tmp_path_factory.mktemp(how) / "run") for how in HOW}
    assert killed_after_saves(1 << 16, *dirs.values()) == [f"{d}/ckpt-2" for d in dirs.values()]
    yield dirs
    for d in dirs.values():  # a test deselected: its snapshot does not stay in /dev/shm
        CheckpointManager(Checkpoint(v=tf.Variable(tf.zeros([1 << 16]))), d, max_to_keep=2,
                          memory_tier=True).close()


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="needs /dev/shm")
@pytest.mark.parametrize("how", HOW)
def test_restoring_by_path_after_a_sigkill_finds_the_save_that_returned(killed_runs, how):
    """tf.train's restart idiom, ``ckpt.restore(latest_checkpoint(d))`` (or the path the
    save returned), without a manager: the snapshot in the memory tier is that checkpoint."""
    from pitstop.adapters.tf import latest_checkpoint
    d = killed_runs[how]
    v = tf.Variable(tf.zeros([1 << 16]))
    ckpt = Checkpoint(v=v)
    if how == "latest_checkpoint":
        assert latest_checkpoint(d) == f"{d}/ckpt-2"
        ckpt.restore(latest_checkpoint(d)).assert_consumed()
    else:
        ckpt.restore(f"{d}/ckpt-2").assert_consumed()
    assert float(v.numpy()[0]) == 1.0 and float(v.numpy()[-1]) == float(1 << 16)
    assert os.path.exists(f"{d}/ckpt-2/manifest.json")  # committed now
    assert latest_checkpoint(d) == f"{d}/ckpt-2"
