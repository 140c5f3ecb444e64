"""Adversarial probes of the JAX adapter: pytree node types, names, structure and strictness.

Every test states what a correct SDK does; a failing test is a defect."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import numpy as np
import pytest

import pitstop

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")
nnx = pytest.importorskip("flax.nnx")
linen = pytest.importorskip("flax.linen")
struct = pytest.importorskip("flax.struct")
train_state = pytest.importorskip("flax.training.train_state")
from flax.core import FrozenDict  # noqa: E402

# --- node types ---------------------------------------------------------------------------
from jax_helpers import assert_same_tree, bits, tree_bits  # noqa: E402


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w", "b"], meta_fields=[])
@dataclasses.dataclass
class LayerA:
    w: Any
    b: Any


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w", "b"], meta_fields=[])
@dataclasses.dataclass
class LayerB:
    w: Any
    b: Any


def test_restore_into_another_dataclass_type_with_the_same_fields_is_refused(manager):
    """The checkpoint holds a LayerA; a LayerB target is another type: a correct SDK says so
    instead of silently turning the checkpoint into a LayerB."""
    mgr = manager()
    mgr.save(0, {"layer": LayerA(jnp.ones(3), jnp.zeros(2))}).wait()
    target = LayerB(jnp.zeros(3), jnp.ones(2))
    state = {"layer": target}
    with pytest.raises(pitstop.IncompatibleTargetError):
        mgr.restore(state)
    assert state["layer"] is target


def test_restore_train_state_checkpoint_into_a_plain_dict_of_its_fields(manager):
    """A dict is the generic form of a node (what load() gives): it takes the node's fields
    and keeps its own type, as a plain tuple takes a namedtuple's items (docs/jax.md)."""
    p = {"w": jnp.ones((2, 2))}
    ts = train_state.TrainState.create(apply_fn=lambda *a: None, params=p, tx=optax.sgd(0.1))
    mgr = manager()
    mgr.save(0, {"ts": ts}).wait()
    target = {"step": 5, "params": {"w": jnp.zeros((2, 2))}, "opt_state": ts.opt_state}
    state = {"ts": target}
    mgr.restore(state)
    assert type(state["ts"]) is dict and state["ts"]["step"] == 0
    np.testing.assert_array_equal(state["ts"]["params"]["w"], p["w"])


class NT(NamedTuple):
    a: Any
    b: Any


def test_namedtuple_checkpoint_into_plain_tuple_keeps_the_target_type(manager):
    """Core containers: a tuple target is a tuple of the saved length: restored as a tuple."""
    mgr = manager()
    mgr.save(0, {"t": NT(jnp.ones(2), jnp.arange(3))}).wait()
    state = {"t": (jnp.zeros(2), jnp.zeros(3, jnp.int32))}
    assert mgr.restore(state) == 0
    assert type(state["t"]) is tuple
    assert bits(state["t"][0]) == bits(jnp.ones(2)) and bits(state["t"][1]) == bits(jnp.arange(3))


# --- names of children ----------------------------------------------------------------------

def test_frozendict_keys_whose_text_collides_are_not_silently_merged(manager):
    """FrozenDict keys (1, 2) and "(1, 2)" differ; the adapter names children by str(): a
    correct SDK refuses at save time or keeps both, never writes one value for both."""
    fd = FrozenDict({(1, 2): jnp.full(2, 1.0), "(1, 2)": jnp.full(2, 2.0)})
    mgr = manager()
    try:
        mgr.save(0, {"fd": fd}).wait()
    except pitstop.UnsupportedStateError as e:
        assert "fd" in str(e)
        return
    target = FrozenDict({(1, 2): jnp.zeros(2), "(1, 2)": jnp.zeros(2)})
    state = {"fd": target}
    mgr.restore(state)
    got = state["fd"]
    assert bits(got[(1, 2)]) == bits(jnp.full(2, 1.0)), got
    assert bits(got["(1, 2)"]) == bits(jnp.full(2, 2.0)), got


class DupKeys:
    """A pytree node (register_pytree_with_keys) whose two children have the same key."""

    def __init__(self, a, b):
        self.a, self.b = a, b


