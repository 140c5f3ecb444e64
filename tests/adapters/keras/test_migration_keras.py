"""docs/migration.md, "From Keras's ModelCheckpoint and BackupAndRestore": every row, the same
fit through Keras's callback and through pitstop's side by side in this process, on the
backend of this process (KERAS_BACKEND): the same files with the same weights, the same
weights after an interrupted fit is run again. (Every argument of ModelCheckpoint, file by file:
tests/adapters/keras/test_checkpoint_vs_keras.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
from keras_helpers import on_backends, weights_of

from pitstop.adapters.keras import BackupAndRestore, ModelCheckpoint

PEERS = {"keras": (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore),
         "pitstop": (ModelCheckpoint, BackupAndRestore)}


def make_model() -> keras.Model:
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    return model


def data() -> tuple[np.ndarray, np.ndarray]:
    x = np.random.RandomState(0).randn(16, 4).astype("float32")
    return x, x.sum(1, keepdims=True)


def fit(model: keras.Model, callbacks: list[Any], epochs: int = 3) -> None:
    model.fit(*data(), batch_size=8, epochs=epochs, shuffle=False, verbose=0,
              callbacks=callbacks)


def same_weights(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


@on_backends("torch", "tensorflow")
def test_model_checkpoint_writes_keras_files_that_load_model_reads(tmp_path: Path) -> None:
    """``ModelCheckpoint(filepath, save_freq=..., save_weights_only=...)``: the same files;
    ``keras.models.load_model`` and ``load_weights`` read pitstop's as Keras's; with
    ``keep_last=2`` only the newest two of those files stay."""
    kept: dict[str, list[str]] = {}
    loaded: dict[str, list[np.ndarray]] = {}
    for kind, (Checkpoint, _) in PEERS.items():
        d = tmp_path / kind
        extra = {"keep_last": 2} if kind == "pitstop" else {}
        fit(make_model(), [Checkpoint(str(d / "m{epoch}.keras")),
                           Checkpoint(str(d / "w{epoch}.weights.h5"), save_weights_only=True,
                                      **extra)])
        kept[kind] = sorted(p.name for p in d.iterdir() if not p.name.endswith(".pitstop"))
        model = keras.models.load_model(d / "m2.keras")
        fresh = make_model()
        fresh.load_weights(d / "w3.weights.h5")
        loaded[kind] = weights_of(model) + weights_of(fresh)
    assert kept["keras"] == ["m1.keras", "m2.keras", "m3.keras", "w1.weights.h5",
                             "w2.weights.h5", "w3.weights.h5"]
    assert kept["pitstop"] == [n for n in kept["keras"] if n != "w1.weights.h5"]
    assert same_weights(loaded["pitstop"], loaded["keras"])


class Interrupt(keras.callbacks.Callback):
    """Raises in the middle of epoch ``epoch`` (0-based) of the first fit only."""

    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch, self.armed, self.now = epoch, True, 0

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.now = epoch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.armed and self.now == self.epoch and batch == 0:
            self.armed = False
            raise RuntimeError("interrupted")


def test_backup_and_restore_resumes_to_the_weights_keras_resumes_to(tmp_path: Path) -> None:
    """``BackupAndRestore(backup_dir)`` (per epoch): a fit interrupted in epoch 2 and run
    again ends with the weights Keras's ends with, which are the uninterrupted fit's."""
    whole = make_model()
    fit(whole, [])
    got = {}
    for kind, (_, Backup) in PEERS.items():
        model, stop = make_model(), Interrupt(1)
        backup = Backup(str(tmp_path / kind))
        with pytest.raises(RuntimeError, match="interrupted"):
            fit(model, [backup, stop])
        model = make_model()  # run again (the callback too, as Keras's own tests do)
        fit(model, [backup, stop])
        got[kind] = weights_of(model)
    assert same_weights(got["keras"], weights_of(whole))
    assert same_weights(got["pitstop"], got["keras"])


@on_backends("tensorflow")
def test_an_old_keras_backup_folder_is_not_read(tmp_path: Path) -> None:
    """The row's warning: pitstop's ``BackupAndRestore`` does not resume from a folder
    Keras's own wrote; the fit starts again from the model's weights, as the row says."""
    model = make_model()
    with pytest.raises(RuntimeError):
        fit(model, [keras.callbacks.BackupAndRestore(str(tmp_path / "old")), Interrupt(1)])
    assert (tmp_path / "old" / "latest.weights.h5").exists()
    epochs: list[int] = []
    seen = keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, logs: epochs.append(e))
    fit(make_model(), [BackupAndRestore(str(tmp_path / "old")), seen])
    assert epochs == [0, 1, 2]


class LoadsTheFile(keras.callbacks.Callback):
    """A callback after ModelCheckpoint that reads the epoch's file in its own hook."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory, self.found = directory, []

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        path = self.directory / f"m{epoch + 1}.keras"
        self.found.append(path.exists() and weights_of(keras.models.load_model(path)))


@on_backends("torch")
def test_a_callback_after_model_checkpoint_finds_the_file_keras_wrote(tmp_path: Path) -> None:
    found = {}
    for kind, (Checkpoint, _) in PEERS.items():
        d = tmp_path / kind
        after = LoadsTheFile(d)
        fit(make_model(), [Checkpoint(str(d / "m{epoch}.keras")), after], epochs=2)
        found[kind] = after.found
    assert all(f is not False for f in found["keras"])
    assert all(g is not False for g in found["pitstop"])
    for theirs, ours in zip(found["keras"], found["pitstop"], strict=True):
        assert same_weights(ours, theirs)
