"""Keras's own tests of ``ModelCheckpoint`` and ``BackupAndRestore``
(keras/src/callbacks/model_checkpoint_test.py and backup_and_restore_test.py, as installed
with Keras), run unchanged against pitstop's classes: the Keras module attributes the test
files read, ``keras.src.callbacks.ModelCheckpoint`` / ``BackupAndRestore``, are pitstop's
classes for the duration of each test. Two BackupAndRestore tests check what pitstop does
otherwise on purpose (docs/keras.md, "Keras's own tests"): each is run to the one assertion
that differs, which must fail as expected, and has a twin in test_backup_and_restore.py."""

from __future__ import annotations

import pytest

import pitstop.adapters.keras as pk

own = pytest.importorskip("keras.src.callbacks.model_checkpoint_test")
own_bar = pytest.importorskip("keras.src.callbacks.backup_and_restore_test")


@pytest.fixture(autouse=True)
def _pitstop_model_checkpoint(monkeypatch, request):
    import keras.src.callbacks as kc

    made = []

    class ModelCheckpoint(pk.ModelCheckpoint):  # Keras names the class in messages
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    class BackupAndRestore(pk.BackupAndRestore):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(kc, "ModelCheckpoint", ModelCheckpoint)
    monkeypatch.setattr(kc, "BackupAndRestore", BackupAndRestore)
    yield
    if request.node.name.startswith("test_model_checkpoint"):
        # the Keras test really built pitstop's callbacks (and they wrote files)
        assert made and any(cb._written for cb in made)


def test_the_suite_runs_pitstops_class() -> None:
    import keras.src.callbacks as kc

    assert issubclass(kc.ModelCheckpoint, pk.ModelCheckpoint)
    assert issubclass(pk.ModelCheckpoint, own.callbacks.model_checkpoint.ModelCheckpoint)


class TestKerasModelCheckpoint(own.ModelCheckpointTest):
    """Every test of Keras's ModelCheckpointTest, on pitstop's ModelCheckpoint."""


class TestKerasBackupAndRestore(own_bar.BackupAndRestoreCallbackTest):
    """Every test of Keras's BackupAndRestoreCallbackTest, on pitstop's BackupAndRestore.
    (Keras's get_temp_dir() removes the backup directory as the test ends: a backup still
    being written then fails the test, as it failed a user's cleanup.)"""

    def test_best_case_step(self) -> None:
        # Keras resumes a step-wise backup at the start of the interrupted epoch and trains
        # its first 2 batches again (17 forward passes); pitstop resumes at the next batch
        # (15, as a fit() never interrupted). Twin: test_backup_and_restore.py's
        # test_best_case_step. Everything before this assertion passes unchanged.
        with pytest.raises(AssertionError, match=r"^15 != 17$"):
            super().test_best_case_step()

    def test_backup_corrupted(self) -> None:
        # Keras's test reads the paths of Keras's own backup files (cbk._weights_path,
        # latest.weights.h5 and its .bkp copy) and corrupts the first; pitstop's backups are
        # checkpoints (step_N/) it verifies by hash. Twin: test_backup_and_restore.py's
        # test_backup_corrupted_falls_back_to_the_previous_one.
        with pytest.raises(AssertionError, match=r"^False is not true$") as e:
            super().test_backup_corrupted()
        (at,) = [t for t in e.traceback if t.path.name == "backup_and_restore_test.py"]
        assert "cbk._weights_path" in str(at.statement)
