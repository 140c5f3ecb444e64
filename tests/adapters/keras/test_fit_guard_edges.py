"""BackupAndRestore's fit guard where a user's fit() leaves the paths its own tests tried:
an exception raised by the input pipeline (on torch the batches are read outside the train
step), and a Keras whose callback list the guard cannot find (it steps aside, saying so)."""

from __future__ import annotations

import shutil
import threading
import warnings

import keras
import numpy as np
import pytest

from pitstop.adapters.keras import BackupAndRestore


def make_model() -> keras.Model:
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer="sgd")
    return model


class Batches(keras.utils.PyDataset):
    """5 batches an epoch; reading batch ``fail_at`` of epoch 1 raises, after releasing
    ``release`` (the writer of epoch 0's backup goes on from there)."""

    def __init__(self, release: threading.Event, fail_at: int = 2) -> None:
        super().__init__()
        rs = np.random.RandomState(0)
        self.x, self.y = rs.rand(20, 3).astype("float32"), rs.rand(20, 1).astype("float32")
        self.release, self.fail_at, self.reads = release, fail_at, 0

    def __len__(self) -> int:
        return 5

    def __getitem__(self, i: int):
        self.reads += 1
        if self.reads > 5 + self.fail_at:
            self.release.set()
            raise OSError("the data pipeline failed")
        return self.x[4 * i:4 * i + 4], self.y[4 * i:4 * i + 4]


class Hold(keras.callbacks.Callback):
    def __init__(self, backup: BackupAndRestore, release: threading.Event) -> None:
        super().__init__()
        self.backup, self.release = backup, release

    def on_train_begin(self, logs=None):
        self.backup._mgr.hooks["before_write"] = lambda step: self.release.wait(120)


def test_a_fit_failed_by_its_data_returns_with_its_backups_committed(tmp_path) -> None:
    """An exception from the input (a PyDataset's __getitem__) ends fit() only once the
    backup it asked for is committed: the user's cleanup right after races no writer."""
    backup_dir, release = tmp_path / "backup", threading.Event()
    cbk = BackupAndRestore(backup_dir, save_freq="epoch")
    with pytest.raises(Exception, match="the data pipeline failed"):  # tf: UnknownError:
        make_model().fit(Batches(release), epochs=3, verbose=0,
                         callbacks=[cbk, Hold(cbk, release)])
    assert cbk._mgr is None, "fit() returned with its backup manager open (a write in flight)"
    assert [p.name for p in backup_dir.iterdir() if p.name.startswith("step_")] \
        == ["step_0000000005"]
    shutil.rmtree(backup_dir)


def test_the_guard_steps_aside_with_one_warning_where_keras_differs(tmp_path,
                                                                     monkeypatch) -> None:
    """Where fit()'s callback list cannot be found (Keras's internals differ), a mid-epoch
    resume still resumes, and says once that other callbacks see the passed-over batches."""
    rs = np.random.RandomState(0)
    x, y = rs.rand(20, 3).astype("float32"), rs.rand(20, 1).astype("float32")

    class Stop(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:
                raise RuntimeError("interrupted")

    seen: list[int] = []
    cbk = BackupAndRestore(tmp_path / "b", save_freq=2)
    with pytest.raises(RuntimeError, match="interrupted"):
        make_model().fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[cbk, Stop()])

    class Other(type(keras.callbacks.CallbackList())):  # a callback list the guard knows not
        pass

    monkeypatch.setattr(keras.callbacks, "CallbackList", Other)
    rec = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: seen.append(b))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        make_model().fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[cbk, rec])
    ours = [str(m.message) for m in w if "pitstop" in str(m.message)
            and "callback" in str(m.message)]
    assert len(ours) == 1, ours
    assert "passed over" in ours[0] and "BackupAndRestore" in ours[0]
    assert seen == [0, 1, 2, 3, 4]  # as said: the passed-over batches reach other callbacks


def test_a_plain_fit_gives_no_warning(tmp_path) -> None:
    """BackupAndRestore decides its saves itself and calls the manager's step() only for the
    signal saves: a plain fit() is not told that step() 'saves only on a signal'."""
    rs = np.random.RandomState(0)
    x, y = rs.rand(12, 3).astype("float32"), rs.rand(12, 1).astype("float32")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        make_model().fit(x, y, batch_size=4, epochs=2, verbose=0,
                         callbacks=[BackupAndRestore(tmp_path / "b", save_freq=2)])
    assert not [str(m.message) for m in w if "pitstop" in str(m.message)]


class RaiseAtTrainEnd(keras.callbacks.Callback):
    """Placed before a BackupAndRestore: its on_train_end raises (an upload that failed),
    so Keras never calls the backup's own on_train_end."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__()
        self.release = release

    def on_train_end(self, logs=None):
        self.release.set()
        raise RuntimeError("the upload failed")


def test_a_fit_failed_in_an_earlier_on_train_end_returns_with_its_backups_committed(
        tmp_path) -> None:
    backup_dir, release = tmp_path / "backup", threading.Event()
    cbk = BackupAndRestore(backup_dir, save_freq="epoch", delete_checkpoint=False)
    model = make_model()
    rs = np.random.RandomState(0)
    x, y = rs.rand(12, 3).astype("float32"), rs.rand(12, 1).astype("float32")
    with pytest.raises(RuntimeError, match="the upload failed"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0,
                  callbacks=[RaiseAtTrainEnd(release), cbk, Hold(cbk, release)])
    assert cbk._mgr is None, "fit() returned with its backup manager open (a write in flight)"
    assert [p.name for p in backup_dir.iterdir() if p.name.startswith("step_")] \
        == ["step_0000000003"]
    assert model.train_function is None or "call" not in model.train_function.__name__


def test_a_backup_at_an_epochs_last_batch_does_not_end_that_epoch_twice(tmp_path) -> None:
    """save_freq=5 over 10-batch epochs: a backup falls on each epoch's last batch. Killed in
    epoch 1 before its next backup, the resumed fit() must not end epoch 0 again: a
    CSVLogger(append=True) keeps one row per epoch, as a fit() never interrupted writes."""
    import csv as csvmod

    rs = np.random.RandomState(0)
    x, y = rs.rand(40, 3).astype("float32"), rs.rand(40, 1).astype("float32")

    class Stop(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.params and batch == 2 and self.epoch == 1:
                raise RuntimeError("interrupted")

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

    def rows(path) -> list[list[str]]:
        with open(path) as f:
            return list(csvmod.reader(f))

    kw = dict(batch_size=4, epochs=2, verbose=0, validation_data=(x[:8], y[:8]))
    cbk, log = BackupAndRestore(tmp_path / "b", save_freq=5), tmp_path / "log.csv"
    with pytest.raises(RuntimeError, match="interrupted"):
        make_model().fit(x, y, callbacks=[cbk, keras.callbacks.CSVLogger(log, append=True),
                                          Stop()], **kw)
    make_model().fit(x, y, callbacks=[cbk, keras.callbacks.CSVLogger(log, append=True)], **kw)
    full = tmp_path / "full.csv"
    make_model().fit(x, y, callbacks=[BackupAndRestore(tmp_path / "c", save_freq=5),
                                      keras.callbacks.CSVLogger(full)], **kw)
    assert rows(log) == rows(full)
