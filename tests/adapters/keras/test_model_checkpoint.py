"""pitstop's ModelCheckpoint: what it adds to Keras's (Keras's own tests are in
test_keras_own_suite.py): the same files as Keras's callback, written in the background,
appearing atomically with an integrity record, keep_last, best-only on fresh values, and
errors a user can act on."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
import zipfile
from pathlib import Path

import keras
import numpy as np
import pytest
from keras_helpers import h5_tree, on_backends, weights_of

import pitstop
from pitstop.adapters.keras import ModelCheckpoint, files, verify_file

BACKEND = keras.backend.backend()


def make_model(seed: int = 1) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.BatchNormalization(), keras.layers.Dropout(0.2),
                              keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(1e-2), "mse", metrics=["mae"])
    return model


def data(n: int = 40):
    rs = np.random.RandomState(0)
    x = rs.randn(n, 4).astype("float32")
    return x, x.sum(1, keepdims=True)


@pytest.mark.parametrize("weights_only", [False, True], ids=["keras", "weights.h5"])
def test_same_files_as_keras_own_callback(tmp_path, weights_only) -> None:
    """The differential: one fit, Keras's callback and pitstop's side by side, at every
    epoch; the files hold the same entries, configuration and bytes of every variable."""
    ext = ".weights.h5" if weights_only else ".keras"
    model, (x, y) = make_model(), data()
    theirs = keras.callbacks.ModelCheckpoint(str(tmp_path / f"k{{epoch}}{ext}"),
                                             save_weights_only=weights_only)
    ours = ModelCheckpoint(str(tmp_path / f"p{{epoch}}{ext}"), save_weights_only=weights_only)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[theirs, ours])
    for epoch in (1, 2):
        k, p = tmp_path / f"k{epoch}{ext}", tmp_path / f"p{epoch}{ext}"
        verify_file(p)
        if weights_only:
            assert h5_tree(p) == h5_tree(k)
            continue
        with zipfile.ZipFile(k) as zk, zipfile.ZipFile(p) as zp:
            assert sorted(zk.namelist()) == sorted(zp.namelist())
            assert zk.read("config.json") == zp.read("config.json")
            import io
            assert h5_tree(io.BytesIO(zk.read("model.weights.h5"))) == \
                h5_tree(io.BytesIO(zp.read("model.weights.h5")))
    # and Keras opens them as its own
    if weights_only:
        other = make_model(5)
        other.load_weights(tmp_path / f"p2{ext}")
    else:
        other = keras.models.load_model(tmp_path / f"p2{ext}")
    for a, b in zip(weights_of(other), weights_of(model), strict=True):
        np.testing.assert_array_equal(a, b)


def test_fit_goes_on_while_the_file_is_written(tmp_path, monkeypatch) -> None:
    """The first file's write is held back until training has finished the next batch (and
    asked for that batch's file too): a synchronous save could never get there (the test
    would fail on the timeout, not hang)."""
    reached = threading.Event()
    real_write = files.write
    first = []

    def slow_write(snap, filepath, info=None):
        if not first:
            first.append(filepath)
            assert reached.wait(60), "training did not go on while the file was written"
        real_write(snap, filepath, info)

    monkeypatch.setattr(files, "write", slow_write)

    class Watch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                reached.set()

    model, (x, y) = make_model(), data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[
        ModelCheckpoint(str(tmp_path / "b{batch}.weights.h5"), save_freq=1,
                        save_weights_only=True, write_in_background=True), Watch()])
    # fit() returned: every file is there, complete
    assert sorted(p.name for p in tmp_path.glob("*.h5")) == [f"b{i}.weights.h5" for i in range(1, 6)]
    for p in tmp_path.glob("*.h5"):
        verify_file(p)


def test_integrity_record_catches_a_changed_file(tmp_path) -> None:
    model, (x, y) = make_model(), data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0,
              callbacks=[ModelCheckpoint(str(tmp_path / "m.keras"))])
    record = verify_file(tmp_path / "m.keras")
    assert record["epoch"] == 1 and record["batch"] is None and "loss" in record["logs"]
    raw = bytearray((tmp_path / "m.keras").read_bytes())
    raw[len(raw) // 2] ^= 1
    (tmp_path / "m.keras").write_bytes(bytes(raw))
    with pytest.raises(pitstop.CorruptCheckpointError, match="does not match its integrity"):
        verify_file(tmp_path / "m.keras")
    (tmp_path / "m.keras.pitstop").unlink()
    with pytest.raises(pitstop.CheckpointNotFoundError, match="no integrity record"):
        verify_file(tmp_path / "m.keras")


def test_keep_last_keeps_the_newest_files(tmp_path) -> None:
    model, (x, y) = make_model(), data()
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[
        ModelCheckpoint(str(tmp_path / "e{epoch}b{batch}.weights.h5"), save_freq=2,
                        save_weights_only=True, keep_last=2)])
    names = sorted(os.listdir(tmp_path))
    assert names == ["e2b3.weights.h5", "e2b3.weights.h5.pitstop",
                     "e2b5.weights.h5", "e2b5.weights.h5.pitstop"]
    with pytest.raises(ValueError, match="keep_last"):
        ModelCheckpoint(str(tmp_path / "m.keras"), keep_last=0)


def test_best_only_on_a_validation_metric_with_batch_saves(tmp_path) -> None:
    """Keras's own callback saves at every batch save without judging (val_loss is not in
    batch logs); pitstop's warns once and judges val_loss when it is fresh, at epoch ends."""
    model, (x, y) = make_model(), data()
    path = tmp_path / "best.weights.h5"
    cb = ModelCheckpoint(str(path), save_best_only=True, save_freq=2, save_weights_only=True)
    seen = []

    class Epochs(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(logs["val_loss"])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=8, epochs=4, verbose=0, validation_data=(x[:8], y[:8]),
                  callbacks=[cb, Epochs()])
    ours = [w for w in caught if "is computed only at the end of an epoch" in str(w.message)]
    assert len(ours) == 1
    assert not [w for w in caught if "Can save best model only" in str(w.message)]
    assert cb.best == min(seen)
    assert verify_file(path)["logs"]["val_loss"] == pytest.approx(min(seen))


