"""What pitstop.adapters.tf captures is what it restores, beside tf.train's own Checkpoint:
a Keras layer's seed state (a plain SeedGenerator, outside tf.train's graph),
``tf.compat.v1.train`` optimizers' slot variables (outside every object's dependencies),
and ``write``/``read`` against ``save``/``restore`` for ``save_counter``."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import pitstop

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import X, Y, leaf_keys, same, values  # noqa: E402

from pitstop.adapters.tf import Checkpoint, CheckpointManager, _graph, _restore  # noqa: E402
from pitstop.adapters.tf._runs import read_tree  # noqa: E402


def native_keys(path):
    return set(tf.train.load_checkpoint(path).get_variable_to_shape_map()) - {
        "_CHECKPOINTABLE_OBJECT_GRAPH"}


# ------------------------------------------------------------------ Keras seed state
def dropout_model(kind, seed):
    """A small model with a Dropout layer: Sequential built or lazy, or Functional."""
    keras.utils.set_random_seed(0)
    if kind == "functional":
        x = keras.Input((3,))
        h = keras.layers.Dropout(0.5, seed=seed)(keras.layers.Dense(8, activation="relu")(x))
        return keras.Model(x, keras.layers.Dense(2)(h))
    model = keras.Sequential([keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dropout(0.5, seed=seed), keras.layers.Dense(2)])
    if kind == "built":
        model.build((None, 3))
    return model


def seed_state(model):
    (layer,) = [la for la in model.layers if isinstance(la, keras.layers.Dropout)]
    return layer.seed_generator.state.numpy().tolist()


def sgd_steps(model, opt, n):
    losses = []
    for _ in range(n):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(X, training=True) - Y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("kind", ["built", "lazy", "functional"])
def test_a_dropout_layers_seed_state_survives_two_restarts(tmp_path, kind):
    """A job killed twice and restarted (new objects each time, restored by
    restore_or_initialize, then by Checkpoint.restore) draws the masks an uninterrupted run
    draws: the same losses, and the seed state saved is the one restored."""
    for seed in (7, None):
        model, opt = dropout_model(kind, seed), keras.optimizers.SGD(0.1)
        ref = sgd_steps(model, opt, 9)
        d = tmp_path / f"{kind}-{seed}"
        got, saved = [], None
        for part in range(3):
            model, opt = dropout_model(kind, seed), keras.optimizers.SGD(0.1)
            ck = Checkpoint(model=model, opt=opt)
            mgr = CheckpointManager(ck, d, max_to_keep=2)
            if part == 1:
                assert mgr.restore_or_initialize() == str(d / "ckpt-1")
            elif part == 2:
                status = ck.restore(mgr.latest_checkpoint)
                # (a lazy model's layers get their values when it is built, at its first call)
                if kind == "lazy":
                    status.assert_existing_objects_matched()
                else:
                    status.assert_consumed()
            if saved is not None and kind != "lazy":
                assert seed_state(model) == saved, (kind, seed, part)  # e.g. [s, 3], not [s, 0]
            got += sgd_steps(model, opt, 3)
            saved = seed_state(model)
            mgr.save()
            mgr.close()
        assert got == ref, (kind, seed)


def test_seed_state_beside_tf_train(tmp_path):
    """The differential: one model saved by tf.train and by pitstop, then trained on
    (mutated), then restored into new models by each. Everything tf.train restores, pitstop
    restores alike; pitstop restores the seed state too, so its next losses are the
    uninterrupted run's (tf.train does not save a Keras 3 SeedGenerator: it is no
    Trackable). Changing the import on tf.train's own checkpoint restores what tf.train
    restores from it."""
    model, opt = dropout_model("built", 3), keras.optimizers.SGD(0.1)
    sgd_steps(model, opt, 3)
    saved_seed, saved_weights = seed_state(model), values(model.weights)
    native = tf.train.Checkpoint(model=model).write(str(tmp_path / "tf" / "ckpt"))
    ck = Checkpoint(model=model)
    ours = ck.write(str(tmp_path / "pitstop" / "ckpt"))
    ck.sync()
    ref = sgd_steps(model, opt, 3)  # the uninterrupted run; also mutates the model

    results = {}
    for name, Ckpt, path in [("tf.train", tf.train.Checkpoint, native),
                             ("pitstop", Checkpoint, ours),
                             ("pitstop on tf.train's", Checkpoint, native)]:
        other = dropout_model("built", 3)
        sgd_steps(other, keras.optimizers.SGD(0.1), 2)  # other weights, seed state [3, 2]
        status = Ckpt(model=other).read(path)
        status.assert_consumed()
        results[name] = (values(other.weights), seed_state(other),
                         sgd_steps(other, keras.optimizers.SGD(0.1), 3))
    tf_weights, tf_seed, tf_losses = results["tf.train"]
    weights, seed, losses = results["pitstop"]
    assert same(tf_weights, saved_weights) and same(weights, saved_weights)
    assert seed == saved_seed and losses == ref
    if tf_seed == saved_seed:  # a TensorFlow/Keras that saves it: then both agree
        assert tf_losses == ref
    else:
        assert tf_seed == [3, 2] and tf_losses != ref
    n_weights, n_seed, n_losses = results["pitstop on tf.train's"]
    assert same(n_weights, tf_weights) and n_seed == tf_seed and n_losses == tf_losses


def test_every_value_the_capture_saves_finds_its_object_on_restore(tmp_path):
    """The restore walks what the capture walked, trackable or not: every saved value goes
    back into the same-shaped objects (Keras seed generators, layers tf.train's graph does
    not reach, Keras and compat.v1 optimizer state, a generator)."""

    def build(seed):
        keras.utils.set_random_seed(seed)
        model = keras.Sequential([keras.layers.Dense(4), keras.layers.GaussianNoise(0.1),
                                  keras.layers.Dropout(0.2), keras.layers.BatchNormalization(),
                                  keras.layers.Dense(2)])
        model.build((None, 3))
        kopt = keras.optimizers.Adam(1e-2)
        v, v1 = tf.Variable(np.full(3, float(seed), np.float32)), \
            tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
        sgd_steps(model, kopt, seed % 3 + 1)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * v)
        v1.apply_gradients([(tape.gradient(loss, v), v)])
        gen = tf.random.Generator.from_seed(seed)
        gen.normal((seed % 3 + 1,))
        return tf.train.Checkpoint(model=model, kopt=kopt, v=v, v1=v1, gen=gen)

    src, dst = build(1), build(5)
    tree = _graph.capture(src)
    want = {k: np.array(leaf.variable.numpy()) if isinstance(leaf, _graph.VariableLeaf)
            else leaf for k, leaf in _flat(tree)}
    r = _restore.Restore(_numpy(tree))
    _restore.restore_into(dst, _numpy(tree), restore=r)
    assert _restore.unrestored(r.outcome, r.graph) == []
    got = dict(_flat(_graph.capture(dst)))
    assert set(got) == set(want)
    for k, leaf in got.items():
        have = leaf.variable.numpy() if isinstance(leaf, _graph.VariableLeaf) else leaf
        assert np.array_equal(np.asarray(have), want[k]), k


def _flat(tree, prefix=""):
    for k, v in tree.items():
        if k == _graph.GRAPH:
            continue
        p = f"{prefix}/{k}" if prefix else k
        if isinstance(v, dict):
            yield from _flat(v, p)
        else:
            yield p, v


def _numpy(tree):
    """The captured tree as a restore reads it back: arrays, not live variables."""
    return {k: (_numpy(v) if isinstance(v, dict) and k != _graph.GRAPH else
                np.array(v.variable.numpy()) if isinstance(v, _graph.VariableLeaf) else v)
            for k, v in tree.items()}


# ------------------------------------------------------------- optimizer slot variables
def v1_loop(opt_fn):
    v, w = tf.Variable([1.0, -2.0]), tf.Variable([[0.5], [1.5]])
    opt = opt_fn()

    def steps(n):
        out = []
        for _ in range(n):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(v * v * tf.constant([1.0, 3.0])) + tf.reduce_sum(w ** 4)
            opt.apply_gradients(zip(tape.gradient(loss, [v, w]), [v, w], strict=True))
            out.append(float(loss))
        return out
    return v, w, opt, steps


V1 = {"adam": lambda: tf.compat.v1.train.AdamOptimizer(0.1),
      "momentum": lambda: tf.compat.v1.train.MomentumOptimizer(0.1, 0.9),
      "rmsprop": lambda: tf.compat.v1.train.RMSPropOptimizer(0.1)}


@pytest.mark.parametrize("name", sorted(V1))
def test_compat_v1_optimizer_slots_are_saved_and_restored_as_tf_train(tmp_path, name):
    """The differential: the keys tf.train writes (Adam's m and v, a momentum's
    accumulator) are the keys pitstop writes; each restored into new objects (slots not
    created yet) gives the same slot values and the same next losses; pitstop on
    tf.train's own checkpoint too."""
    v, w, opt, steps = v1_loop(V1[name])
    steps(3)
    native = tf.train.Checkpoint(v=v, w=w, opt=opt).write(str(tmp_path / "tf" / "ckpt"))
    ck = Checkpoint(v=v, w=w, opt=opt)
    ours = ck.write(str(tmp_path / "pitstop" / "ckpt"))
    ck.sync()
    assert set(leaf_keys(read_tree(ours))) == native_keys(native)
    assert any("/.OPTIMIZER_SLOT/opt/" in k for k in native_keys(native))
    slots = {(s, i): opt.get_slot(x, s).numpy().tolist()
             for s in opt.get_slot_names() for i, x in enumerate([v, w])}
    ref = steps(3)

    results = {}
    for who, Ckpt, path in [("tf.train", tf.train.Checkpoint, native),
                            ("pitstop", Checkpoint, ours),
                            ("pitstop on tf.train's", Checkpoint, native)]:
        v2, w2, opt2, steps2 = v1_loop(V1[name])
        status = Ckpt(v=v2, w=w2, opt=opt2).read(path)
        got = {(s, i): None if opt2.get_slot(x, s) is None else
               opt2.get_slot(x, s).numpy().tolist()
               for s in opt.get_slot_names() for i, x in enumerate([v2, w2])}
        losses = steps2(3)
        status.assert_consumed()  # the optimizer's own variables exist now
        results[who] = (got, losses)
    assert results["tf.train"] == (slots, ref)
    assert results["pitstop"] == results["tf.train"]
    assert results["pitstop on tf.train's"] == results["tf.train"]


