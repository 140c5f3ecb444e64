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
def _pitstop_model_checkpoint(monkeypatch, request):
    import keras.src.callbacks as kc

    made = []

    class ModelCheckpoint(pk.ModelCheckpoint):  # Keras names the class in messages
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(kc, "ModelCheckpoint", ModelCheckpoint)
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
