"""A mid-epoch resume shows no callback a batch with a model that is not that batch's.

The scenario of the issue, in one process per backend: ``keras.callbacks.ModelCheckpoint``
(a weights file every 2 batches) beside a ``BackupAndRestore(save_freq=5)``, the fit
interrupted at its 8th batch (an exception from a later callback), then resumed by a new
``fit()`` of a freshly built model. Keras's own BackupAndRestore (the peer) starts the
epoch again: its callbacks see batches 0..9 again, each with the model retrained from the
backup, and every file holds the model the callbacks were shown at that batch. pitstop's
resumes at batch 5: its callbacks see only the batches it trains, with the logs and weights
of a fit() that was never interrupted, and every file equals that fit()'s file (the files of
batches 2 and 4 are not rewritten with batch-5 weights).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras_helpers import on_backends

from pitstop.adapters.keras import BackupAndRestore

BATCHES, EPOCHS, STOP_AT = 10, 1, 8


class Recorder(keras.callbacks.Callback):
    """What a callback is shown: (epoch, batch) -> (loss, the model's weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int]] = []
        self.logs: dict[tuple[int, int], float] = {}
        self.weights: dict[tuple[int, int], list[np.ndarray]] = {}

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        key = (self.epoch, batch)
        self.seen.append(key)
        self.logs[key] = float(logs["loss"])
        self.weights[key] = [np.array(w) for w in self.model.get_weights()]


class Interrupt(keras.callbacks.Callback):
    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.n = at, 0

    def on_train_batch_end(self, batch, logs=None):
        self.n += 1
        if self.n == self.at:
            raise RuntimeError("interrupted")


def make_model() -> keras.Model:
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    return model


rs = np.random.RandomState(0)
X = rs.randn(8 * BATCHES, 4).astype("float32")
Y = (X[:, :1] - X[:, 1:2]).astype("float32")


def fit(backup, files, interrupt_at: int | None = None) -> Recorder:
    rec = Recorder()
    cbs = [backup, keras.callbacks.ModelCheckpoint(str(files / "{epoch:02d}-{batch:03d}.weights.h5"),
                                                   save_weights_only=True, save_freq=2), rec]
    model = make_model()
    if interrupt_at is None:
        model.fit(X, Y, batch_size=8, epochs=EPOCHS, shuffle=True, verbose=0, callbacks=cbs)
    else:
        with pytest.raises(RuntimeError, match="interrupted"):
            model.fit(X, Y, batch_size=8, epochs=EPOCHS, shuffle=True, verbose=0,
                      callbacks=[*cbs, Interrupt(interrupt_at)])
    return rec


#: where a .weights.h5 file of this model keeps each of model.get_weights(), in order
H5_PATHS = ["layers/dense/vars/0", "layers/dense/vars/1", "layers/dense_1/vars/0",
            "layers/dense_1/vars/1"]


def file_weights(files) -> dict[str, list[np.ndarray]]:
    import h5py

    out = {}
    for p in sorted(files.glob("*.weights.h5")):
        with h5py.File(p, "r") as f:
            out[p.name] = [np.array(f[k]) for k in H5_PATHS]
    return out


def key_of(name: str) -> tuple[int, int]:
    epoch, batch = name.split(".")[0].split("-")
    return int(epoch) - 1, int(batch) - 1


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def scenario(tmp_path, make_backup):
    files = tmp_path / "files"
    backup = make_backup(tmp_path / "backup")  # one callback, as in Keras's own tests
    first = fit(backup, files, interrupt_at=STOP_AT)
    resumed = fit(backup, files)
    return first, resumed, file_weights(files)


EVERY = [(e, b) for e in range(EPOCHS) for b in range(BATCHES)]
NAMES = {f"{e + 1:02d}-{b + 1:03d}.weights.h5" for e, b in EVERY if b % 2 == 1}


@on_backends("tensorflow")  # the peer's behaviour is the same on every backend
def test_keras_own_callback_starts_the_epoch_again(tmp_path) -> None:
    """The peer: Keras's own BackupAndRestore starts the interrupted epoch again; every
    file it leaves holds the model its callbacks were shown at that batch (retrained)."""
    k_first, k_resumed, k_files = scenario(
        tmp_path / "keras", lambda d: keras.callbacks.BackupAndRestore(str(d), save_freq=5))
    assert k_first.seen == EVERY[:STOP_AT]
    assert k_resumed.seen == EVERY
    assert set(k_files) == NAMES
    assert all(same(w, k_resumed.weights[key_of(n)]) for n, w in k_files.items())


def test_resume_shows_callbacks_only_the_batches_it_trains(tmp_path) -> None:
    """pitstop's: the batches trained before the backup (0..4) are seen by no callback;
    the others are seen with the logs and weights of a fit() never interrupted."""
    full = fit(BackupAndRestore(tmp_path / "full-backup"), tmp_path / "full-files")
    full_files = file_weights(tmp_path / "full-files")
    p_first, p_resumed, p_files = scenario(
        tmp_path / "pitstop", lambda d: BackupAndRestore(d, save_freq=5))
    assert p_first.seen == EVERY[:STOP_AT]
    assert p_resumed.seen == EVERY[5:], "a passed-over batch reached another callback"
    wrong = [k for k in p_resumed.seen if p_resumed.logs[k] != full.logs[k]
             or not same(p_resumed.weights[k], full.weights[k])]
    assert not wrong, f"batches shown with logs or weights not that batch's: {wrong}"
    assert set(p_files) == NAMES
    # the files of batches 2 and 4 are the interrupted run's, as in a fit() never interrupted
    differ = [n for n, w in p_files.items() if not same(w, full_files[n])]
    assert not differ, f"files that differ from an uninterrupted fit()'s: {differ}"
    # and, as with the peer, each file holds the model a callback was shown at its batch,
    # in the run that reached that batch last
    for n, w in p_files.items():
        shown = p_resumed.weights.get(key_of(n), p_first.weights.get(key_of(n)))
        assert same(w, shown), n
