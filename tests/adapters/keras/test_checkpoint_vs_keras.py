"""pitstop's Keras ModelCheckpoint and Keras adapter against Keras's own callback,
side by side, on the backend of this process (KERAS_BACKEND)."""

from __future__ import annotations

import contextlib
import io
import os
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
from pitstop.core.storage import sidecar

BACKEND = keras.backend.backend()


def make_model(seed: int = 1) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    return model


def data(n: int = 32):
    rs = np.random.RandomState(0)
    x = rs.randn(n, 4).astype("float32")
    return x, x.sum(1, keepdims=True)


def keras_tree(path) -> dict:
    with zipfile.ZipFile(path) as z:
        out = {n: z.read(n) for n in z.namelist() if n not in ("metadata.json",
                                                               "model.weights.h5")}
        out["model.weights.h5"] = h5_tree(io.BytesIO(z.read("model.weights.h5")))
    return out


class _Capture:
    """stdout and warnings of one fit."""

    def __init__(self) -> None:
        self.out = io.StringIO()
        self.warnings: list[str] = []


@contextlib.contextmanager
def capture():
    c = _Capture()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(c.out):
        warnings.simplefilter("always")
        yield c
    c.warnings = [str(w.message) for w in caught
                  if not issubclass(w.category, DeprecationWarning)]


def side_by_side(tmp_path, cls, name, fit_kwargs=None, model_fn=make_model, **cb_kwargs):
    """One fit with a given callback class; returns (capture, exception, model)."""
    model, (x, y) = model_fn(), data()
    d = tmp_path / cls.__module__.split(".")[0]
    cb = cls(str(d / name), **cb_kwargs)
    err = None
    with capture() as c:
        try:
            model.fit(x, y, **{"batch_size": 8, "epochs": 3, "verbose": 0, **(fit_kwargs or {})},
                      callbacks=[cb])
        except Exception as e:  # noqa: BLE001
            err = e
    return c, err, model, d


def listing(d: Path) -> list[str]:
    if not d.exists():
        return []
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*")
                  if p.is_file() and not p.name.endswith(".pitstop"))


# ============================================================ defects (expected to fail)


def test_best_only_batch_freq_without_validation_still_saves_like_keras(tmp_path) -> None:
    """save_best_only=True, save_freq=2 (batches), monitor='val_loss' (the default), and no
    validation data: Keras's callback warns 'Can save best model only with val_loss
    available' and saves at every batch save. pitstop skips every batch save ('judged at the
    epoch end') but at the epoch end val_loss is absent too, so it never writes any file: a
    whole run without a single checkpoint, with only a warning that promises saves at epoch
    ends. Expected: Keras's files (or at least a file), as promised ('same best-only
    decisions'; its warning says it saves at the epoch end)."""
    kw = dict(save_best_only=True, save_freq=2, save_weights_only=True)
    ck, ek, _, dk = side_by_side(tmp_path, keras.callbacks.ModelCheckpoint, "b.weights.h5", **kw)
    cp, ep, _, dp = side_by_side(tmp_path, ModelCheckpoint, "b.weights.h5", **kw)
    assert ek is None and ep is None
    assert listing(dk) == ["b.weights.h5"]
    assert listing(dp) == listing(dk), "pitstop wrote no checkpoint at all in the whole run"


def test_exception_in_fit_leaves_already_requested_files_written(tmp_path, monkeypatch) -> None:
    """fit() raises in epoch 2 after the epoch-1 save was requested, while that file is
    still being written (a write that takes 0.5 s, as on a slow disk). Keras calls no
    on_train_end when fit() raises, so pitstop's callback cannot wait there: the file is
    finished in the background, ``wait()`` waits for it (and raises a failed write), and a
    failure nobody waited for is logged at exit. The 'except: load the last checkpoint'
    pattern calls wait() first (docs/keras.md)."""
    real = files.write

    def slow(snap, filepath, info=None):
        time.sleep(0.5)
        real(snap, filepath, info)

    monkeypatch.setattr(files, "write", slow)

    class Boom(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("data pipeline broke")

    model, (x, y) = make_model(), data()
    cb = ModelCheckpoint(str(tmp_path / "m{epoch}.keras"))
    with pytest.raises(RuntimeError, match="data pipeline broke"):
        model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[cb, Boom()])
    cb.wait()
    assert (tmp_path / "m1.keras").exists(), "the epoch-1 checkpoint was not written"
    keras.models.load_model(tmp_path / "m1.keras")


