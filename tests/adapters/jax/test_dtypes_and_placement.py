"""Adversarial probes of the JAX adapter: dtypes, weak types, x64, donation, tracers, async
saves, load(target=...) roots. A failing test is a defect."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import pitstop

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
train_state = pytest.importorskip("flax.training.train_state")
optax = pytest.importorskip("optax")


# --- dtypes ---------------------------------------------------------------------------------

from jax_helpers import bits  # noqa: E402

DTYPES = {
    "bfloat16": lambda: (jnp.arange(7, dtype=jnp.float32) / 3 - 1).astype(jnp.bfloat16),
    "float8_e4m3fn": lambda: (jnp.arange(7, dtype=jnp.float32) / 3 - 1).astype(jnp.float8_e4m3fn),
    "float8_e5m2": lambda: (jnp.arange(7, dtype=jnp.float32) - 3).astype(jnp.float8_e5m2),
    "int4": lambda: jnp.array([-8, -1, 0, 1, 7], dtype=jnp.int4),
    "uint4": lambda: jnp.array([0, 1, 15], dtype=jnp.uint4),
    "float4_e2m1fn": lambda: jnp.array([0.5, -1.0, 6.0], dtype=jnp.float4_e2m1fn),
    "int2": lambda: jnp.array([-2, -1, 0, 1], dtype=jnp.int2),
    "bool_0d": lambda: jnp.array(True),
    "complex64": lambda: jnp.array([1 + 2j, -0.5j, complex(np.inf, np.nan)], jnp.complex64),
    "complex64_0d": lambda: jnp.complex64(3 - 4j),
    "bf16_0d": lambda: jnp.bfloat16(1.5),
    "empty_0x0": lambda: jnp.zeros((0, 0), jnp.float32),
    "empty_3x0x2": lambda: jnp.zeros((3, 0, 2), jnp.int8),
    "u32_max": lambda: jnp.array([2**32 - 1], jnp.uint32),
    "f16_nan_payload": lambda: jax.lax.bitcast_convert_type(
        jnp.array([0x7E01, 0xFC00, 0x8000], jnp.uint16), jnp.float16),
}


@pytest.mark.parametrize("name", list(DTYPES))
def test_dtype_round_trips_bit_for_bit(manager, name):
    x = DTYPES[name]()
    mgr = manager()
    mgr.save(0, {"x": x}).wait()
    state = {"x": jnp.zeros(x.shape, x.dtype)}
    assert mgr.restore(state) == 0
    assert bits(state["x"]) == bits(x)
    got = mgr.load(target={"x": jax.ShapeDtypeStruct(x.shape, x.dtype)})
    assert bits(got["x"]) == bits(x)
    npy = mgr.load()["x"]
    assert np.asarray(npy).tobytes() == np.asarray(x).tobytes() and npy.dtype == np.asarray(x).dtype


def test_x64_arrays_round_trip_with_x64_on(manager):
    with jax.enable_x64(True):
        u = jnp.array([0, 2**64 - 1, 2**63], jnp.uint64)
        f = jnp.array([1 / 3, 1e300], jnp.float64)
        i = jnp.array([-(2**63)], jnp.int64)
        mgr = manager()
        mgr.save(0, {"u": u, "f": f, "i": i}).wait()
        state = {"u": jnp.zeros(3, jnp.uint64), "f": jnp.zeros(2, jnp.float64),
                 "i": jnp.zeros(1, jnp.int64)}
        assert mgr.restore(state) == 0
        for k, v in (("u", u), ("f", f), ("i", i)):
            assert bits(state[k]) == bits(v), k


def test_x64_checkpoint_restored_with_x64_off_is_refused_not_truncated(manager):
    """A run saved with x64 resumed without it: the uint64 entry cannot be held in a jax
    array; a correct SDK refuses (IncompatibleTargetError naming 'u'), never truncates."""
    with jax.enable_x64(True):
        u = jnp.array([0, 2**64 - 1, 2**40], jnp.uint64)
        mgr = manager()
        mgr.save(0, {"u": u}).wait()
    with pytest.raises(pitstop.IncompatibleTargetError, match="'u'"):
        mgr.restore({"u": jnp.zeros(3, jnp.uint64)})  # a uint32 array with x64 off
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        target = {"u": jax.ShapeDtypeStruct((3,), jnp.uint64)}
    try:
        got = mgr.load(target=target)
    except pitstop.CheckpointError as e:
        assert "u" in str(e)
        return
    a = np.asarray(got["u"])
    assert a.dtype == np.uint64 and a.tolist() == [0, 2**64 - 1, 2**40], (a.dtype, a)


def test_numpy_float64_checkpoint_into_a_float64_shape_dtype_struct_without_x64(manager):
    """The same through a numpy leaf: a float64 saved by numpy, loaded into a
    ShapeDtypeStruct(float64) while x64 is off."""
    mgr = manager()
    want = np.array([1 / 3, 1e300, 2**60 + 1], np.float64)
    mgr.save(0, {"f": want}).wait()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        target = {"f": jax.ShapeDtypeStruct((3,), jnp.float64)}
    try:
        got = mgr.load(target=target)
    except pitstop.CheckpointError as e:
        assert "f" in str(e)
        return
    a = np.asarray(got["f"])
    assert a.dtype == np.float64 and a.tobytes() == want.tobytes(), (a.dtype, a)


# --- weak types -----------------------------------------------------------------------------

def test_weak_typed_scalar_stays_weak_and_jit_does_not_retrace(manager):
    lr = jnp.asarray(1.0)
    count = jnp.asarray(3)
    assert lr.weak_type and count.weak_type
    f = jax.jit(lambda a, b, x: x * a + b)
    x = jnp.ones(2, jnp.bfloat16)
    f(lr, count, x)
    n = f._cache_size()
    mgr = manager()
    mgr.save(0, {"lr": lr, "count": count}).wait()
    state = {"lr": jnp.asarray(0.5), "count": jnp.asarray(0)}
    assert mgr.restore(state) == 0
    assert state["lr"].weak_type and state["count"].weak_type
    assert bits(state["lr"]) == bits(lr) and bits(state["count"]) == bits(count)
    out = f(state["lr"], state["count"], x)
    assert out.dtype == jnp.bfloat16
    assert f._cache_size() == n, "the restored weak scalar made the jitted function retrace"
    got = mgr.load(target={"lr": jax.ShapeDtypeStruct((), jnp.float32, weak_type=True),
                           "count": jax.ShapeDtypeStruct((), jnp.int32, weak_type=True)})
    assert got["lr"].weak_type and got["count"].weak_type


def test_strong_typed_array_is_not_made_weak(manager):
    x = jnp.float32(2.0)
    assert not x.weak_type
    mgr = manager()
    mgr.save(0, {"x": x}).wait()
    state = {"x": jnp.float32(0.0)}
    mgr.restore(state)
    assert not state["x"].weak_type


# --- donation, tracers, deleted arrays --------------------------------------------------------

def test_saving_a_donated_array_names_the_entry(manager):
    w = jnp.ones(16)
    jax.jit(lambda a: a * 2, donate_argnums=0)(w)
    assert w.is_deleted()
    mgr = manager()
    with pytest.raises(pitstop.UnsupportedStateError, match=r"'p/w'.*donated"):
        mgr.save(0, {"p": {"w": w}})
    assert mgr.all_steps() == []


def test_restore_into_a_state_whose_arrays_were_donated(manager):
    """Restoring only needs the target's shape, dtype and sharding; a state whose arrays were
    donated by the failed step (a typical resume-after-error) must restore."""
    mgr = manager()
    mgr.save(0, {"w": jnp.full(16, 3.0)}).wait()
    w = jnp.ones(16)
    jax.jit(lambda a: a * 2, donate_argnums=0)(w)
    state = {"w": w}
    try:
        assert mgr.restore(state) == 0
    except pitstop.CheckpointError as e:
        # at least: the message must not tell a restoring user to "save" something
        assert "save the array" not in str(e), str(e)
        raise
    assert bits(state["w"]) == bits(jnp.full(16, 3.0))


def test_save_of_a_tracer_inside_jit_is_refused_with_the_entry(manager):
    mgr = manager()

    @jax.jit
    def f(x):
        mgr.save(0, {"inside": {"x": x}})
        return x

    with pytest.raises(pitstop.UnsupportedStateError, match=r"'inside/x'.*trac"):
        f(jnp.ones(2))
    assert mgr.all_steps() == []


def test_save_of_a_tracer_inside_a_pytree_node_inside_jit(manager):
    mgr = manager()
    ts = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)},
                                       tx=optax.sgd(0.1))

    @jax.jit
    def f(t):
        mgr.save(0, {"ts": t})
        return t

    with pytest.raises(pitstop.UnsupportedStateError, match=r"ts"):
        f(ts)


# --- async saves ----------------------------------------------------------------------------

def test_async_save_then_replace_and_mutate_entries_immediately(manager):
    mgr = manager(async_save=True)
    w = jnp.arange(1 << 16, dtype=jnp.float32)
    npa = np.arange(1 << 16, dtype=np.float32)
    state = {"w": w, "np": npa, "k": jax.random.key(3), "lst": [jnp.ones(3)], "step": 7}
    want = {"w": bits(w), "np": bits(npa), "k": bits(state["k"])}
    h = mgr.save(0, state)
    state["w"] = w * 0
    npa[:] = -1
    state["k"] = jax.random.key(99)
    state["lst"].append(jnp.zeros(3))
    state["step"] = 8
    h.wait()
    target = {"w": jnp.zeros_like(w), "np": np.zeros_like(npa), "k": jax.random.key(0),
              "lst": [jnp.zeros(3)], "step": 0}
    assert mgr.restore(target) == 0
    assert bits(target["w"]) == want["w"] and bits(target["np"]) == want["np"]
    assert bits(target["k"]) == want["k"] and target["step"] == 7
    assert bits(target["lst"][0]) == bits(jnp.ones(3))


def test_async_save_then_donate_every_buffer_including_sharded(manager):
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    w = jax.device_put(jnp.arange(64, dtype=jnp.float32).reshape(8, 8), NamedSharding(mesh, P("x")))
    want = bits(w)
    mgr = manager(async_save=True)
    h = mgr.save(0, {"w": w})
    new = jax.jit(lambda a: a + 1, donate_argnums=0)(w)
    jax.block_until_ready(new)
    h.wait()
    got = mgr.load(target={"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=new.sharding)})
    assert bits(got["w"]) == want


# --- the same array twice -------------------------------------------------------------------

def test_the_same_array_object_referenced_twice(manager):
    x = jnp.arange(5, dtype=jnp.float32)
    k = jax.random.key(1)
    mgr = manager()
    mgr.save(0, {"a": x, "b": {"c": x}, "k1": k, "k2": k}).wait()
    y = jnp.zeros(5)
    kk = jax.random.key(2)
    state = {"a": y, "b": {"c": y}, "k1": kk, "k2": kk}
    assert mgr.restore(state) == 0
    assert bits(state["a"]) == bits(x) and bits(state["b"]["c"]) == bits(x)
    assert bits(state["k1"]) == bits(k) and bits(state["k2"]) == bits(k)


# --- load(target=...) roots -----------------------------------------------------------------

def test_load_target_train_state_root(manager):
    ts = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(3)},
                                       tx=optax.adam(0.1))
    ts = ts.apply_gradients(grads={"w": jnp.full(3, 0.5)})
    mgr = manager()
    mgr.save(0, {"ts": ts}).wait()
    fresh = train_state.TrainState.create(apply_fn=None, params={"w": jnp.zeros(3)},
                                          tx=optax.adam(0.1))
    got = mgr.load(target={"ts": fresh})
    assert type(got["ts"]) is train_state.TrainState and got["ts"].step == 1
    assert [bits(a) for a in jax.tree.leaves(got["ts"])] == [bits(a) for a in jax.tree.leaves(ts)]


def test_load_target_tuple_root(manager):
    saved = (jnp.ones(2), jax.random.key(4), 3)
    mgr = manager()
    mgr.save(0, saved).wait()
    got = mgr.load(target=(jax.ShapeDtypeStruct((2,), jnp.float32),
                           jax.ShapeDtypeStruct((), jax.random.key(0).dtype), 0))
    assert type(got) is tuple and got[2] == 3
    assert bits(got[0]) == bits(saved[0]) and bits(got[1]) == bits(saved[1])


def test_load_target_shape_dtype_struct_root(manager):
    x = jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3)
    mgr = manager()
    mgr.save(0, x).wait()
    got = mgr.load(target=jax.ShapeDtypeStruct(x.shape, x.dtype))
    assert isinstance(got, jax.Array) and bits(got) == bits(x)


def test_load_target_numpy_root_from_a_jax_checkpoint(manager):
    x = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    mgr = manager()
    mgr.save(0, x).wait()
    tgt = np.zeros((2, 3), np.float32)
    got = mgr.load(target=tgt)
    assert isinstance(got, np.ndarray) and got.tobytes() == np.asarray(x).tobytes()
    assert not tgt.any()


def test_load_target_numpy_root_checkpoint_into_jax_root(manager):
    x = np.arange(6, dtype=np.int32)
    mgr = manager()
    mgr.save(0, x).wait()
    got = mgr.load(target=jnp.zeros(6, jnp.int32))
    assert isinstance(got, jax.Array) and bits(got)[1:] == bits(x)[1:]


def test_restore_of_a_shape_dtype_struct_in_place_fills_it(manager):
    """restore() (not load) into a dict holding ShapeDtypeStructs: each becomes an array."""
    mgr = manager()
    mgr.save(0, {"w": jnp.ones(3)}).wait()
    state = {"w": jax.ShapeDtypeStruct((3,), jnp.float32)}
    assert mgr.restore(state) == 0
    assert isinstance(state["w"], jax.Array) and bits(state["w"]) == bits(jnp.ones(3))


def test_load_target_with_mismatched_shape_dtype_struct_is_refused(manager):
    mgr = manager()
    mgr.save(0, {"w": jnp.ones(3)}).wait()
    with pytest.raises(pitstop.IncompatibleTargetError, match="'w'"):
        mgr.load(target={"w": jax.ShapeDtypeStruct((4,), jnp.float32)})
    with pytest.raises(pitstop.IncompatibleTargetError, match="'w'"):
        mgr.load(target={"w": jax.ShapeDtypeStruct((3,), jnp.bfloat16)})


def test_saving_a_shape_dtype_struct_is_refused_with_the_entry(manager):
    mgr = manager()
    with pytest.raises(pitstop.UnsupportedStateError, match="'w'"):
        mgr.save(0, {"w": jax.ShapeDtypeStruct((3,), jnp.float32)})
    assert mgr.all_steps() == []


def test_typed_key_of_another_impl_via_shape_dtype_struct_is_refused(manager):
    mgr = manager()
    mgr.save(0, {"k": jax.random.key(0, impl="rbg")}).wait()
    spec = jax.ShapeDtypeStruct((), jax.random.key(0, impl="unsafe_rbg").dtype)
    with pytest.raises(pitstop.IncompatibleTargetError, match="'k'"):
        mgr.load(target={"k": spec})


def test_raw_key_checkpoint_into_typed_key_points_to_wrap_key_data(manager):
    mgr = manager()
    mgr.save(0, {"k": jax.random.PRNGKey(0)}).wait()
    with pytest.raises(pitstop.IncompatibleTargetError, match="wrap_key_data"):
        mgr.restore({"k": jax.random.key(0)})


def test_x64_context_applies_to_a_restore_of_several_arrays(manager):
    """Under ``with jax.enable_x64(True)`` (thread-local), a restore of several 64-bit arrays
    must give 64-bit arrays back; restoring them on worker threads, where the context does
    not apply, narrows them to 32 bits silently."""
    with jax.enable_x64(True):
        saved = {"u": jnp.array([0, 2**64 - 1, 2**40], jnp.uint64),
                 "f": jnp.array([1 / 3], jnp.float64), "i": jnp.arange(3, dtype=jnp.int64)}
        mgr = manager()
        mgr.save(0, saved).wait()
        state = {k: jnp.zeros_like(v) for k, v in saved.items()}
        assert mgr.restore(state) == 0
        for k, v in saved.items():
            assert state[k].dtype == v.dtype, (k, state[k].dtype)
            assert bits(state[k]) == bits(v), k


def test_restored_uncommitted_scalar_still_mixes_with_arrays_on_another_device(manager):
    """``jnp.asarray(1.0)`` is uncommitted: it follows the other operand to its device. The
    restored one must behave the same (the resumed run must not fail where the
    uninterrupted one runs)."""
    lr = jnp.asarray(1.0)
    w = jax.device_put(jnp.ones(3), jax.devices()[5])
    assert (w * lr).devices() == {jax.devices()[5]}
    mgr = manager()
    mgr.save(0, {"lr": lr, "w": w}).wait()
    state = {"lr": jnp.asarray(0.0), "w": jax.device_put(jnp.zeros(3), jax.devices()[5])}
    assert mgr.restore(state) == 0
    out = state["w"] * state["lr"]
    assert out.devices() == {jax.devices()[5]}