jax.tree_util.register_pytree_with_keys(
    DupKeys,
    lambda n: (((jax.tree_util.GetAttrKey("x"), n.a), (jax.tree_util.DictKey("x"), n.b)), None),
    lambda _aux, kids: DupKeys(*kids),
    flatten_func=lambda n: ((n.a, n.b), None),
)


def test_pytree_children_with_colliding_names_are_refused_or_kept_apart(manager):
    node = DupKeys(jnp.full(3, 1.0), jnp.full(3, 2.0))
    mgr = manager()
    try:
        mgr.save(0, {"n": node}).wait()
    except pitstop.UnsupportedStateError as e:
        assert "n" in str(e)
        return
    state = {"n": DupKeys(jnp.zeros(3), jnp.zeros(3))}
    mgr.restore(state)
    assert bits(state["n"].a) == bits(jnp.full(3, 1.0))
    assert bits(state["n"].b) == bits(jnp.full(3, 2.0))


def test_frozendict_int_and_str_key_of_same_text_refused_with_entry(manager):
    fd = FrozenDict({1: jnp.ones(2), "1": jnp.zeros(2)})
    mgr = manager()
    with pytest.raises(pitstop.UnsupportedStateError, match="fd"):
        mgr.save(0, {"fd": fd})


def test_frozendict_with_int_and_tuple_keys_round_trips(manager):
    fd = FrozenDict({0: jnp.ones(2), 7: {"k": jnp.arange(3)}})
    mgr = manager()
    mgr.save(0, {"fd": fd}).wait()
    state = {"fd": FrozenDict({0: jnp.zeros(2), 7: {"k": jnp.zeros(3, jnp.int32)}})}
    assert mgr.restore(state) == 0
    assert type(state["fd"]) is FrozenDict
    assert_same_tree(state["fd"], fd)


def test_plain_dict_with_a_tuple_key_beside_arrays_is_refused_with_entry(manager):
    mgr = manager()
    with pytest.raises(pitstop.UnsupportedStateError, match="by_pair"):
        mgr.save(0, {"by_pair": {(0, 1): jnp.ones(2)}})


# --- nodes without children -----------------------------------------------------------------

@struct.dataclass
class OnlyStatic:
    name: str = struct.field(pytree_node=False, default="cfg")


def test_a_pytree_node_with_no_children_can_be_saved_and_restored(manager):
    """A flax struct dataclass whose fields are all static has no leaves; it is a perfectly
    ordinary part of a train state (a config) and must not make the save fail."""
    mgr = manager()
    state = {"cfg": OnlyStatic(), "w": jnp.ones(2)}
    mgr.save(0, state).wait()
    target = {"cfg": OnlyStatic(), "w": jnp.zeros(2)}
    assert mgr.restore(target) == 0
    assert bits(target["w"]) == bits(jnp.ones(2))


# --- deep nesting ------------------------------------------------------------------------------

@struct.dataclass
class Outer:
    pair: Any
    meta: Any


def deep(v: float) -> dict:
    return {"outer": Outer(pair=(FrozenDict({"x": NT(jnp.full(2, v), [jnp.full(1, v + 1)])}),
                                 {"y": (jnp.full(3, v + 2, jnp.bfloat16),)}),
                           meta=LayerA(jnp.int32(int(v)), (jnp.full(1, v + 3),)))}


def test_nodes_inside_tuples_inside_dataclasses_inside_dicts_round_trip(manager):
    saved = deep(1.0)
    mgr = manager()
    mgr.save(0, saved).wait()
    state = deep(10.0)
    assert mgr.restore(state) == 0
    assert_same_tree(state, saved)
    assert type(state["outer"]) is Outer and type(state["outer"].pair[0]) is FrozenDict
    assert type(state["outer"].pair[0]["x"]) is NT
    new = mgr.load(target=deep(5.0))
    assert_same_tree(new, saved)


# --- strict=False ---------------------------------------------------------------------------

@functools.partial(jax.tree_util.register_dataclass, data_fields=["w", "b", "extra"],
                   meta_fields=[])
@dataclasses.dataclass
class LayerC:
    w: Any
    b: Any
    extra: Any


