"""Keras objects straight in pitstop.CheckpointManager's state (custom training loops), on
the backend of this process: models of every kind, optimizers, metrics, seed generators and
variables; an exact resume; and refusals that name the variable and change nothing."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import pitstop

BACKEND = keras.backend.backend()


def make(kind: str = "functional", seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    layers = [keras.layers.Dense(8, activation="relu"), keras.layers.BatchNormalization(),
              keras.layers.Dropout(0.3), keras.layers.Dense(1)]
    if kind == "sequential":
        model = keras.Sequential([keras.Input((4,)), *layers])
    elif kind == "functional":
        inp = keras.Input((4,))
        h = inp
        for layer in layers:
            h = layer(h)
        model = keras.Model(inp, h)
    else:
        class Net(keras.Model):
            def __init__(self) -> None:
                super().__init__()
                self.stack = layers

            def call(self, x, training=False):
                for layer in self.stack:
                    x = layer(x, training=training)
                return x
        model = Net()
        model(np.zeros((1, 4), "float32"))
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    return model


def values(variables) -> list[np.ndarray]:
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]


def batches(n: int):
    rs = np.random.RandomState(3)
    for _ in range(n):
        x = rs.randn(8, 4).astype("float32")
        yield x, x.sum(1, keepdims=True)


def state_of(model) -> dict:
    # the loss tracker too (train_on_batch's "loss" is its running mean), and the global
    # generators (on the torch backend, Dropout without a seed draws from torch's)
    return {"model": model, "optimizer": model.optimizer, "metrics": model.metrics,
            "rng": pitstop.RNG()}


def train(model, steps, mgr=None, start=0):
    losses = []
    for i, (x, y) in enumerate(steps):
        if i < start:
            continue
        losses.append(float(model.train_on_batch(x, y, return_dict=True)["loss"]))
        if mgr is not None:
            mgr.step(i, state_of(model))
    return losses


@pytest.mark.parametrize("kind", ["functional", "sequential", "subclassed"])
def test_custom_loop_resumes_exactly(manager, kind) -> None:
    full = make(kind)
    full_losses = train(full, batches(12))

    first = make(kind)
    mgr = manager(save_every_steps=5)
    train(first, list(batches(12))[:8], mgr)  # saved after step 5; stopped after step 7
    mgr.close()

    again = make(kind, seed=42)  # other initial weights, other dropout seeds
    again.optimizer.build(again.trainable_variables)
    mgr = manager()
    assert mgr.restore(state_of(again)) == 5
    resumed = train(again, batches(12), start=6)
    assert resumed == full_losses[6:]
    for a, b in zip(values(again.variables) + values(again.optimizer.variables),
                    values(full.variables) + values(full.optimizer.variables), strict=True):
        np.testing.assert_array_equal(a, b)


def test_metric_seed_generator_and_variable(manager) -> None:
    metric = keras.metrics.Mean()
    metric.update_state([1.0, 2.0, 6.0])
    gen = keras.random.SeedGenerator(7)
    keras.random.uniform((2,), seed=gen)
    var = keras.Variable(np.arange(6, dtype="float32").reshape(2, 3))
    draws_after = np.array(keras.ops.convert_to_numpy(keras.random.uniform((3,), seed=gen)))
    state = {"metric": metric, "gen": gen, "var": var}
    mgr = manager()
    # the state as it was before the draw above: rewind the generator by hand
    gen2 = keras.random.SeedGenerator(7)
    keras.random.uniform((2,), seed=gen2)
    mgr.save(1, {"metric": metric, "gen": gen2, "var": var})

    m2, g2 = keras.metrics.Mean(), keras.random.SeedGenerator(123)
    v2 = keras.Variable(np.zeros((2, 3), "float32"))
    assert mgr.restore({"metric": m2, "gen": g2, "var": v2}) == 1
    assert float(keras.ops.convert_to_numpy(m2.result())) == 3.0
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(v2),
                                  np.arange(6, dtype="float32").reshape(2, 3))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(keras.random.uniform((3,), seed=g2)),
                                  draws_after)
    assert state  # (the live objects were saved by reference, not copied)


def test_restore_into_another_architecture_names_the_variable(manager) -> None:
    model = make()
    mgr = manager()
    mgr.save(1, {"model": model})
    inp = keras.Input((4,))
    other = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Dense(9)(inp)))
    before = values(other.variables)
    with pytest.raises(pitstop.IncompatibleTargetError) as e:
        mgr.restore({"model": other})
    assert "dense" in str(e.value) or "model" in str(e.value)
    for a, b in zip(values(other.variables), before, strict=True):
        np.testing.assert_array_equal(a, b)  # nothing was written


@pytest.mark.skipif(BACKEND == "tensorflow",
                    reason="the TensorFlow adapter restores into an unbuilt optimizer later, "
                           "as tf.train does (deferred restoration)")
def test_unbuilt_optimizer_is_refused_with_what_to_do(manager) -> None:
    model = make()
    model.optimizer.build(model.trainable_variables)
    mgr = manager()
    mgr.save(1, {"optimizer": model.optimizer})
    fresh = keras.optimizers.Adam(1e-2)
    with pytest.raises(pitstop.IncompatibleTargetError, match="optimizer.build"):
        mgr.restore({"optimizer": fresh})


def test_bfloat16_variables_round_trip(manager) -> None:
    v = keras.Variable(np.linspace(-3, 3, 10).astype("float32"), dtype="bfloat16")
    mgr = manager()
    mgr.save(1, {"v": v})
    w = keras.Variable(np.zeros(10, "float32"), dtype="bfloat16")
    mgr.restore({"v": w})
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(keras.ops.cast(w, "float32")),
                                  keras.ops.convert_to_numpy(keras.ops.cast(v, "float32")))


@pytest.mark.skipif(BACKEND != "jax", reason="a Keras model next to JAX state: the jax backend")
def test_keras_model_optax_state_and_key_together_on_jax_backend(tmp_path) -> None:
    """One state holding a Keras model (JAX backend), an Optax optimizer state and a typed
    PRNG key: each goes to its adapter and comes back exactly. (Moved from tests/adapters/jax, where
    it ran in a process of its own: this run is that process.)"""
    import jax
    import jax.numpy as jnp
    optax = pytest.importorskip("optax")

    def model(seed: int) -> keras.Model:
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                                 keras.layers.Dense(1)])

    params = {"w": jnp.arange(4.0)}
    tx = optax.adam(1e-2)
    _, opt = tx.update({"w": jnp.ones(4)}, tx.init(params), params)
    m = model(0)
    state = {"model": m, "opt": opt, "key": jax.random.key(7)}
    with pitstop.CheckpointManager(tmp_path / "c", save_on_signals=None) as mgr:
        mgr.save(1, state).wait()
        m2 = model(1)
        fresh = {"model": m2, "opt": tx.init(params), "key": jax.random.key(0)}
        assert mgr.restore(fresh) == 1
    for a, b in zip(m.get_weights(), m2.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(opt), jax.tree.leaves(fresh["opt"]), strict=True):
        np.testing.assert_array_equal(a, b)
    assert type(fresh["opt"]) is type(opt)
    np.testing.assert_array_equal(jax.random.key_data(fresh["key"]),
                                  jax.random.key_data(state["key"]))
    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(np.asarray(m(x)), np.asarray(m2(x)))


def test_the_manifest_names_keras_and_its_backend(manager) -> None:
    """inspect's "written by": Keras and the backend that ran it, on every backend (on
    TensorFlow the model is captured as a trackable, which must not hide Keras)."""
    import json
    model = make("sequential")
    mgr = manager()
    mgr.save(1, {"model": model}).wait()
    with open(f"{mgr.directory}/step_0000000001/manifest.json") as f:
        doc = json.load(f)
    frameworks = doc["writer"]["frameworks"]
    assert frameworks["keras"] == keras.__version__, frameworks
    assert frameworks["keras.backend"] == BACKEND, frameworks