def test_verify_file_during_overwrite_is_not_a_false_corruption(tmp_path, monkeypatch) -> None:
    """save_best_only with a fixed filename overwrites the same file; a reader running
    verify_file at that moment reads the old record, then hashes the new file (replaced in
    between) and gets CorruptCheckpointError('the file was changed or damaged') although
    both the old and the new file are whole and correct. Expected: a reader sees the old file
    verified, the new file verified, or a 'not yet recorded' CheckpointNotFoundError (as the
    docstring says for a missing record), never a corruption verdict on an intact file.
    The interleaving is made deterministic by running the writer's replacement between
    verify_file's record read and its hashing."""
    model, (x, y) = make_model(), data()
    path = tmp_path / "best.weights.h5"
    files.write(files.snapshot(model, str(path), True), str(path), {"epoch": 1})
    verify_file(path)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    new = files.snapshot(model, str(path), True)
    real_hasher = sidecar.new_hasher
    fired = []

    def hasher(alg):
        if not fired:
            fired.append(1)
            files.write(new, str(path), {"epoch": 2})  # the writer thread overwrites now
        return real_hasher(alg)

    monkeypatch.setattr(sidecar, "new_hasher", hasher)
    try:
        verify_file(path)
    except pitstop.CheckpointNotFoundError:
        pass
    monkeypatch.setattr(sidecar, "new_hasher", real_hasher)
    assert verify_file(path)["epoch"] == 2


def test_verify_file_tampered_record_is_corrupt_error(tmp_path) -> None:
    """A tampered integrity record whose 'hash' is not an object (or names an unknown
    algorithm) makes verify_file raise AttributeError / ValueError. Expected:
    CorruptCheckpointError, as for any other unreadable record."""
    model = make_model()
    path = tmp_path / "m.weights.h5"
    files.write(files.snapshot(model, str(path), True), str(path), {})
    import json
    rec = Path(str(path) + ".pitstop")
    body = json.loads(rec.read_text())
    for bad in ("deadbeef", {"algorithm": "md5-nope", "digest": "00"}):
        body["hash"] = bad
        rec.write_text(json.dumps(body))
        with pytest.raises(pitstop.CorruptCheckpointError):
            verify_file(path)


# ============================================================ side-by-side differential


def _norm(text: str, d: Path) -> str:
    return text.replace(str(d), "D")


def _compare(tmp_path, name, fit_kwargs=None, model_fn=make_model, **kw):
    ck, ek, mk, dk = side_by_side(tmp_path, keras.callbacks.ModelCheckpoint, name, fit_kwargs,
                                  model_fn, **kw)
    cp, ep, mp, dp = side_by_side(tmp_path, ModelCheckpoint, name, fit_kwargs, model_fn, **kw)
    assert (type(ek), _norm(str(ek), dk)) == (type(ep), _norm(str(ep), dp))
    assert _norm(ck.out.getvalue(), dk) == _norm(cp.out.getvalue(), dp)
    ours = [w for w in cp.warnings if "pitstop" not in w and "computed only" not in w]
    assert sorted(_norm(w, dk) for w in ck.warnings) == sorted(_norm(w, dp) for w in ours)
    assert listing(dk) == listing(dp)
    for rel in listing(dk):
        assert _content(dk / rel) == _content(dp / rel), rel
    for rel in listing(dp):
        verify_file(dp / rel)
    return dk, dp


