"""TensorFlow objects in a pitstop state: captured as tf.train.Checkpoint's object graph,
keyed as TensorFlow keys it, restored by TensorFlow's matching rules."""

from __future__ import annotations

import numpy as np
import pytest

import pitstop

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import leaf_keys, make_model, same, train_step, values  # noqa: E402

from pitstop.adapters.tf import _graph  # noqa: E402

DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.uint8, tf.int16,
          tf.int32, tf.int64, tf.uint32, tf.uint64, tf.bool, tf.complex64, tf.complex128]


def test_variables_of_every_dtype_round_trip(manager):
    rng = np.random.default_rng(0)
    live = {}
    for dt in DTYPES:
        a = rng.normal(size=(3, 5)) * 50
        live[dt.name] = tf.Variable(tf.cast(tf.constant(a), dt) if dt != tf.bool else a > 0)
    want = {k: v.numpy().copy() for k, v in live.items()}
    m = manager()
    m.save(1, {"vars": live, "module": tf.Module()})
    for v in live.values():
        v.assign(tf.zeros_like(v))
    assert m.restore({"vars": live, "module": tf.Module()}) == 1
    for k, v in live.items():
        assert v.dtype.name == k and v.numpy().tobytes() == want[k].tobytes(), k
    loaded = m.load(1)["vars"]
    assert loaded["bfloat16"].dtype.name == "bfloat16"


def test_keys_are_the_ones_tf_train_checkpoint_writes(tmp_path):
    model, opt = make_model(0), keras.optimizers.Adam(1e-2)
    train_step(model, opt)
    ck = tf.train.Checkpoint(model=model, opt=opt, gen=tf.random.Generator.from_seed(1),
                             step=tf.Variable(3, dtype=tf.int64),
                             data=iter(tf.data.Dataset.range(9).shuffle(9, seed=1)))
    path = ck.write(str(tmp_path / "tf" / "ckpt"))
    theirs = set(tf.train.load_checkpoint(path).get_variable_to_shape_map())
    theirs.discard("_CHECKPOINTABLE_OBJECT_GRAPH")
    ours = set(leaf_keys(_graph.capture(ck)))
    # pitstop also keeps the Keras dropout layer's seed state, which tf.train leaves out
    extra = {k for k in ours - theirs if ".seed_generator_" in k}
    assert ours - extra == theirs and extra


def test_keras_model_optimizer_generator_and_data_resume_exactly(manager):
    model, opt = make_model(0), keras.optimizers.Adam(1e-2)
    gen = tf.random.Generator.from_seed(1)
    data = iter(tf.data.Dataset.range(1000).shuffle(100, seed=2).repeat())
    for _ in range(3):
        train_step(model, opt), next(data), gen.normal([2])
    m = manager()
    m.save(3, {"model": model, "opt": opt, "gen": gen, "data": data})
    ref = [(train_step(model, opt), int(next(data)), gen.normal([2]).numpy().tobytes())
           for _ in range(4)]
    ref_vars = values(model.variables) + values(opt.variables)

    model2, opt2 = make_model(9), keras.optimizers.Adam(1e-2)
    gen2 = tf.random.Generator.from_seed(77)
    data2 = iter(tf.data.Dataset.range(1000).shuffle(100, seed=2).repeat())
    assert m.restore({"model": model2, "opt": opt2, "gen": gen2, "data": data2}) == 3
    got = [(train_step(model2, opt2), int(next(data2)), gen2.normal([2]).numpy().tobytes())
           for _ in range(4)]
    assert got == ref
    assert same(values(model2.variables) + values(opt2.variables), ref_vars)


def test_objects_created_after_the_restore_get_their_values(manager):
    """tf.train's deferred restoration: a model and an optimizer not built yet at restore
    time take the checkpoint's values when they create their variables."""
    model, opt = make_model(0, dropout=False), keras.optimizers.Adam(1e-2)
    for _ in range(2):
        train_step(model, opt)
    m = manager()
    m.save(2, {"model": model, "opt": opt})
    ref = [train_step(model, opt) for _ in range(3)]

    model2, opt2 = make_model(5, build=False, dropout=False), keras.optimizers.Adam(1e-2)
    assert not model2.built and not opt2.built
    assert m.restore({"model": model2, "opt": opt2}) == 2
    assert [train_step(model2, opt2) for _ in range(3)] == ref
    assert same(values(model2.variables), values(model.variables))
    assert int(opt2.iterations.numpy()) == 5


def test_a_renamed_attribute_is_not_restored_as_in_tf(manager, tmp_path):
    """Matching is by the object graph's local names, as tf.train.Checkpoint matches: the
    same scenario through tf.train and through pitstop leaves the same values."""
    def module(name):
        mod = tf.Module()
        setattr(mod, name, tf.Variable([1.0, 2.0]))
        mod.keep = tf.Variable([5.0])
        return mod

    saved = module("w")
    m = manager()
    m.save(1, {"m": saved})
    tf_path = tf.train.Checkpoint(m=saved).write(str(tmp_path / "tf" / "c"))

    ours, theirs = module("renamed"), module("renamed")
    for mod in (ours, theirs):
        mod.renamed.assign([0.0, 0.0])
        mod.keep.assign([0.0])
    with pytest.warns(UserWarning, match=r"found no object of that name \(w\).*\(renamed\)"):
        m.restore({"m": ours})  # tf.train says nothing until assert_consumed(); pitstop warns
    tf.train.Checkpoint(m=theirs).read(tf_path).expect_partial()
    assert ours.renamed.numpy().tolist() == theirs.renamed.numpy().tolist() == [0.0, 0.0]
    assert ours.keep.numpy().tolist() == theirs.keep.numpy().tolist() == [5.0]