def test_the_saved_keys_are_tf_trains_for_keras_optimizers_and_modules(tmp_path):
    model = keras.Sequential([keras.layers.Dense(3)])
    model.build((None, 2))
    opt = keras.optimizers.Adam()
    opt.build(model.trainable_variables)
    module = tf.Module()
    module.a = tf.Variable(1.0)
    module.items = [tf.Variable([1, 2]), {"x": tf.Variable(3.0)}]
    for i, objects in enumerate([{"model": model, "opt": opt}, {"m": module}]):
        native = tf.train.Checkpoint(**objects).write(str(tmp_path / f"tf{i}" / "ckpt"))
        ck = Checkpoint(**objects)
        ours = ck.write(str(tmp_path / f"pitstop{i}" / "ckpt"))
        ck.sync()
        assert set(leaf_keys(read_tree(ours))) == native_keys(native)


def test_an_optimizers_slots_of_variables_it_is_saved_without_are_said_once(manager):
    """tf.train saves a slot only with its variable; pitstop says so (once, with the fix)
    when an optimizer is saved without its variables."""
    v, w, opt, steps = v1_loop(V1["adam"])
    steps(1)
    m = manager()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m.save(1, {"v": v, "w": w, "opt": opt})
        m.save(2, {"v": v, "w": w, "opt": opt})
        m.save(3, {"ck": tf.train.Checkpoint(v=v, w=w, opt=opt)})
    said = [str(c.message) for c in caught if "slot variable" in str(c.message)]
    assert len(said) == 1 and "4 slot variable(s)" in said[0] and "'opt'" in said[0]