def _unnumber(x):
    """Layer / optimizer names are numbered per process (dense_3): strip the numbers."""
    import re
    if isinstance(x, bytes):
        x = re.sub(rb'"shared_object_id": \d+', b"", x)
        return re.sub(rb"_\d+(?=\b|_)", b"", x)
    if isinstance(x, str):
        return re.sub(r"_\d+(?=\b|_)", "", x)
    if isinstance(x, dict):
        return {_unnumber(k): _unnumber(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(_unnumber(v) if not isinstance(v, bytes) else v for v in x)
    return x


def _content(path: Path):
    if path.name.endswith(".keras"):
        return _unnumber(keras_tree(path))
    if path.name.endswith(".h5"):
        return _unnumber(h5_tree(path))
    return path.read_bytes()


VAL = {"validation_data": (data(8)[0], data(8)[1])}


@on_backends("tensorflow", "torch")
@pytest.mark.parametrize("case", [
    dict(name="m.keras", verbose=1),
    dict(name="w{epoch}.weights.h5", verbose=1, save_weights_only=True, save_freq=3),
    dict(name="best.keras", verbose=1, save_best_only=True, fit=VAL),
    dict(name="best.keras", verbose=1, save_best_only=True, monitor="loss", mode="max",
         initial_value_threshold=1e9),
    dict(name="sub/dir/{epoch:02d}-{val_loss:.2f}.keras", verbose=1, fit=VAL, path=True),
    dict(name="e{epoch}-b{batch}.keras", verbose=1, save_freq=3),
    dict(name="b.keras", verbose=1, save_best_only=True, monitor="val_nope", fit=VAL),
    dict(name="{nope}.keras", verbose=1),
    dict(name="legacy.h5", verbose=1),
    dict(name="best.weights.h5", verbose=1, save_best_only=True, save_freq=4, monitor="loss",
         mode="min", save_weights_only=True),
], ids=lambda c: c["name"] + ("-best" if c.get("save_best_only") else ""))
def test_side_by_side(tmp_path, case, monkeypatch) -> None:
    from keras.src.utils import io_utils  # works around the verbose crash (own test below)

    monkeypatch.setattr(keras.utils, "io_utils", io_utils, raising=False)
    case = dict(case)
    name, fit, as_path = case.pop("name"), case.pop("fit", None), case.pop("path", False)
    if as_path:
        name = Path(name)
    _compare(tmp_path, name, fit, **case)


def test_verbose_messages_do_not_crash_fit(tmp_path) -> None:
    """verbose=1 is a Keras argument: Keras's callback prints 'Epoch 1: saving model to ...'
    and 'Epoch 1: finished saving model to ...'. pitstop's _save_model prints the second
    through keras.utils.io_utils.print_msg, which the public keras.utils namespace does not
    have (Keras 3: keras.src.utils.io_utils): fit() dies with AttributeError at the first
    save, after the save was requested. Expected: the same output as Keras's callback."""
    model, (x, y) = make_model(), data()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                  callbacks=[ModelCheckpoint(str(tmp_path / "m.keras"), verbose=1)])
    assert "Epoch 1: saving model to" in out.getvalue()
    assert "Epoch 1: finished saving model to" in out.getvalue()


# ============================================================ models with more than variables


class Counter(keras.layers.Layer):
    """A layer with non-variable state it saves itself (save_own_variables)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.count = 0

    def call(self, x):
        return x

    def save_own_variables(self, store):
        store["count"] = np.array(self.count)

    def load_own_variables(self, store):
        self.count = int(store["count"][()])


class Net(keras.Model):
    def __init__(self, units=8, **kw):
        super().__init__(**kw)
        self.units = units
        self.d1 = keras.layers.Dense(units, activation="relu")
        self.d2 = keras.layers.Dense(1)

    def call(self, x):
        return self.d2(self.d1(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def _assets_model():
    keras.utils.set_random_seed(1)
    inp = keras.Input((4,))
    norm = keras.layers.Normalization()
    norm.adapt(data()[0])
    h = norm(inp)
    out = keras.layers.Dense(1)(keras.layers.Dense(8, activation="relu")(h))
    model = keras.Model(inp, out)
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    return model


def _mixed_model():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        return make_model()
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _bf16_model():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, dtype="bfloat16"),
                              keras.layers.Dense(1, dtype="float32")])
    model.compile(keras.optimizers.SGD(1e-2), "mse")
    return model


def _subclassed():
    keras.utils.set_random_seed(1)
    model = Net(8)
    model(np.zeros((1, 4), "float32"))
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    return model


def _counter_model():
    keras.utils.set_random_seed(1)
    c = Counter()
    c.count = 41
    model = keras.Sequential([keras.Input((4,)), c, keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(1e-2), "mse")
    return model


@on_backends("tensorflow", "torch")
@pytest.mark.parametrize("model_fn", [_assets_model, _mixed_model, _bf16_model, _subclassed,
                                      _counter_model],
                         ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("name", ["m{epoch}.keras", "m{epoch}.weights.h5"])
def test_side_by_side_models(tmp_path, model_fn, name) -> None:
    kw = {"save_weights_only": name.endswith(".weights.h5")}
    dk, dp = _compare(tmp_path, name, {"epochs": 2}, model_fn, **kw)
    custom = {"Net": Net, "Counter": Counter}
    x = data(8)[0]

    def load(d):
        path = d / name.format(epoch=2)
        if name.endswith(".weights.h5"):
            m = model_fn()
            m.load_weights(path)
            return m
        return keras.models.load_model(path, custom_objects=custom,
                                       compile=name.endswith(".keras"))

    def outcome(d):
        try:
            return keras.ops.convert_to_numpy(load(d).predict(x, verbose=0))
        except Exception as e:  # noqa: BLE001
            return type(e).__name__

    a, b = outcome(dk), outcome(dp)
    if isinstance(a, str) or isinstance(b, str):
        assert a == b
    else:
        np.testing.assert_array_equal(a, b)


def test_files_hold_snapshot_time_state_while_training_goes_on(tmp_path, monkeypatch) -> None:
    """Each write is held back until training has run two more batches (and a callback has
    changed the non-variable state a layer saves itself); every file must still equal what
    Keras's synchronous callback wrote at the same batch in the same fit."""
    model = _counter_model()
    counter = model.layers[0]
    real = files.write
    gate = threading.Semaphore(0)

    def held(snap, filepath, info=None):
        assert gate.acquire(timeout=30)
        real(snap, filepath, info)

    monkeypatch.setattr(files, "write", held)

    class Bump(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            counter.count += 1
            gate.release()

    x, y = data()
    theirs = keras.callbacks.ModelCheckpoint(str(tmp_path / "k{epoch}-{batch}.keras"),
                                             save_freq=2)
    ours = ModelCheckpoint(str(tmp_path / "p{epoch}-{batch}.keras"), save_freq=2)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[theirs, ours, Bump()])
    ks = sorted(tmp_path.glob("k*.keras"))
    assert len(ks) == 4
    for k in ks:
        p = tmp_path / ("p" + k.name[1:])
        assert _content(k) == _content(p), p.name
        verify_file(p)


# ============================================================ the adapter


def test_restore_mismatch_in_one_entry_changes_no_other_entry(tmp_path) -> None:
    """Two models in one state; the second does not match: nothing at all is written, the
    first (matching) model included."""
    a, b = make_model(1), make_model(2)
    mgr = pitstop.CheckpointManager(str(tmp_path / "c"))
    mgr.save(1, {"a": a, "b": b})
    mgr.wait()
    a2 = make_model(3)
    b2 = keras.Sequential([keras.Input((4,)), keras.layers.Dense(9), keras.layers.Dense(1)])
    before = weights_of(a2), weights_of(b2)
    with pytest.raises(pitstop.IncompatibleTargetError):
        mgr.restore({"a": a2, "b": b2})
    for x1, x2 in zip(weights_of(a2) + weights_of(b2), before[0] + before[1], strict=True):
        np.testing.assert_array_equal(x1, x2)
    mgr.close()


def test_metric_with_other_variables_is_refused(tmp_path) -> None:
    m = keras.metrics.Mean()
    m.update_state([1.0, 3.0])
    mgr = pitstop.CheckpointManager(str(tmp_path / "c"))
    mgr.save(1, {"m": m})
    mgr.wait()
    with pytest.raises(pitstop.IncompatibleTargetError):
        mgr.restore({"m": keras.metrics.Sum()})
    with pytest.raises(pitstop.IncompatibleTargetError):
        mgr.restore({"m": keras.Variable(np.zeros(3, "float32"))})
    mgr.close()


def test_keep_last_with_a_fixed_filename_keeps_the_file(tmp_path) -> None:
    model, (x, y) = make_model(), data()
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, validation_data=(x[:8], y[:8]),
              callbacks=[ModelCheckpoint(tmp_path / "new" / "m.keras", keep_last=1,
                                         save_best_only=True)])
    assert sorted(os.listdir(tmp_path / "new")) == ["m.keras", "m.keras.pitstop"]
    verify_file(tmp_path / "new" / "m.keras")
    keras.models.load_model(tmp_path / "new" / "m.keras")


def test_restore_into_a_functional_model_of_another_architecture_is_refused(tmp_path) -> None:
    """A checkpoint of a Sequential model restored into a Functional model of another
    architecture (Dense(9) where the checkpoint has Dense(8)). On jax/torch: an
    IncompatibleTargetError naming the variable. On the tensorflow backend (Keras objects go
    through the TF adapter) restore() returns the step as if it had worked, raises nothing,
    and restores not a single variable. Expected: the error, nothing changed, on every
    backend (a silent no-op restore resumes training from random weights)."""
    mgr = pitstop.CheckpointManager(str(tmp_path / "c"))
    mgr.save(1, {"model": make_model(1)})
    mgr.wait()
    inp = keras.Input((4,))
    other = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Dense(9)(inp)))
    before = weights_of(other)
    try:
        with pytest.raises(pitstop.IncompatibleTargetError):
            mgr.restore({"model": other})
    finally:
        mgr.close()
    for a, b in zip(weights_of(other), before, strict=True):
        np.testing.assert_array_equal(a, b)