def test_best_only_on_loss_with_batch_saves_in_the_first_epoch(tmp_path) -> None:
    """Keras's own callback sets its comparison at the first epoch end, so best-only batch
    saves fail with a TypeError at the second save of the first epoch; pitstop's judges
    them (the monitored training loss is in every batch's logs)."""
    model, (x, y) = make_model(), data()
    with pytest.raises(TypeError):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[
            keras.callbacks.ModelCheckpoint(str(tmp_path / "k.weights.h5"), monitor="loss",
                                            save_best_only=True, save_freq=2,
                                            save_weights_only=True)])
    cb = ModelCheckpoint(str(tmp_path / "p.weights.h5"), monitor="loss", save_best_only=True,
                         save_freq=2, save_weights_only=True)
    losses = []

    class Loss(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            losses.append(logs["loss"])

    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[cb, Loss()])
    judged = [losses[i] for i in range(1, len(losses), 2)]  # every second batch (save_freq=2)
    assert cb.best == pytest.approx(min(judged))
    assert verify_file(tmp_path / "p.weights.h5")["logs"]["loss"] == pytest.approx(cb.best)


def test_a_failed_write_is_an_error_fit_raises_and_earlier_files_stay(tmp_path,
                                                                      monkeypatch) -> None:
    model, (x, y) = make_model(), data()
    real = files._write_tmp
    calls = []

    def full_disk(snap, tmp):
        calls.append(tmp)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(snap, tmp)

    monkeypatch.setattr(files, "_write_tmp", full_disk)
    with pytest.raises(pitstop.CheckpointWriteError, match="No space left on device.*intact"):
        model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[
            ModelCheckpoint(str(tmp_path / "m{epoch}.keras"))])
    assert sorted(os.listdir(tmp_path)) == ["m1.keras", "m1.keras.pitstop"]
    verify_file(tmp_path / "m1.keras")


def test_a_directory_as_filepath_is_refused_as_keras_refuses_it(tmp_path) -> None:
    (tmp_path / "m.keras").mkdir()
    model, (x, y) = make_model(), data()
    with pytest.raises(OSError, match="non-directory filepath"):
        model.fit(x, y, epochs=1, verbose=0,
                  callbacks=[ModelCheckpoint(str(tmp_path / "m.keras"))])


