"""JAX pytrees in a pitstop state: every kind of tree JAX, Flax and Optax programs keep
(jax.Array, numpy leaves, scalars, dicts / lists / tuples / namedtuples, registered
dataclasses and pytree classes, flax.struct dataclasses and TrainState, nnx.State, Optax
states, raw and typed PRNG keys of every impl) saved, then restored into a state with other
values: the restored trees are new objects of the same structure and types, bit for bit what
was saved, and the keys still work. ``load(target=...)`` with a live tree and with a tree of
``jax.ShapeDtypeStruct`` (placed as they say, sharding included), ``load()`` without a target
(numpy), and the refusals: another structure, shape, dtype or key impl raises
IncompatibleTargetError and changes nothing; a root that is itself a JAX array or pytree
node is refused with a pointer to ``load(target=...)``.
"""

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

from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

KEY_IMPLS = ["threefry2x32", "rbg", "unsafe_rbg"]


# --- the kinds of trees ---------------------------------------------------------------------

class Moments(NamedTuple):
    mu: Any
    nu: Any
    count: Any


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w", "b"],
                   meta_fields=["name"])
@dataclasses.dataclass
class Dense:
    w: Any
    b: Any
    name: str


@jax.tree_util.register_pytree_node_class
class Scaled:
    def __init__(self, value: Any, scale: Any, tag: str) -> None:
        self.value, self.scale, self.tag = value, scale, tag

    def tree_flatten(self):
        return (self.value, self.scale), self.tag

    @classmethod
    def tree_unflatten(cls, tag, children):
        return cls(*children, tag)


@struct.dataclass
class EMA:
    params: Any
    count: Any
    lr: float
    seen: int
    warm: bool
    scale: Any  # a numpy scalar
    decay: float = struct.field(pytree_node=False, default=0.99)


class MLP(linen.Module):
    @linen.compact
    def __call__(self, x):
        return linen.Dense(2)(linen.relu(linen.Dense(4)(x)))


class Tiny(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(3, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.bn(self.lin(x)))


MODEL = MLP()
TX = optax.adam(1e-2)
X = jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(2, 3)


def f32(*shape: int, start: float = 0.25) -> jax.Array:
    return jnp.arange(int(np.prod(shape)), dtype=jnp.float32).reshape(shape) / 7 + start


def params() -> dict[str, jax.Array]:
    return {"w": f32(3, 2), "b": f32(2, start=-1.0)}


def stepped(tx) -> Any:
    """``tx``'s state after two updates (moments and counts not at their initial values)."""
    p = params()
    s = tx.init(p)
    for i in range(2):
        g = jax.tree.map(lambda x, i=i: jnp.sin(x + i), p)
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
    return s


def trained_train_state() -> Any:
    p = MODEL.init(jax.random.key(0), X)["params"]
    ts = train_state.TrainState.create(apply_fn=MODEL.apply, params=p, tx=TX)
    return ts.apply_gradients(grads=jax.tree.map(lambda x: jnp.cos(x) + 1, p))


def nnx_state() -> Any:
    model = Tiny(nnx.Rngs(0, dropout=1))
    model(X)  # batch statistics and the dropout stream's count move on
    return nnx.state(model)


def dtypes() -> dict[str, Any]:
    nan_payload = jax.lax.bitcast_convert_type(jnp.uint32(0x7FC00001), jnp.float32)
    return {
        "bf16": f32(5).astype(jnp.bfloat16),
        "f16": f32(2, 2).astype(jnp.float16),
        "i8": jnp.arange(-3, 3, dtype=jnp.int8),
        "u8": jnp.arange(250, 256, dtype=jnp.uint8),
        "u32": jnp.array([0, 1, 2**32 - 1], jnp.uint32),
        "i32": jnp.array([-(2**31), 0, 2**31 - 1], jnp.int32),
        "bool": jnp.array([True, False, True]),
        "c64": jnp.array([1 + 2j, -0.5j], jnp.complex64),
        "special": jnp.stack([nan_payload, jnp.float32(-0.0), jnp.float32(jnp.inf),
                              jnp.float32(-jnp.inf), jnp.float32(1e-45)]),
        "scalar": jnp.float32(2.5),
        "empty": jnp.zeros((0, 3), jnp.float32),
    }


CASES: dict[str, Any] = {
    "jax_array": lambda: f32(2, 3),
    "dtypes": dtypes,
    "numpy_leaves": lambda: Dense(np.arange(6, dtype=np.float32).reshape(2, 3) / 3,
                                  jnp.ones(3, jnp.float32), "mixed"),
    "scalars": lambda: Scaled((np.float32(1.5), 2.0, 3, True), jnp.float32(0.5), "s"),
    "dict_list_tuple": lambda: {"a": [f32(2), (f32(3), jnp.arange(4, dtype=jnp.int32))],
                                "b": {"c": jnp.eye(2, dtype=jnp.float32)}},
    "namedtuple": lambda: Moments(f32(2, 2), f32(2, 2, start=3.0), jnp.int32(3)),
    "register_dataclass": lambda: Dense(f32(2, 3), f32(3), "layer0"),
    "register_pytree_node_class": lambda: Scaled(f32(4), jnp.float32(2.0), "tag"),
    "flax_struct_dataclass": lambda: EMA(params(), jnp.int32(4), 0.5, 1, False,
                                         np.float32(0.25)),
    "flax_train_state": trained_train_state,
    "nnx_state": nnx_state,
    "optax_adam": lambda: stepped(optax.adam(1e-3)),
    "optax_chain_clip_adamw": lambda: stepped(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))),
    "optax_inject_hyperparams": lambda: stepped(
        optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)),
    "raw_prng_key": lambda: jax.random.PRNGKey(0),
    **{f"typed_key_{impl}": (lambda impl=impl: jax.random.key(0, impl=impl))
       for impl in KEY_IMPLS},
    "typed_key_array": lambda: jax.random.split(jax.random.key(1, impl="rbg"), 3),
    "keys_in_a_dict": lambda: {"raw": jax.random.PRNGKey(3), "typed": jax.random.key(4),
                               "params": params()},
}
#: the cases whose leaves are all jax.Arrays (a tree of ShapeDtypeStruct can describe them)
ALL_JAX = [name for name, make in CASES.items()
           if all(isinstance(x, jax.Array) for x in jax.tree.leaves(make()))]


