"""What probing the capture and restore of TensorFlow objects as a demanding user found."""

from __future__ import annotations

import glob
import os
import warnings

import numpy as np
import pytest

import pitstop

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from pitstop.adapters.tf import Checkpoint  # noqa: E402
from pitstop.interop.tf_native import read_native  # noqa: E402

X = tf.random.stateless_normal((8, 4), seed=(1, 2))
Y = tf.random.stateless_normal((8, 1), seed=(1, 3))


def _compiled(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inp = keras.Input((4,))
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Dense(8)(inp)))
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    return model


def test_an_optimizer_built_inside_fit_gets_its_deferred_values(manager):
    # Keras builds the optimizer while fit's train function is traced: the deferred values
    # must go in eagerly then (as tf.train does), not as assign ops of the traced graph
    model = _compiled(0)
    model.fit(X, Y, epochs=2, batch_size=4, verbose=0, shuffle=False)
    m = manager()
    m.save(2, {"model": model})
    want = model.fit(X, Y, epochs=1, batch_size=4, verbose=0, shuffle=False).history["loss"]
    want_vars = [v.numpy().copy() for v in model.optimizer.variables]

    again = _compiled(1)
    assert not again.optimizer.built
    assert m.restore({"model": again}) == 2
    got = again.fit(X, Y, epochs=1, batch_size=4, verbose=0, shuffle=False).history["loss"]
    assert got == want
    assert all(a.tobytes() == b.numpy().tobytes()
               for a, b in zip(want_vars, again.optimizer.variables, strict=True))


def _native(tmp_path, name: str) -> str:
    mod = tf.Module()
    mod.w = tf.Variable(tf.range(100.0))
    return tf.train.Checkpoint(mod=mod).write(str(tmp_path / name / "ckpt"))


@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped"])
def test_a_damaged_native_checkpoint_is_a_corrupt_checkpoint_error(tmp_path, damage):
    prefix = _native(tmp_path, damage)
    (data,) = glob.glob(prefix + ".data-*")
    raw = bytearray(open(data, "rb").read())
    if damage == "missing":
        os.remove(data)
    elif damage == "truncated":
        open(data, "wb").write(bytes(raw[: len(raw) // 2]))
    else:
        raw[200] ^= 0xFF
        open(data, "wb").write(bytes(raw))
    with pytest.raises(pitstop.CorruptCheckpointError) as e:
        read_native(prefix)
    assert e.value.__cause__ is not None and prefix in str(e.value)
    mod = tf.Module()
    mod.w = tf.Variable(tf.zeros([100]))
    with pytest.raises(pitstop.CorruptCheckpointError):
        Checkpoint(mod=mod).restore(prefix)
    assert not mod.w.numpy().any()


def test_variables_of_undefined_shape_are_saved_as_what_they_hold(manager):
    bare = tf.Variable([1.0, 2.0], shape=tf.TensorShape(None))
    mod = tf.Module()
    mod.v = tf.Variable([[1, 2, 3]], shape=tf.TensorShape([None, 3]))
    m = manager()
    m.save(1, {"bare": bare, "mod": mod})
    bare.assign([0.0, 0.0, 0.0, 0.0])
    mod.v.assign(tf.zeros([5, 3], tf.int32))
    assert m.restore({"bare": bare, "mod": mod}) == 1
    assert bare.numpy().tolist() == [1.0, 2.0]
    assert mod.v.numpy().tolist() == [[1, 2, 3]]


def test_a_bare_variable_of_another_shape_is_refused_with_nothing_changed(manager):
    m = manager()
    m.save(1, {"v": tf.Variable([1.0, 2.0]), "w": tf.Variable(3.0)})
    v, w = tf.Variable([5.0, 6.0, 7.0]), tf.Variable(9.0)
    # (a variable of undefined shape takes any shape; one of a defined shape does not)
    with pytest.raises(pitstop.IncompatibleTargetError, match="'v'"):
        m.restore({"v": v, "w": w})
    assert v.numpy().tolist() == [5.0, 6.0, 7.0] and float(w) == 9.0
    with pytest.raises(pitstop.IncompatibleTargetError, match="'v'"):
        m.restore({"v": tf.Variable([1, 2]), "w": w})
    assert float(w) == 9.0


@pytest.mark.parametrize("name", ["qint8", "quint8", "qint32"])
def test_quantized_variables_round_trip(manager, name):
    dtype = tf.dtypes.as_dtype(name)
    saved = np.array([[1, 2], [3, 4]], dtype=dtype.as_numpy_dtype)
    v = tf.Variable(saved)
    mod = tf.Module()
    mod.v = tf.Variable(saved)
    zero = tf.Variable(np.zeros_like(saved))
    m = manager()
    m.save(1, {"v": v, "mod": mod})
    v.assign(zero)
    mod.v.assign(zero)
    assert m.restore({"v": v, "mod": mod}) == 1
    assert v.dtype == dtype and v.numpy().tolist() == [[1, 2], [3, 4]]
    assert mod.v.numpy().tolist() == [[1, 2], [3, 4]]


def test_string_variables_in_a_module_round_trip_and_a_bare_one_says_where(manager):
    mod = tf.Module()
    mod.vocab = tf.Variable(["a", "bc"])
    mod.n = tf.Variable(2)
    m = manager()
    m.save(1, {"mod": mod})
    mod.vocab.assign(["x", "y"])
    assert m.restore({"mod": mod}) == 1
    assert mod.vocab.numpy().tolist() == [b"a", b"bc"]
    other = tf.Module()
    other.vocab = tf.Variable([1.0, 2.0])
    other.n = tf.Variable(0)
    with pytest.raises(pitstop.IncompatibleTargetError, match="string"):
        m.restore({"mod": other})
    assert other.vocab.numpy().tolist() == [1.0, 2.0] and int(other.n) == 0
    with pytest.raises(pitstop.UnsupportedStateError, match="tf.Module"):
        m.save(2, {"vocab": tf.Variable(["a"])})


class _Net(keras.Model):
    def __init__(self, first: str) -> None:
        super().__init__()
        self.first = first
        setattr(self, first, keras.layers.Dense(4))
        self.head = keras.layers.Dense(1)

    def build(self, shape):
        getattr(self, self.first).build(shape)
        self.head.build((shape[0], 4))

    def call(self, x):
        return self.head(getattr(self, self.first)(x))


def test_a_renamed_attribute_is_matched_as_tf_does_but_not_in_silence(manager):
    x = tf.ones((2, 3))
    saved = _Net("dense1")
    saved(x)
    m = manager()
    m.save(1, {"model": saved})
    renamed = _Net("fc1")
    renamed(x)
    kept = renamed.fc1.kernel.numpy().copy()
    with pytest.warns(UserWarning, match=r"dense1/_kernel.*fc1/_kernel"):
        assert m.restore({"model": renamed}) == 1
    assert renamed.fc1.kernel.numpy().tobytes() == kept.tobytes()  # as tf.train leaves it
    assert renamed.head.kernel.numpy().tobytes() == saved.head.kernel.numpy().tobytes()

    later = _Net("dense1")  # not built yet: its values wait for it, nothing to warn about
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert m.restore({"model": later}) == 1
    later(x)
    assert later.dense1.kernel.numpy().tobytes() == saved.dense1.kernel.numpy().tobytes()
