"""Keras's own tests of ``ModelCheckpoint`` (keras/src/callbacks/model_checkpoint_test.py, as
installed with Keras), run unchanged against pitstop's class: the Keras module attribute the
test file reads, ``keras.src.callbacks.ModelCheckpoint``, is pitstop's class for the
duration of each test. Keras's ``BackupAndRestore`` tests are in
test_backup_and_restore.py, re-expressed for a resume that is exact."""

from __future__ import annotations

import pytest

import pitstop.adapters.keras as pk

own = pytest.importorskip("keras.src.callbacks.model_checkpoint_test")


@pytest.fixture(autouse=True)
def _pitstop_model_checkpoint(monkeypatch):
    import keras.src.callbacks as kc

    monkeypatch.setattr(kc, "ModelCheckpoint", pk.ModelCheckpoint)
    yield


def test_the_suite_runs_pitstops_class() -> None:
    import keras.src.callbacks as kc

    assert kc.ModelCheckpoint is pk.ModelCheckpoint
    assert issubclass(pk.ModelCheckpoint, own.callbacks.model_checkpoint.ModelCheckpoint)


class TestKerasModelCheckpoint(own.ModelCheckpointTest):
    """Every test of Keras's ModelCheckpointTest, on pitstop's ModelCheckpoint."""