def test_strict_false_restores_what_matches_in_a_grown_dataclass(manager):
    mgr = manager()
    mgr.save(0, {"l": LayerA(jnp.full(3, 1.0), jnp.full(2, 2.0)), "gone": jnp.ones(4)}).wait()
    extra = jnp.full(5, 9.0)
    state = {"l": LayerC(jnp.zeros(3), jnp.zeros(2), extra), "new": jnp.zeros(1)}
    r = mgr.restore(state, strict=False)
    assert r == 0
    assert bits(state["l"].w) == bits(jnp.full(3, 1.0))
    assert bits(state["l"].b) == bits(jnp.full(2, 2.0))
    assert state["l"].extra is extra
    assert "l/extra" in r.missing_keys and "new" in r.missing_keys
    assert "gone" in r.unexpected_keys


def test_strict_false_with_a_mismatched_key_impl_leaves_the_key(manager):
    mgr = manager()
    mgr.save(0, {"k": jax.random.key(1, impl="rbg"), "w": jnp.ones(2)}).wait()
    k = jax.random.key(0)
    state = {"k": k, "w": jnp.zeros(2)}
    r = mgr.restore(state, strict=False)
    assert state["k"] is k
    assert bits(state["w"]) == bits(jnp.ones(2))
    assert "k" in r.mismatched_keys, (r.mismatched_keys, r.missing_keys, r.unexpected_keys)


def test_strict_false_with_a_mismatched_shape_leaves_that_array(manager):
    mgr = manager()
    mgr.save(0, {"a": jnp.ones(3), "b": jnp.ones(2)}).wait()
    a = jnp.zeros(4)
    state = {"a": a, "b": jnp.zeros(2)}
    r = mgr.restore(state, strict=False)
    assert state["a"] is a and bits(state["b"]) == bits(jnp.ones(2))
    assert r.mismatched_keys == ["a"]


# --- scalar leaves that jit turns into arrays -----------------------------------------------

class MLP(linen.Module):
    @linen.compact
    def __call__(self, x):
        return linen.Dense(2)(x)


X = jnp.linspace(-1, 1, 6, dtype=jnp.float32).reshape(2, 3)


def _fresh_ts(seed: int = 0):
    model = MLP()
    return train_state.TrainState.create(apply_fn=model.apply,
                                         params=model.init(jax.random.key(seed), X)["params"],
                                         tx=optax.adam(1e-2))


@jax.jit
def _jit_step(ts):
    grads = jax.tree.map(lambda p: jnp.cos(p), ts.params)
    return ts.apply_gradients(grads=grads)


def test_train_state_trained_under_jit_restores_into_a_fresh_train_state(manager):
    """The canonical Flax resume: the saved TrainState went through a jitted step (its
    ``step`` is now a jax.Array); the target is ``TrainState.create(...)`` (``step`` the int
    0). A resume must work and continue exactly as the saved state does."""
    ts = _jit_step(_jit_step(_fresh_ts()))
    assert isinstance(ts.step, jax.Array)
    mgr = manager()
    mgr.save(2, {"ts": ts}).wait()
    state = {"ts": _fresh_ts(seed=3)}
    assert mgr.restore(state) == 2
    a, b = _jit_step(ts), _jit_step(state["ts"])
    assert int(b.step) == int(a.step) == 3
    assert tree_bits(a.params) == tree_bits(b.params)


def test_fresh_train_state_checkpoint_restores_into_a_jitted_one(manager):
    ts = _fresh_ts()
    mgr = manager()
    mgr.save(0, {"ts": ts}).wait()
    target = _jit_step(_fresh_ts(seed=4))  # step is a jax.Array here
    state = {"ts": target}
    assert mgr.restore(state) == 0
    assert int(state["ts"].step) == 0
    assert tree_bits(state["ts"].params) == tree_bits(ts.params)


def test_a_python_float_hyperparameter_saved_restores_into_a_jax_scalar(manager):
    """A learning rate kept as a float in the saved run and as a 0-d array in the resumed
    one (or the other way round) -- what a jitted schedule update does to it."""
    mgr = manager()
    mgr.save(0, {"lr": 0.5, "w": jnp.ones(2)}).wait()
    state = {"lr": jnp.float32(0.1), "w": jnp.zeros(2)}
    try:
        mgr.restore(state)
    except pitstop.IncompatibleTargetError as e:
        # a refusal is fine if it says what differs and what to do
        assert "lr" in str(e) and "strict=False" in str(e)
        return
    assert float(state["lr"]) == 0.5