@on_backends("jax")  # whole files after a kill do not depend on the backend: one run
def test_sigkill_while_writing_leaves_whole_files_only(tmp_path) -> None:
    child = subprocess.Popen([sys.executable, str(Path(__file__).with_name("save_child.py")),
                              str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env=dict(os.environ, KERAS_BACKEND=BACKEND))
    try:
        deadline = time.monotonic() + 180
        while len(list(tmp_path.glob("*.pitstop"))) < 2:
            assert child.poll() is None, child.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no file written in 180 s"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    final = sorted(tmp_path.glob("m-*.keras"))
    assert final
    for p in final:  # each file under its final name is whole: Keras opens it
        assert zipfile.ZipFile(p).testzip() is None
        if (tmp_path / (p.name + ".pitstop")).exists():
            verify_file(p)
    keras.models.load_model(final[-1])
    # a writer killed mid-file leaves a hidden temporary: the next run removes it
    stale = tmp_path / f".m-1-9.keras.{child.pid}-0.pitstop-tmp.keras"
    stale.write_bytes(b"partial")
    cb = ModelCheckpoint(str(tmp_path / "m-{epoch}-{batch}.keras"))
    cb.set_model(make_model())
    cb.on_train_begin()
    assert not list(tmp_path.glob(".*pitstop-tmp*"))


@pytest.mark.parametrize(("name", "kwargs"), [
    ("m-{epoch:02d}.keras", {}),
    ("w-{epoch:02d}.weights.h5", {"save_weights_only": True}),
    ("best.keras", {"save_best_only": True, "monitor": "loss"}),
    ("b-{epoch}-{batch}.weights.h5", {"save_weights_only": True, "save_freq": 2}),
], ids=["keras-epoch", "weights-epoch", "best-only", "batch-freq"])
def test_a_callback_after_it_loads_the_file_as_after_keras_own(tmp_path, name, kwargs) -> None:
    """The differential: a callback placed after the checkpoint callback loads the file
    it just wrote, in on_epoch_end and on_train_batch_end, through Keras's ModelCheckpoint
    and through pitstop's (the default: the file is whole when the callback returns)."""
    def run(make_cb, folder):
        loaded = []

        class Loader(keras.callbacks.Callback):
            def _load(self, epoch, batch):
                path = folder / name.format(epoch=epoch + 1, batch=batch + 1)
                if not path.exists():
                    return
                if str(path).endswith(".weights.h5"):
                    other = make_model(7)
                    other.load_weights(path)
                else:
                    other = keras.models.load_model(path)
                loaded.append((path.name, [a.tobytes() for a in weights_of(other)]))

            def on_epoch_end(self, epoch, logs=None):
                if kwargs.get("save_freq") is None:
                    self._load(epoch, -1)

            def on_train_batch_end(self, batch, logs=None):
                if kwargs.get("save_freq") and (batch + 1) % 2 == 0:
                    self._load(self.model._pitstop_epoch, batch)

            def on_epoch_begin(self, epoch, logs=None):
                self.model._pitstop_epoch = epoch

        folder.mkdir()
        model, (x, y) = make_model(), data()
        model.fit(x, y, batch_size=8, epochs=2, verbose=0,
                  callbacks=[make_cb(str(folder / name)), Loader()])
        return loaded

    theirs = run(lambda p: keras.callbacks.ModelCheckpoint(p, **kwargs), tmp_path / "k")
    ours = run(lambda p: ModelCheckpoint(p, **kwargs), tmp_path / "p")
    assert theirs and ours == theirs


def test_a_url_filepath_is_refused_when_built(tmp_path, monkeypatch) -> None:
    """s3://, gs://, memory:// were written to a local folder named 's3:'; now refused at
    construction with the fix, and nothing is written."""
    monkeypatch.chdir(tmp_path)
    for url in ("s3://bucket/ckpt/m-{epoch}.keras", "gs://b/w.weights.h5",
                "memory://run/m.keras"):
        with pytest.raises(pitstop.InvalidArgumentError, match="local files only"):
            ModelCheckpoint(url, save_weights_only=url.endswith(".weights.h5"))
    assert not os.listdir(tmp_path)


def test_bad_manager_options_are_refused_when_built(tmp_path) -> None:
    from pitstop.adapters.keras import BackupAndRestore

    for options, message in [
        ({"kep_last": 3}, "no such option .*did you mean 'keep_last'"),
        ({"keep_last": "3"}, r"'keep_last'\] must be int or None, got str"),
        ({"keep_last": True}, "must be int or None, got bool"),
        ({"save_every_seconds": "60"}, "must be float or None"),
        ({"on_save": 3}, "'on_save'"),
        ({"directory": "elsewhere"}, "set by BackupAndRestore itself.*backup_dir"),
        ({"read_only": True}, "set by BackupAndRestore itself"),
        ({"on_busy": "skip"}, "set by BackupAndRestore itself"),
        ({"keep_last": 1}, "fewer backups than double_checkpoint=True"),
        (["keep_last"], "must be a dict"),
    ]:
        with pytest.raises(pitstop.InvalidArgumentError, match=message):
            BackupAndRestore(tmp_path / "b", double_checkpoint=True, manager_options=options)
    cb = BackupAndRestore(tmp_path / "b", manager_options={
        "keep_last": 3, "memory_tier": False, "save_every_seconds": 60, "on_save": print,
        "save_on_signals": "SIGTERM", "compression": "zstd"})
    assert cb.manager_options["keep_last"] == 3
    assert not (tmp_path / "b").exists()
