"""Probes: Orbax import/export misuse, SIGTERM in a jitted loop,
strict=False reports, rolled-back runs, the CLI on rich JAX checkpoints, load targets."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pitstop

ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _ts(seed=0):
    params = {"w": jnp.arange(6.0).reshape(2, 3) + seed, "b": jnp.zeros(3)}
    return train_state.TrainState.create(apply_fn=lambda p, x: x, params=params,
                                         tx=optax.adam(1e-2))


def _mgr(d, **kw):
    kw.setdefault("save_on_signals", None)
    kw.setdefault("memory_tier", False)
    return pitstop.CheckpointManager(d, **kw)


# --------------------------------------------------------------------- Orbax export / import
def test_export_train_state_with_typed_key_orbax_restores_into_abstract_train_state(tmp_path):
    import orbax.checkpoint as ocp
    ts = _ts()
    state = {"ts": ts, "key": jax.random.key(3)}
    with _mgr(tmp_path / "p") as m:
        m.save(1, state).wait()
    export_orbax = pitstop.adapters.jax.export_orbax
    abstract = jax.eval_shape(lambda: state)
    # Optax states are namedtuples, which pitstop keys by position: the target gives Orbax
    # the field names (docs/jax.md)
    path = export_orbax(tmp_path / "p", 1, tmp_path / "o", target=abstract)
    got = ocp.StandardCheckpointer().restore(path, abstract)
    assert isinstance(got["ts"], train_state.TrainState)
    np.testing.assert_array_equal(got["ts"].params["w"], ts.params["w"])
    assert jnp.issubdtype(got["key"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(got["key"]),
                                  jax.random.key_data(state["key"]))


def test_import_into_a_dir_locked_by_a_live_manager_is_refused_nothing_written(tmp_path):
    import orbax.checkpoint as ocp

    from pitstop.adapters.jax import import_orbax
    with ocp.CheckpointManager(os.fspath(tmp_path / "o")) as om:
        om.save(5, args=ocp.args.StandardSave({"w": np.ones(3, np.float32)}))
        om.wait_until_finished()
    live = _mgr(tmp_path / "p")
    try:
        live.save(1, {"w": np.zeros(3, np.float32)}).wait()
        with pytest.raises(pitstop.CheckpointError) as ei:
            import_orbax(tmp_path / "o", tmp_path / "p")
        assert "lock" in str(ei.value).lower()
        assert live.all_steps() == [1]
    finally:
        live.close()
    with _mgr(tmp_path / "p", read_only=True) as m:
        assert m.all_steps() == [1]


def test_export_sharded_then_orbax_restores_into_sharded_target(tmp_path):
    import orbax.checkpoint as ocp

    from pitstop.adapters.jax import export_orbax
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("d", "m"))
    w = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("d", "m")))
    with _mgr(tmp_path / "p") as m:
        m.save(2, {"w": w}).wait()
    path = export_orbax(tmp_path / "p", 2, tmp_path / "o")
    tgt_sh = NamedSharding(mesh, P(None, "d"))
    abstract = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=tgt_sh)}
    got = ocp.StandardCheckpointer().restore(path, abstract)
    assert got["w"].sharding == tgt_sh
    np.testing.assert_array_equal(got["w"], w)


def test_import_with_wrong_target_structure_is_clear_and_writes_nothing(tmp_path):
    import orbax.checkpoint as ocp

    from pitstop.adapters.jax import import_orbax
    tree = {"params": {"w": np.ones((2, 3), np.float32)}, "step": np.int32(3)}
    with ocp.CheckpointManager(os.fspath(tmp_path / "o")) as om:
        om.save(3, args=ocp.args.StandardSave(tree))
        om.wait_until_finished()
    wrong = {"params": {"w": np.ones((2, 3), np.float32), "extra": np.ones(2, np.float32)},
             "step": np.int32(0)}
    with pytest.raises(pitstop.IncompatibleTargetError) as ei:
        import_orbax(tmp_path / "o", tmp_path / "p", target=wrong)
    assert "extra" in str(ei.value)
    assert not (tmp_path / "p").exists() or not any(
        p for p in (tmp_path / "p").rglob("*") if p.is_file() and "lock" not in p.name), \
        list((tmp_path / "p").rglob("*"))


def test_import_and_export_with_relative_paths(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    from pitstop.adapters.jax import export_orbax, import_orbax
    monkeypatch.chdir(tmp_path)
    tree = {"w": np.arange(4, dtype=np.float32)}
    with ocp.CheckpointManager(os.path.abspath("o")) as om:
        om.save(1, args=ocp.args.StandardSave(tree))
        om.wait_until_finished()
    assert import_orbax("o", "p") == [1]
    assert import_orbax("./o/1", "sub/../p2", step=9) == [9]
    path = export_orbax("p", 1, "back")
    assert os.path.isabs(path) or os.path.isdir(path)
    np.testing.assert_array_equal(ocp.StandardCheckpointer().restore(os.path.abspath(path))["w"],
                                  tree["w"])
    with _mgr("p2", read_only=True) as m:
        np.testing.assert_array_equal(m.load(9)["w"], tree["w"])


# --------------------------------------------------------------------- SIGTERM mid-run
_TRAIN = textwrap.dedent("""
    import hashlib, sys
    import jax, jax.numpy as jnp, numpy as np
    import pitstop
    @jax.jit
    def upd(p, key):
        key, sub = jax.random.split(key)
        return jax.tree.map(lambda a: a * 0.99 + jax.random.normal(sub, a.shape) * 0.01, p), key
    def h(state):
        return hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in
            jax.tree.leaves({"p": state["params"], "k": jax.random.key_data(state["key"])}))).hexdigest()
    state = {"params": {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}, "key": jax.random.key(1)}
    mgr = pitstop.CheckpointManager(sys.argv[1], save_every_steps=5)
    start = mgr.restore(state)
    print("start", start, h(state), flush=True)
    if start is not None:
        mgr.close(); sys.exit(0)
    for step in range(0, 1000):
        state["params"], state["key"] = upd(state["params"], state["key"])
        print("step", step, h(state), flush=True)
        sys.stdin.readline()
        mgr.step(step, state)
    print("finished", flush=True)