# --- helpers --------------------------------------------------------------------------------

def is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def kind(x: Any) -> Any:
    if is_key(x):
        return ("typed key", str(jax.random.key_impl(x)))
    if isinstance(x, jax.Array):
        return "jax.Array"
    if isinstance(x, np.ndarray):
        return "np.ndarray"
    return type(x)


def bits(x: Any) -> tuple:
    """Everything a leaf's value is, bit for bit."""
    if is_key(x):
        data = np.asarray(jax.random.key_data(x))
        return (kind(x), x.shape, data.dtype.str, data.tobytes())
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        a = np.asarray(x)
        return (kind(x), a.shape, a.dtype.name, a.tobytes())
    return (kind(x), repr(x))


def bump(tree: Any) -> Any:
    """The same tree with every leaf's bits changed (a state that has moved on)."""
    def one(x):
        if is_key(x):
            data = jax.random.key_data(x) ^ jnp.uint32(1)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        if isinstance(x, np.generic):
            return type(x)(not x) if x.dtype == bool else type(x)(0 if np.isnan(x) else x + 1)
        if isinstance(x, (jax.Array, np.ndarray)):
            xp = jnp if isinstance(x, jax.Array) else np
            if x.dtype == bool:
                return xp.logical_not(x)
            if xp.issubdtype(x.dtype, xp.inexact):
                return xp.where(xp.isnan(x), 0, x + 1).astype(x.dtype)
            return (x + 1).astype(x.dtype)
        if isinstance(x, bool):
            return not x
        if isinstance(x, (int, float)):
            return x + 1
        raise AssertionError(f"no bump for {type(x)}")
    out = jax.tree.map(one, tree)
    for (path, a), b in zip(jax.tree.leaves_with_path(tree), jax.tree.leaves(out),
                            strict=True):
        assert bits(a) != bits(b) or np.size(a) == 0, f"bump left {jax.tree_util.keystr(path)} as it was"
    return out


def assert_same(got: Any, want: Any) -> None:
    """Same pytree structure (node types and their static data), same leaf kinds, same bits;
    typed keys still draw what the saved ones draw."""
    assert jax.tree.structure(got) == jax.tree.structure(want), (
        f"structure {jax.tree.structure(got)} != {jax.tree.structure(want)}")
    assert type(got) is type(want), (type(got), type(want))
    for (path, g), w in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(want),
                            strict=True):
        where = jax.tree_util.keystr(path) or "<root>"
        assert bits(g) == bits(w), f"{where}: {bits(g)} != {bits(w)}"
        if is_key(w):
            g0, w0 = g.reshape(-1)[0], w.reshape(-1)[0]
            for draw in (lambda k: jax.random.split(k),
                         lambda k: jax.random.normal(k, (3,))):
                assert bits(draw(g0)) == bits(draw(w0)), f"{where}: the key draws otherwise"