def test_a_shape_mismatch_is_refused_before_anything_changes(manager):
    saved = tf.Module()
    saved.a, saved.b = tf.Variable([1.0, 2.0]), tf.Variable([[1.0, 2.0]])
    m = manager()
    m.save(1, {"m": saved})
    live = tf.Module()
    live.a, live.b = tf.Variable([7.0, 7.0]), tf.Variable([[7.0, 7.0, 7.0]])
    with pytest.raises(pitstop.IncompatibleTargetError, match=r"b/\.ATTRIBUTES/VARIABLE_VALUE"):
        m.restore({"m": live})
    assert live.a.numpy().tolist() == [7.0, 7.0]  # nothing was changed


def test_a_dtype_mismatch_is_refused(manager):
    m = manager()
    mod = tf.Module()
    mod.v = tf.Variable([1.0, 2.0])
    m.save(1, {"m": mod})
    live = tf.Module()
    live.v, live.extra = tf.Variable([1, 2], dtype=tf.int32), tf.Variable(0.0)
    with pytest.raises(pitstop.IncompatibleTargetError, match="dtype"):
        m.restore({"m": live})


def test_a_variable_in_the_state_is_restored_in_place(manager):
    v = tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3))
    kv = keras.Variable(np.ones(4, np.float32))
    m = manager()
    m.save(1, {"v": v, "kv": kv})
    v.assign(tf.zeros_like(v))
    kv.assign(np.zeros(4, np.float32))
    m.restore({"v": v, "kv": kv})
    assert v.numpy().ravel().tolist() == list(range(6)) and kv.numpy().tolist() == [1.0] * 4


def test_the_snapshot_is_the_value_at_save_time(manager):
    """A save's snapshot is taken in save(); assigning afterwards (while the background
    write runs) does not leak into the checkpoint."""
    v = tf.Variable(np.full(1 << 20, 1.0, np.float32))
    m = manager(async_save=True)
    h = m.save(1, {"v": v})
    v.assign_add(tf.ones_like(v))
    h.wait()
    assert (m.load(1)["v"] == 1.0).all()


def test_a_tf_tensor_is_refused_with_the_fix(manager):
    with pytest.raises(pitstop.UnsupportedStateError, match="tf.Variable"):
        manager().save(1, {"t": tf.constant([1.0])})


def test_an_iterator_with_external_state_is_refused_with_the_fix(manager):
    ds = tf.data.Dataset.range(10).map(
        lambda x: tf.py_function(lambda y: y, [x], tf.int64))
    it = iter(ds)
    next(it)
    with pytest.raises(pitstop.UnsupportedStateError, match="external state"):
        manager().save(1, {"data": it})


def test_pitstop_rng_keeps_tensorflows_global_generator(manager):
    tf.random.set_global_generator(tf.random.Generator.from_seed(5))
    tf.random.get_global_generator().normal([3])
    m = manager()
    m.save(1, {"rng": pitstop.RNG()})
    want = tf.random.get_global_generator().normal([3]).numpy()
    tf.random.get_global_generator().normal([10])
    m.restore({"rng": pitstop.RNG()})
    assert tf.random.get_global_generator().normal([3]).numpy().tobytes() == want.tobytes()


class _ListNet(keras.Model):
    """Layers kept in a list attribute: Keras tracks them, TensorFlow's graph does not."""

    def __init__(self) -> None:
        super().__init__()
        self.stack = [keras.layers.Dense(6), keras.layers.BatchNormalization(),
                      keras.layers.Dropout(0.3), keras.layers.Dense(1)]

    def call(self, x, training=False):
        for layer in self.stack:
            x = layer(x, training=training)
        return x


def _list_net(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    net = _ListNet()
    net(np.zeros((1, 4), np.float32))
    return net


def test_layers_in_a_list_attribute_are_saved_whole(manager, tmp_path):
    """tf.train.Checkpoint saves none of a list-held layer's variables (here: BatchNorm's
    moving statistics and the dropout seed stay at their initial values, silently); pitstop
    adds what TensorFlow's graph does not reach, and keeps every key tf.train writes."""
    net = _list_net(0)
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    for _ in range(3):
        net(x, training=True)
    want = values(net.variables)
    m = manager()
    m.save(1, {"net": net})
    other = _list_net(7)
    assert m.restore({"net": other}) == 1
    assert same(values(other.variables), want)
    # the differential: tf.train restores less, without a word
    path = tf.train.Checkpoint(net=net).write(str(tmp_path / "tf" / "c"))
    theirs = _list_net(7)
    tf.train.Checkpoint(net=theirs).read(path)
    assert not same(values(theirs.variables), want)
    # every key tf.train writes is one pitstop writes too
    tf_keys = set(tf.train.load_checkpoint(path).get_variable_to_shape_map())
    tf_keys.discard("_CHECKPOINTABLE_OBJECT_GRAPH")
    ours = set(leaf_keys(_graph.capture(tf.train.Checkpoint(net=net))))
    assert tf_keys <= ours and any(".keras_layer_" in k for k in ours - tf_keys)
