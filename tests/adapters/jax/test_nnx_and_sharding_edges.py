"""Adversarial probes of the JAX adapter: sharding, NNX modules and optimizers, many tiny
arrays. A failing test is a defect."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pitstop

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")
nnx = pytest.importorskip("flax.nnx")
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

DEV = jax.devices()
pytestmark = pytest.mark.skipif(len(DEV) < 8, reason="needs 8 host devices")


def bits(x: Any) -> tuple:
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        d = np.asarray(jax.random.key_data(x))
        return ("key", str(jax.random.key_impl(x)), d.shape, d.tobytes())
    a = np.asarray(x)
    return (a.shape, a.dtype.name, a.tobytes())


def val(shape, dtype=jnp.float32):
    return (jnp.arange(int(np.prod(shape)), dtype=jnp.float32).reshape(shape) / 3).astype(dtype)


# --- sharding -------------------------------------------------------------------------------

def test_restore_8_way_sharded_into_a_4_device_mesh(manager):
    mesh8 = Mesh(np.array(DEV).reshape(4, 2), ("x", "y"))
    x = jax.device_put(val((16, 8)), NamedSharding(mesh8, P("x", "y")))
    k = jax.device_put(jax.random.split(jax.random.key(0), 8), NamedSharding(mesh8, P("x")))
    mgr = manager()
    mgr.save(0, {"x": x, "k": k}).wait()
    mesh4 = Mesh(np.array(DEV[4:]).reshape(2, 2), ("a", "b"))
    tgt = {"x": jax.device_put(jnp.zeros((16, 8)), NamedSharding(mesh4, P("b", "a"))),
           "k": jax.device_put(jax.random.split(jax.random.key(9), 8), NamedSharding(mesh4, P("a")))}
    state = dict(tgt)
    assert mgr.restore(state) == 0
    assert bits(state["x"]) == bits(x) and bits(state["k"]) == bits(k)
    assert state["x"].sharding == tgt["x"].sharding
    assert state["k"].sharding.is_equivalent_to(tgt["k"].sharding, 1)
    got = mgr.load(target={"x": jax.ShapeDtypeStruct((16, 8), jnp.float32,
                                                     sharding=NamedSharding(mesh4, P(None, "a"))),
                           "k": jax.ShapeDtypeStruct((8,), k.dtype,
                                                     sharding=SingleDeviceSharding(DEV[7]))})
    assert bits(got["x"]) == bits(x) and bits(got["k"]) == bits(k)
    assert got["k"].devices() == {DEV[7]}


def test_a_target_sharding_that_does_not_divide_the_shape_is_a_checkpoint_error(manager):
    """JAX refuses NamedShardings that do not divide the shape (IndivisibleError). A
    ShapeDtypeStruct target can hold one; pitstop must answer with a CheckpointError naming
    the entry, not a raw JAX exception from the middle of the data phase."""
    mgr = manager()
    mgr.save(0, {"w": val((10, 3)), "b": jnp.ones(4)}).wait()
    mesh4 = Mesh(np.array(DEV[:4]), ("x",))
    target = {"w": jax.ShapeDtypeStruct((10, 3), jnp.float32, sharding=NamedSharding(mesh4, P("x"))),
              "b": jax.ShapeDtypeStruct((4,), jnp.float32)}
    with pytest.raises(pitstop.CheckpointError, match="'w'"):
        mgr.load(target=target)


def test_sharded_on_both_axes_with_replication_saves_each_distinct_shard_once(manager, tmp_path):
    mesh = Mesh(np.array(DEV).reshape(2, 2, 2), ("a", "b", "c"))
    x = jax.device_put(val((4, 6)), NamedSharding(mesh, P("a", "c")))  # replicated on b
    mgr = manager()
    mgr.save(0, {"x": x}).wait()
    import json
    m = json.loads((tmp_path / "ckpt" / "step_0000000000" / "manifest.json").read_text())
    e = m["arrays"]["x"]
    assert len(e["shards"]) == 4, e
    got = mgr.load(target={"x": jax.ShapeDtypeStruct((4, 6), jnp.float32,
                                                     sharding=NamedSharding(mesh, P("c", "b")))})
    assert bits(got["x"]) == bits(x)


def test_sharded_zero_size_and_scalar_arrays(manager):
    mesh = Mesh(np.array(DEV), ("x",))
    z = jax.device_put(jnp.zeros((0, 8)), NamedSharding(mesh, P(None, "x")))
    z2 = jax.device_put(jnp.zeros((8, 0)), NamedSharding(mesh, P("x")))
    s = jax.device_put(jnp.float32(2.5), NamedSharding(mesh, P()))
    mgr = manager()
    mgr.save(0, {"z": z, "z2": z2, "s": s}).wait()
    state = {"z": z, "z2": z2, "s": jax.device_put(jnp.float32(0), NamedSharding(mesh, P()))}
    assert mgr.restore(state) == 0
    assert state["z"].shape == (0, 8) and state["z2"].shape == (8, 0)
    assert bits(state["s"]) == bits(s)


def test_sharded_bf16_int4_keys_cli_ls_inspect_verify(manager, tmp_path):
    import subprocess
    import sys
    mesh = Mesh(np.array(DEV).reshape(4, 2), ("x", "y"))
    mgr = manager()
    mgr.save(3, {"w": jax.device_put(val((8, 4), jnp.bfloat16), NamedSharding(mesh, P("x", "y"))),
                 "q": jax.device_put(jnp.ones((8, 2), jnp.int4), NamedSharding(mesh, P("x"))),
                 "k": jax.device_put(jax.random.split(jax.random.key(0, impl="rbg"), 8),
                                     NamedSharding(mesh, P("x")))},
             metrics={"loss": 0.5}).wait()
    d = str(tmp_path / "ckpt")
    for cmd in (["ls", d], ["inspect", d], ["verify", d], ["inspect", "--help"]):
        r = subprocess.run([sys.executable, "-m", "pitstop.cli", *cmd], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, (cmd, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr, (cmd, r.stderr)
        if cmd == ["inspect", d]:
            assert "w" in r.stdout and "bfloat16" in r.stdout, r.stdout
            assert "int4" in r.stdout, r.stdout


# --- nnx -----------------------------------------------------------------------------------

class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(3, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.bn(self.lin(x)))))


X = jnp.linspace(-1, 1, 24, dtype=jnp.float32).reshape(8, 3)
Y = jnp.sin(X.sum(1, keepdims=True))


def _loss(model):
    return jnp.mean((model(X) - Y) ** 2)


@nnx.jit
def _train_step(model, opt):
    loss, grads = nnx.value_and_grad(_loss)(model)
    opt.update(model, grads)
    return loss


def _make(seed: int):
    model = Net(nnx.Rngs(seed, dropout=seed + 1))
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    return model, opt


def test_nnx_model_and_optimizer_restored_in_place_continue_identically(manager):
    a_model, a_opt = _make(0)
    for _ in range(3):
        _train_step(a_model, a_opt)
    mgr = manager()
    mgr.save(3, {"model": a_model, "opt": a_opt}).wait()
    b_model, b_opt = _make(42)
    state = {"model": b_model, "opt": b_opt}
    assert mgr.restore(state) == 3
    assert state["model"] is b_model and state["opt"] is b_opt
    la = [float(_train_step(a_model, a_opt)) for _ in range(3)]
    lb = [float(_train_step(b_model, b_opt)) for _ in range(3)]
    assert la == lb
    assert [bits(x) for x in jax.tree.leaves(nnx.state(a_model))] == \
        [bits(x) for x in jax.tree.leaves(nnx.state(b_model))]
    assert [bits(x) for x in jax.tree.leaves(nnx.state(a_opt))] == \
        [bits(x) for x in jax.tree.leaves(nnx.state(b_opt))]


def test_nnx_model_eval_mode_flag_is_restored_or_kept_consistently(manager):
    """Dropout/BatchNorm 'deterministic'/'use_running_average' attributes are static
    module attributes; restoring the arrays must not crash on them."""
    m, _ = _make(0)
    m.eval()
    mgr = manager()
    mgr.save(0, {"model": m}).wait()
    t, _ = _make(1)
    assert mgr.restore({"model": t}) == 0
    t.eval()
    assert bits(t(X)) == bits(m(X))


def test_nnx_model_with_another_shape_is_refused_and_left_unchanged(manager):
    m, _ = _make(0)
    mgr = manager()
    mgr.save(0, {"model": m}).wait()
    other = Net(nnx.Rngs(5, dropout=6))
    other.out = nnx.Linear(8, 2, rngs=nnx.Rngs(1))
    before = [bits(x) for x in jax.tree.leaves(nnx.state(other))]
    with pytest.raises(pitstop.IncompatibleTargetError, match="out"):
        mgr.restore({"model": other})
    assert [bits(x) for x in jax.tree.leaves(nnx.state(other))] == before


def test_nnx_module_root_load_target(manager):
    m, _ = _make(0)
    mgr = manager()
    mgr.save(0, {"model": m}).wait()
    t, _ = _make(3)
    got = mgr.load(target={"model": t})
    assert isinstance(got["model"], Net)
    assert bits(got["model"](X)) == bits(m(X))


def test_nnx_rngs_object_in_state_draws_the_same_after_restore(manager):
    rngs = nnx.Rngs(0, dropout=1)
    rngs.dropout()  # the counter moves on
    mgr = manager()
    mgr.save(0, {"rngs": rngs}).wait()
    want = bits(jax.random.key_data(rngs.dropout()))
    other = nnx.Rngs(7, dropout=8)
    state = {"rngs": other}
    assert mgr.restore(state) == 0
    got = bits(jax.random.key_data(state["rngs"].dropout()))
    assert got == want


# --- many tiny arrays -------------------------------------------------------------------------

def test_many_tiny_arrays_save_and_restore(manager):
    """Many small arrays (their speed is measured by benchmarks/, not here)."""
    n = 10_000
    leaves = np.arange(n, dtype=np.float32)
    tree = {"p": {f"a{i}": jnp.asarray(leaves[i:i + 1]) for i in range(n)}}
    mgr = manager()
    mgr.save(0, tree).wait()
    target = {"p": {f"a{i}": jnp.zeros(1, jnp.float32) for i in range(n)}}
    assert mgr.restore(target) == 0
    assert float(target["p"][f"a{n - 1}"][0]) == n - 1
    assert float(target["p"]["a1234"][0]) == 1234.0


def test_nnx_rngs_is_not_taken_for_torch_style_state_when_torch_is_loaded(tmp_path):
    """``nnx.Rngs`` answers any attribute with a random stream, so it "has" state_dict and
    load_state_dict; with the torch adapter loaded in the same process it must still go to
    the JAX adapter (a torch + flax process), not to torch's state_dict adapter."""
    pytest.importorskip("torch")
    import subprocess
    import sys
    code = ("import pitstop.adapters.torch, sys, pytest; sys.exit(pytest.main(['-q', '-x', "
            "'-p', 'no:cacheprovider', __file__ + '::test_nnx_rngs_object_in_state_draws_the_"
            "same_after_restore']))")
    r = subprocess.run([sys.executable, "-c", code.replace("__file__", repr(__file__))],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