def leaf_bits(tree: Any) -> list[tuple]:
    return [bits(x) for x in jax.tree.leaves(tree)]


def sds(tree: Any, sharding: Any = "same") -> Any:
    def one(x):
        s = x.sharding if sharding == "same" else sharding
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
    return jax.tree.map(one, tree)


MESH = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
SHARDINGS = {
    "device0": SingleDeviceSharding(jax.devices()[0]),
    "device5": SingleDeviceSharding(jax.devices()[5]),
    "xy": NamedSharding(MESH, P("x", "y")),
    "yx": NamedSharding(MESH, P("y", "x")),
    "x": NamedSharding(MESH, P("x")),
    "replicated": NamedSharding(MESH, P()),
}
#: (how the saved arrays were placed, how the target places them)
PLACEMENTS = [("device0", "xy"), ("xy", "yx"), ("xy", "replicated"), ("x", "device5"),
              ("replicated", "x"), ("xy", "xy")]


def sharded_tree(sharding: Any) -> dict[str, jax.Array]:
    return {"w": jax.device_put(f32(8, 4), sharding),
            "h": jax.device_put(f32(8, 4).astype(jnp.bfloat16) - 2, sharding)}


def assert_placed(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k, w in want.items():
        assert isinstance(got[k], jax.Array), (k, type(got[k]))
        assert got[k].sharding.is_equivalent_to(w.sharding, w.ndim), (
            f"{k}: placed as {got[k].sharding}, the target says {w.sharding}")


# --- restore --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CASES))
def test_restore_gives_back_the_saved_tree_as_new_objects(manager, name):
    saved = CASES[name]()
    mgr = manager()
    mgr.save(0, {"tree": saved, "epoch": 3}).wait()
    target = bump(saved)
    old_leaves = jax.tree.leaves(target)  # plain dicts and lists are updated in place
    old_bits = [bits(x) for x in old_leaves]
    state = {"tree": target, "epoch": 0}
    assert mgr.restore(state) == 0
    assert_same(state["tree"], saved)
    assert state["epoch"] == 3
    for (path, new), old, was in zip(jax.tree.leaves_with_path(state["tree"]), old_leaves,
                                     old_bits, strict=True):
        if isinstance(old, jax.Array):  # immutable: a new array, the old one untouched
            where = jax.tree_util.keystr(path)
            assert new is not old, f"{where}: still the target's array"
            assert bits(old) == was, f"{where}: the target's old array was written into"


def test_an_async_save_took_its_copy_before_the_arrays_are_donated(manager):
    """save() returns once the snapshot is taken: a jitted step that donates the state's
    buffers right after (they are deleted and reused) cannot change what is written."""
    mgr = manager(async_save=True)
    p = {"w": f32(256, 64), "b": f32(64), "k": jax.random.key(7)}
    want = {k: bits(v) for k, v in p.items()}
    handle = mgr.save(0, {"p": p})
    update = jax.jit(lambda t: jax.tree.map(lambda x: x * 3 - 1, t), donate_argnums=0)
    new = update({"w": p["w"], "b": p["b"]})
    assert p["w"].is_deleted() and p["b"].is_deleted()  # donation happened (else no test)
    jax.block_until_ready(new)
    handle.wait()
    target = {"p": {"w": jnp.zeros((256, 64)), "b": jnp.zeros(64),
                    "k": jax.random.key(0)}}
    assert mgr.restore(target) == 0
    assert {k: bits(v) for k, v in target["p"].items()} == want


def test_a_restored_train_state_trains_on_identically(manager):
    ts = trained_train_state()
    mgr = manager()
    mgr.save(5, {"ts": ts}).wait()
    fresh = train_state.TrainState.create(
        apply_fn=MODEL.apply, params=MODEL.init(jax.random.key(9), X)["params"], tx=TX)
    state = {"ts": fresh}
    assert mgr.restore(state) == 5
    grads = jax.tree.map(lambda x: jnp.tanh(x) * 0.5, ts.params)
    a, b = ts.apply_gradients(grads=grads), state["ts"].apply_gradients(grads=grads)
    assert a.step == b.step == 2 and type(b.step) is int
    assert leaf_bits(b) == leaf_bits(a)
    assert bits(b.apply_fn({"params": b.params}, X)) == bits(a.apply_fn({"params": a.params}, X))


def test_an_nnx_model_updated_from_the_restored_state_runs_identically(manager):
    a = Tiny(nnx.Rngs(0, dropout=1))
    a(X)
    mgr = manager()
    mgr.save(0, {"model": nnx.state(a)}).wait()
    b = Tiny(nnx.Rngs(5, dropout=6))
    state = {"model": nnx.state(b)}
    assert mgr.restore(state) == 0
    nnx.update(b, state["model"])
    # train mode: batch statistics and the dropout stream (its key and count) both matter
    assert bits(b(X)) == bits(a(X))
    assert leaf_bits(nnx.state(b)) == leaf_bits(nnx.state(a))


def test_restore_places_each_array_as_the_target_does(manager):
    saved = sharded_tree(SHARDINGS["xy"])
    mgr = manager()
    mgr.save(0, {"t": saved}).wait()
    for target_sharding in ("yx", "device5", "replicated"):
        target = bump(sharded_tree(SHARDINGS[target_sharding]))
        want = dict(target)  # the dict itself is updated in place
        state = {"t": target}
        assert mgr.restore(state) == 0
        assert_same(state["t"], saved)
        assert_placed(state["t"], want)


# --- load -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CASES))
def test_load_into_a_live_target_returns_a_new_tree_and_leaves_the_target_alone(manager, name):
    saved = CASES[name]()
    mgr = manager()
    mgr.save(0, {"tree": saved}).wait()
    target = bump(saved)
    before = leaf_bits(target)
    new = mgr.load(target={"tree": target})
    assert_same(new["tree"], saved)
    assert leaf_bits(target) == before


@pytest.mark.parametrize("name", ALL_JAX)
def test_load_into_a_tree_of_shape_dtype_structs(manager, name):
    saved = CASES[name]()
    mgr = manager()
    mgr.save(0, {"tree": saved}).wait()
    new = mgr.load(step=0, target={"tree": sds(saved)})
    assert_same(new["tree"], saved)


@pytest.mark.parametrize(("saved_as", "loaded_as"), PLACEMENTS,
                         ids=[f"{a}-to-{b}" for a, b in PLACEMENTS])
def test_load_places_arrays_as_the_shape_dtype_structs_say(manager, saved_as, loaded_as):
    saved = sharded_tree(SHARDINGS[saved_as])
    mgr = manager()
    mgr.save(0, {"t": saved}).wait()
    target = sds(saved, SHARDINGS[loaded_as])
    new = mgr.load(target={"t": target})
    assert_same(new["t"], saved)
    assert_placed(new["t"], target)
    live = mgr.load(target={"t": sharded_tree(SHARDINGS[loaded_as])})
    assert_same(live["t"], saved)
    assert_placed(live["t"], target)


@pytest.mark.parametrize("impl", KEY_IMPLS)
def test_load_places_a_sharded_array_of_typed_keys(manager, impl):
    keys = jax.device_put(jax.random.split(jax.random.key(2, impl=impl), 8), SHARDINGS["x"])
    mgr = manager()
    mgr.save(0, {"keys": keys}).wait()
    for target in (keys, sds(keys, SHARDINGS["replicated"]), sds(keys, SHARDINGS["device5"])):
        new = mgr.load(target={"keys": target})
        assert_same(new["keys"], keys)
        assert_placed(new, {"keys": target})


def test_load_without_a_target_gives_numpy_and_keys_as_their_data_and_impl(manager):
    state = {"w": f32(2, 3).astype(jnp.bfloat16), "raw": jax.random.PRNGKey(5),
             "k": jax.random.key(6, impl="rbg"), "opt": stepped(optax.adam(1e-3))}
    mgr = manager()
    mgr.save(0, state).wait()
    out = mgr.load()
    assert isinstance(out["w"], np.ndarray) and bits(out["w"])[1:] == bits(state["w"])[1:]
    assert isinstance(out["raw"], np.ndarray) and bits(out["raw"])[1:] == bits(state["raw"])[1:]
    k = out["k"]
    assert isinstance(k, dict), type(k)
    data = np.asarray(jax.random.key_data(state["k"]))
    arrays = [v for v in k.values() if isinstance(v, np.ndarray)]
    assert any(a.dtype == data.dtype and a.shape == data.shape and a.tobytes() == data.tobytes()
               for a in arrays), k
    assert any(isinstance(v, str) and v == "rbg" for v in k.values()), k

    def no_jax(x: Any, where: str) -> None:
        assert not isinstance(x, jax.Array), f"{where} is a jax.Array"
        if isinstance(x, dict):
            for key, v in x.items():
                no_jax(v, f"{where}/{key}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                no_jax(v, f"{where}/{i}")
    no_jax(out, "")


# --- refusals -------------------------------------------------------------------------------

def _tiny_bigger() -> Any:
    model = Tiny(nnx.Rngs(0, dropout=1))
    model.extra = nnx.Linear(2, 2, rngs=nnx.Rngs(3))
    return nnx.state(model)


#: (what was saved, a target that does not fit it)
MISMATCHES = {
    "shape": (lambda: Dense(f32(2, 3), f32(3), "d"), lambda: Dense(f32(2, 4), f32(3), "d")),
    "dtype": (lambda: Dense(f32(2, 3), f32(3), "d"),
              lambda: Dense(f32(2, 3).astype(jnp.bfloat16), f32(3), "d")),
    "optimizer_adam_into_adamw": (lambda: stepped(optax.adam(1e-3)),
                                  lambda: stepped(optax.adamw(1e-3))),
    "optimizer_adam_into_sgd_momentum": (lambda: stepped(optax.adam(1e-3)),
                                         lambda: stepped(optax.sgd(1e-3, momentum=0.9))),
    "nnx_model_with_another_layer": (nnx_state, _tiny_bigger),
    "list_length": (lambda: [f32(2), f32(2)], lambda: [f32(2), f32(2), f32(2)]),
    "array_into_dataclass": (lambda: f32(2, 3), lambda: Dense(f32(2, 3), f32(3), "d")),
    "key_impl": (lambda: jax.random.key(0, impl="threefry2x32"),
                 lambda: jax.random.key(0, impl="rbg")),
    "typed_key_into_raw_key": (lambda: jax.random.key(0), lambda: jax.random.PRNGKey(0)),
    "raw_key_into_typed_key": (lambda: jax.random.PRNGKey(0), lambda: jax.random.key(0)),
    "key_array_length": (lambda: jax.random.split(jax.random.key(0), 3),
                         lambda: jax.random.split(jax.random.key(0), 4)),
}


@pytest.mark.parametrize("name", list(MISMATCHES))
def test_a_target_that_does_not_fit_is_refused_and_left_unchanged(manager, name):
    make_saved, make_target = MISMATCHES[name]
    mgr = manager()
    mgr.save(0, {"tree": make_saved(), "np": np.ones(4), "jx": jnp.ones(3), "epoch": 5}).wait()
    tree, arr, jx = make_target(), np.zeros(4), jnp.zeros(3)
    before = leaf_bits(tree)
    state = {"tree": tree, "np": arr, "jx": jx, "epoch": 0}
    with pytest.raises(pitstop.IncompatibleTargetError) as e:
        mgr.restore(state)
    assert "tree" in str(e.value), str(e.value)
    assert state["tree"] is tree and leaf_bits(tree) == before
    assert state["np"] is arr and not arr.any()  # not a byte written: not even the fitting
    assert state["jx"] is jx and state["epoch"] == 0  # entries
    with pytest.raises(pitstop.IncompatibleTargetError):
        mgr.load(target={"tree": make_target(), "np": np.zeros(4), "jx": jnp.zeros(3),
                         "epoch": 0})
    assert leaf_bits(tree) == before


ROOTS = {
    "jax_array": lambda: f32(2, 3),
    "typed_key": lambda: jax.random.key(0),
    "register_dataclass": lambda: Dense(f32(2, 3), f32(3), "d"),
    "register_pytree_node_class": lambda: Scaled(f32(4), jnp.float32(2.0), "tag"),
    "flax_train_state": trained_train_state,
}


@pytest.mark.parametrize("name", list(ROOTS))
def test_restore_into_a_root_that_cannot_change_in_place_points_to_load(manager, name):
    """A state that is itself a JAX array or pytree node (saved as such) cannot be restored
    in place; the refusal says to use load(target=...), which then gives the saved tree."""
    root = ROOTS[name]()
    mgr = manager()
    mgr.save(0, root).wait()
    target = bump(root)
    before = leaf_bits(target)
    with pytest.raises(pitstop.CheckpointError, match=r"load\(target="):
        mgr.restore(target)
    assert leaf_bits(target) == before
    assert_same(mgr.load(target=target), root)