def test_a_slot_variable_tracked_as_an_object_is_refused_naming_it(tmp_path):
    v, w, opt, steps = v1_loop(V1["momentum"])
    steps(1)
    ck = tf.train.Checkpoint(v=v, opt=opt, mine=opt.get_slot(v, "momentum"))
    with pytest.raises(NotImplementedError):
        ck.write(str(tmp_path / "tf" / "ckpt"))  # tf.train refuses it too
    with pytest.raises(pitstop.UnsupportedStateError, match=r"v/\.OPTIMIZER_SLOT/opt/momentum"):
        _graph.capture(ck)


# ------------------------------------------------------------------- write / read
def test_write_then_read_and_save_counter_as_tf_train(tmp_path):
    """tf.train's read() does not create save_counter, its restore() creates it after the
    read: read(write(p)).assert_consumed() passes, restore(write(p)) leaves the counter
    unrestored; a checkpoint written after a save holds the counter."""

    def outcomes(status):
        out = []
        for check in ("assert_consumed", "assert_existing_objects_matched",
                      "assert_nontrivial_match"):
            try:
                getattr(status, check)()
                out.append(True)
            except AssertionError:
                out.append(False)
        status.expect_partial()
        return out

    def scenario(Ckpt, d):
        log = []
        ck = Ckpt(v=tf.Variable(1.0))
        fresh = ck.write(str(d / "w"))
        counter = ck.save(str(d / "s"))
        after_save = ck.write(str(d / "w2"))
        if isinstance(ck, Checkpoint):
            ck.sync()
        for path in (fresh, after_save, counter):
            for how in ("read", "restore"):
                for counter_exists in (False, True):
                    ck2 = Ckpt(v=tf.Variable(0.0))
                    if counter_exists:
                        ck2.save_counter  # noqa: B018
                    status = getattr(ck2, how)(path)
                    inner = ck2.tf_checkpoint if isinstance(ck2, Checkpoint) else ck2
                    log.append((how, counter_exists, outcomes(status),
                                inner._save_counter is not None))
                    log.append(int(ck2.save_counter.numpy()))
        return log

    assert scenario(Checkpoint, tmp_path / "pitstop") == \
        scenario(tf.train.Checkpoint, tmp_path / "tf")
