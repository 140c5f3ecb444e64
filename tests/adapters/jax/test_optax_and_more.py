"""More adversarial probes of the JAX adapter: Optax masked / multi-transform states, Partial,
weak types on sharded arrays, numpy targets of sharded checkpoints, non-finite guard on
bfloat16, empty key arrays, TrainState subclasses. A failing test is a defect."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pitstop

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")
train_state = pytest.importorskip("flax.training.train_state")
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from jax_helpers import bits, tree_bits  # noqa: E402

DEV = jax.devices()


def _params(v=0.0):
    return {"enc": {"w": jnp.full((3, 2), 1.0 + v)}, "dec": {"w": jnp.full((2, 3), 2.0 + v),
                                                          "b": jnp.full(3, v)}}


def _run(tx, p, n):
    s = tx.init(p)
    for i in range(n):
        g = jax.tree.map(lambda x, i=i: jnp.sin(x + i), p)
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
    return p, s


TXS = {
    "masked": lambda: optax.masked(optax.adam(1e-2), {"enc": {"w": True},
                                                      "dec": {"w": False, "b": True}}),
    "multi_transform": lambda: optax.multi_transform(
        {"a": optax.adam(1e-2), "b": optax.sgd(1e-2, momentum=0.9)},
        {"enc": {"w": "a"}, "dec": {"w": "b", "b": "a"}}),
    "schedule_free": lambda: optax.contrib.schedule_free_adamw(1e-2),
    "lookahead_ema": lambda: optax.chain(optax.ema(0.9), optax.scale_by_adam()),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
}


@pytest.mark.parametrize("name", list(TXS))
def test_optax_state_round_trips_and_training_continues_identically(manager, name):
    tx = TXS[name]()
    p, s = _run(tx, _params(), 3)
    mgr = manager()
    mgr.save(0, {"p": p, "s": s}).wait()
    p2, s2 = _run(tx, _params(5.0), 1)
    state = {"p": p2, "s": s2}
    assert mgr.restore(state) == 0
    assert jax.tree.structure(state["s"]) == jax.tree.structure(s)
    assert tree_bits(state["s"]) == tree_bits(s)
    g = jax.tree.map(jnp.cos, p)
    ua, _ = tx.update(g, s, p)
    ub, _ = tx.update(g, state["s"], state["p"])
    assert tree_bits(ua) == tree_bits(ub)


def test_partial_in_state(manager):
    f = jax.tree_util.Partial(jnp.add, jnp.ones(2))
    mgr = manager()
    mgr.save(0, {"f": f}).wait()
    state = {"f": jax.tree_util.Partial(jnp.add, jnp.zeros(2))}
    assert mgr.restore(state) == 0
    assert bits(state["f"](jnp.zeros(2))) == bits(jnp.ones(2))


def test_weak_replicated_scalar_keeps_sharding_and_weak_type(manager):
    mesh = Mesh(np.array(DEV), ("x",))
    s = jax.device_put(jnp.asarray(2.0), NamedSharding(mesh, P()))
    assert s.weak_type
    mgr = manager()
    mgr.save(0, {"s": s}).wait()
    state = {"s": jax.device_put(jnp.asarray(0.0), NamedSharding(mesh, P()))}
    assert mgr.restore(state) == 0
    assert state["s"].weak_type and bits(state["s"]) == bits(s)
    assert state["s"].sharding.is_equivalent_to(s.sharding, 0)


def test_sharded_checkpoint_into_numpy_target_in_place(manager):
    mesh = Mesh(np.array(DEV).reshape(4, 2), ("x", "y"))
    x = jax.device_put(jnp.arange(64, dtype=jnp.float32).reshape(8, 8), NamedSharding(mesh, P("y", "x")))
    mgr = manager()
    mgr.save(0, {"x": x}).wait()
    arr = np.zeros((8, 8), np.float32)
    state = {"x": arr}
    assert mgr.restore(state) == 0
    assert state["x"] is arr and arr.tobytes() == np.asarray(x).tobytes()
    f = np.zeros((8, 8), np.float32, order="F")
    state = {"x": f}
    assert mgr.restore(state) == 0
    assert np.array_equal(f, np.asarray(x))


def test_nonfinite_guard_sees_a_nan_in_bf16_jax_params(manager):
    mgr = manager(nonfinite_guard=True)
    mgr.save(0, {"w": jnp.ones(4, jnp.bfloat16)}).wait()
    w = jnp.array([1.0, jnp.nan, 2.0, 3.0], jnp.bfloat16)
    h = mgr.save(1, {"w": w})
    try:
        h.wait()
    except pitstop.CheckpointError:
        pass
    state = {"w": jnp.zeros(4, jnp.bfloat16)}
    assert mgr.rollback(state) == 0
    assert bits(state["w"]) == bits(jnp.ones(4, jnp.bfloat16))


def test_empty_typed_key_array(manager):
    k = jax.random.split(jax.random.key(0, impl="rbg"), 0)
    assert k.shape == (0,)
    mgr = manager()
    mgr.save(0, {"k": k}).wait()
    state = {"k": jax.random.split(jax.random.key(1, impl="rbg"), 0)}
    assert mgr.restore(state) == 0
    assert state["k"].shape == (0,) and str(jax.random.key_impl(state["k"])) == \
        str(jax.random.key_impl(k))


class BNState(train_state.TrainState):
    batch_stats: Any = None
    ema: Any = None


def test_train_state_subclass_with_batch_stats_and_none_field(manager):
    ts = BNState.create(apply_fn=None, params=_params(), tx=optax.adam(1e-2),
                        batch_stats={"mean": jnp.full(3, 0.5)}, ema=None)
    ts = ts.apply_gradients(grads=jax.tree.map(jnp.cos, ts.params),
                            batch_stats={"mean": jnp.full(3, 0.7)})
    mgr = manager()
    mgr.save(0, {"ts": ts}).wait()
    fresh = BNState.create(apply_fn=None, params=_params(3.0), tx=optax.adam(1e-2),
                           batch_stats={"mean": jnp.zeros(3)}, ema=None)
    state = {"ts": fresh}
    assert mgr.restore(state) == 0
    assert type(state["ts"]) is BNState and state["ts"].ema is None
    assert state["ts"].step == 1
    assert tree_bits(state["ts"]) == tree_bits(ts)


def test_train_state_saved_with_none_restored_into_one_with_arrays_is_refused(manager):
    ts = BNState.create(apply_fn=None, params=_params(), tx=optax.sgd(1e-2), ema=None)
    mgr = manager()
    mgr.save(0, {"ts": ts}).wait()
    fresh = BNState.create(apply_fn=None, params=_params(), tx=optax.sgd(1e-2),
                           ema={"w": jnp.ones(2)})
    state = {"ts": fresh}
    with pytest.raises(pitstop.IncompatibleTargetError, match="ema"):
        mgr.restore(state)
    assert state["ts"] is fresh


def test_strict_false_missing_node_is_left_as_the_same_object(manager):
    mgr = manager()
    mgr.save(0, {"w": jnp.ones(2)}).wait()
    ts = train_state.TrainState.create(apply_fn=None, params=_params(), tx=optax.sgd(0.1))
    state = {"w": jnp.zeros(2), "ts": ts}
    r = mgr.restore(state, strict=False)
    assert state["ts"] is ts, "a node with nothing restored was replaced by a copy"
    assert any(k.startswith("ts") for k in r.missing_keys)


def test_mixed_int_and_str_keys_dict_of_jax_arrays(manager):
    saved = {0: jnp.ones(2), "a": jnp.full(2, 2.0), 7: {"x": jax.random.key(3)}}
    mgr = manager()
    mgr.save(0, {"d": saved}).wait()
    state = {"d": {0: jnp.zeros(2), "a": jnp.zeros(2), 7: {"x": jax.random.key(0)}}}
    assert mgr.restore(state) == 0
    for k in (0, "a"):
        assert bits(state["d"][k]) == bits(saved[k]), k
    assert bits(state["d"][7]["x"]) == bits(saved[7]["x"])
    loaded = mgr.load()
    assert set(loaded["d"]) == {0, "a", 7}