""")


def test_sigterm_in_jitted_loop_saves_current_step_and_resume_is_bit_identical(tmp_path):
    d = tmp_path / "c"
    p = subprocess.Popen([sys.executable, "-c", _TRAIN, str(d)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=ENV)
    try:
        assert p.stdout.readline().startswith("start None")
        hashes = {}
        while True:
            line = p.stdout.readline()
            assert line, p.stderr.read()
            _, s, hx = line.split()
            hashes[int(s)] = hx
            if int(s) == 7:
                p.send_signal(signal.SIGTERM)
            p.stdin.write("\n")
            p.stdin.flush()
            if int(s) == 7:
                break
        rest = p.stdout.read()
        p.wait(timeout=120)
        err = p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
    assert "finished" not in rest
    assert p.returncode == -signal.SIGTERM, (p.returncode, err[-3000:])
    r = subprocess.run([sys.executable, "-c", _TRAIN, str(d)], capture_output=True, text=True,
                       cwd=ROOT, env=ENV, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    first = r.stdout.splitlines()[0].split()
    assert first[1] == "7", (first, err[-2000:])
    assert first[2] == hashes[7]


# --------------------------------------------------------------------- strict=False
def test_strict_false_reports_missing_and_unexpected_and_leaves_unmatched_objects(tmp_path):
    with _mgr(tmp_path / "c") as m:
        m.save(1, {"params": {"w": jnp.ones(3), "b": jnp.ones(2)}, "key": jax.random.key(1)}
               ).wait()
        extra = jnp.full(5, 7.0)
        ex_key = jax.random.key(9)
        state = {"params": {"w": jnp.zeros(3)}, "extra": extra, "key": ex_key,
                 "more": {"z": jnp.zeros(1)}}
        more = state["more"]
        r = m.restore(state, strict=False)
        assert r == 1
        assert any("extra" in k for k in r.missing_keys), r.missing_keys
        assert any("more" in k for k in r.missing_keys), r.missing_keys
        assert any(k.endswith("b") for k in r.unexpected_keys), r.unexpected_keys
        assert not any("extra" in k for k in r.unexpected_keys)
        assert state["extra"] is extra
        assert state["more"] is more
        np.testing.assert_array_equal(state["params"]["w"], np.ones(3))
        np.testing.assert_array_equal(jax.random.key_data(state["key"]),
                                      jax.random.key_data(jax.random.key(1)))


# --------------------------------------------------------------------- rolled-back run
def test_restore_older_step_then_save_next_step_with_jax_state(tmp_path):
    d = tmp_path / "c"
    with _mgr(d) as m:
        for s in range(5):
            m.save(s, {"w": jnp.full(3, float(s)), "key": jax.random.key(s)}).wait()
    with _mgr(d) as m:
        state = {"w": jnp.zeros(3), "key": jax.random.key(0)}
        assert m.restore(state, step=2) == 2
        np.testing.assert_array_equal(state["w"], np.full(3, 2.0))
        state["w"] = state["w"] + 100
        m.save(3, state).wait()                     # the rolled-back run's next step
        assert m.latest_step() == 3
        assert 4 not in m.all_steps()
        fresh = {"w": jnp.zeros(3), "key": jax.random.key(0)}
        assert m.restore(fresh) == 3
        np.testing.assert_array_equal(fresh["w"], np.full(3, 102.0))
        np.testing.assert_array_equal(jax.random.key_data(fresh["key"]),
                                      jax.random.key_data(jax.random.key(2)))
    with _mgr(d, read_only=True) as m:
        assert m.latest_step() == 3
        np.testing.assert_array_equal(m.load()["w"], np.full(3, 102.0))


def test_step_after_rollback_with_step_policy(tmp_path):
    d = tmp_path / "c"
    with _mgr(d, save_every_steps=1, on_busy="wait") as m:
        for s in range(4):
            m.step(s, {"w": jnp.full(2, float(s))})
    with _mgr(d, save_every_steps=1, on_busy="wait") as m:
        state = {"w": jnp.zeros(2)}
        assert m.restore(state, step=1) == 1
        h = m.step(2, {"w": state["w"] + 10})
        assert h is not None
        h.wait()
        assert m.latest_step() == 2
        np.testing.assert_array_equal(m.load()["w"], np.full(2, 11.0))


# --------------------------------------------------------------------- CLI
def test_cli_on_typed_keys_train_state_and_sharded_array(tmp_path):
    d = tmp_path / "c"
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("d", "m"))
    w = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("d", "m")))
    with _mgr(d) as m:
        m.save(4, {"ts": _ts(), "key": jax.random.key(0, impl="rbg"),
                   "keys": jax.random.split(jax.random.key(1), 3), "w": w}).wait()
    outs = {}
    for cmd in (["ls"], ["inspect"], ["verify"], ["inspect", "--step", "4"]):
        r = subprocess.run([sys.executable, "-m", "pitstop.cli", *cmd[:1], str(d), *cmd[1:]],
                           capture_output=True, text=True, cwd=ROOT, timeout=120, env=ENV)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (cmd, r.stderr[-3000:])
        outs[" ".join(cmd)] = r.stdout
    assert "8 shards" in outs["inspect"], outs["inspect"]
    assert "4" in outs["ls"]


# --------------------------------------------------------------------- load targets
def test_load_into_shape_dtype_structs_on_a_device_subset_mesh(tmp_path):
    mesh8 = Mesh(np.array(jax.devices()).reshape(8), ("x",))
    w = jax.device_put(jnp.arange(48.0).reshape(8, 6), NamedSharding(mesh8, P("x")))
    k = jax.random.split(jax.random.key(0), 4)
    with _mgr(tmp_path / "c") as m:
        m.save(1, {"w": w, "k": k}).wait()
        sub = Mesh(np.array(jax.devices()[5:7]).reshape(2), ("y",))
        tgt = {"w": jax.ShapeDtypeStruct((8, 6), jnp.float32, sharding=NamedSharding(sub, P(None, "y"))),
               "k": jax.ShapeDtypeStruct(k.shape, k.dtype, sharding=NamedSharding(sub, P("y")))}
        got = m.load(target=tgt)
    assert got["w"].sharding == tgt["w"].sharding
    assert set(got["w"].devices()) == set(jax.devices()[5:7])
    np.testing.assert_array_equal(got["w"], w)
    assert got["k"].sharding == tgt["k"].sharding
    np.testing.assert_array_equal(jax.random.key_data(got["k"]), jax.random.key_data(k))


def test_load_into_a_target_mixing_jax_numpy_and_python_scalars(tmp_path):
    with _mgr(tmp_path / "c") as m:
        m.save(1, {"a": jnp.arange(3.0), "b": np.arange(4, dtype=np.int32), "c": 3, "d": 0.5,
                   "e": jnp.float32(2.0), "f": True}).wait()
        dev = jax.devices()[3]
        tgt = {"a": jax.device_put(jnp.zeros(3), dev), "b": np.zeros(4, np.int32), "c": 0,
               "d": 0.0, "e": jnp.float32(0), "f": False}
        got = m.load(target=tgt)
        # also cross kinds: numpy target for a jax-saved array and vice versa
        tgt2 = {"a": np.zeros(3, np.float32), "b": jnp.zeros(4, jnp.int32), "c": 0, "d": 0.0,
                "e": np.float32(0), "f": False}
        got2 = m.load(target=tgt2)
    assert isinstance(got["a"], jax.Array) and got["a"].devices() == {dev}
    np.testing.assert_array_equal(got["a"], np.arange(3.0))
    assert isinstance(got["b"], np.ndarray)
    np.testing.assert_array_equal(got["b"], np.arange(4))
    assert got["c"] == 3 and type(got["c"]) is int
    assert got["d"] == 0.5 and type(got["d"]) is float
    assert got["f"] is True
    assert float(got["e"]) == 2.0
    assert tgt["c"] == 0 and float(tgt["a"][0]) == 0.0
    assert isinstance(got2["a"], np.ndarray) and isinstance(got2["b"], jax.Array)
    np.testing.assert_array_equal(got2["b"], np.arange(4))


def test_export_optax_namedtuple_state_restores_with_orbax_into_abstract_target(tmp_path):
    import orbax.checkpoint as ocp

    from pitstop.adapters.jax import export_orbax
    params = {"w": jnp.arange(3.0)}
    opt = optax.adam(1e-2).init(params)
    with _mgr(tmp_path / "p") as m:
        m.save(1, {"opt": opt}).wait()
    abstract = jax.eval_shape(lambda: {"opt": opt})
    path = export_orbax(tmp_path / "p", 1, tmp_path / "o", target=abstract)
    got = ocp.StandardCheckpointer().restore(path, abstract)
    assert type(got["opt"][0]) is type(opt[0])
