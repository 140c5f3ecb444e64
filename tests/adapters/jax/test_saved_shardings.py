"""Targets that leave placement or dtype open, beside Orbax: a ``jax.eval_shape`` target
(``ShapeDtypeStruct`` leaves without a sharding) restores with the shardings the save
recorded, as Orbax's ``StandardRestore`` does; ``load_arrays`` gives ``jax.Array``s placed as
saved, as Orbax's ``restore(step)``; another floating dtype converts only inside
``allow_dtype_cast`` (Orbax casts always), with the same bits as Orbax's cast."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pitstop
from pitstop.adapters.jax import abstract_state, allow_dtype_cast, load_arrays
from pitstop.core.format.seal import seal

ocp = pytest.importorskip("orbax.checkpoint")
DEVICES = jax.devices()
pytestmark = pytest.mark.skipif(len(DEVICES) < 8, reason="needs 8 host devices (XLA_FLAGS)")


def state() -> dict:
    mesh = Mesh(np.array(DEVICES).reshape(4, 2), ("data", "model"))
    rows = NamedSharding(Mesh(np.array(DEVICES[::-1]), ("x",)), P("x"))  # devices reordered
    return {"params": {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8) / 3,
                                           NamedSharding(mesh, P("data", "model"))),
                       "v": jax.device_put(jnp.arange(16.0) / 7, NamedSharding(mesh, P(("data", "model")))),
                       "r": jax.device_put(jnp.ones(4), NamedSharding(mesh, P()))},
            "e": jax.device_put(jnp.arange(32.0).reshape(8, 4) / 9, rows),
            "one": jnp.arange(3.0)}  # one device, uncommitted


def layout(x) -> tuple:
    s = x.sharding
    if isinstance(s, NamedSharding):
        return (dict(s.mesh.shape), [d.id for d in s.mesh.devices.flat], tuple(s.spec))
    return (type(s).__name__, sorted(d.id for d in s.device_set))


def both(tmp_path: Path, st: dict) -> tuple[str, str]:
    """The same state saved as step 1 by Orbax's manager and by pitstop's."""
    odir, pdir = os.path.abspath(tmp_path / "orbax"), str(tmp_path / "pitstop")
    with ocp.CheckpointManager(odir) as omgr:
        omgr.save(1, args=ocp.args.StandardSave(st))
        omgr.wait_until_finished()
    with pitstop.CheckpointManager(pdir, memory_tier=False) as mgr:
        mgr.save(1, st).wait()
    return odir, pdir


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[dict, str, str]:
    st = state()
    return (st, *both(tmp_path_factory.mktemp("saved"), st))


def test_eval_shape_target_and_no_target_get_the_saved_shardings_as_with_orbax(saved):
    st, odir, pdir = saved
    abstract = jax.eval_shape(lambda: st)
    assert all(x.sharding is None for x in jax.tree.leaves(abstract))
    with ocp.CheckpointManager(odir) as omgr:
        o_target = omgr.restore(1, args=ocp.args.StandardRestore(abstract))
        o_plain = omgr.restore(1)
    with pitstop.CheckpointManager(pdir, read_only=True) as mgr:
        p_target = mgr.load(target=abstract)
        p_plain = load_arrays(mgr)
        numpy = mgr.load()
    want = jax.tree.map(layout, st)
    # the sharded arrays: the saved mesh (its devices in their order) and partition spec
    for got in (p_target, p_plain, o_target, o_plain):
        assert jax.tree.map(layout, got)["params"] == want["params"]
        assert jax.tree.map(layout, got)["e"] == want["e"]
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(st), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # pitstop's structs carry them too (Orbax's item_metadata), and load() stays numpy
    assert abstract_state(mgr)["params"]["w"].sharding == st["params"]["w"].sharding
    assert isinstance(numpy["params"]["w"], np.ndarray)
    # an array on one device: the default device, as saved
    assert layout(p_target["one"]) == layout(p_plain["one"]) == ("SingleDeviceSharding", [0])


def test_a_recorded_mesh_this_job_cannot_hold_is_refused_naming_what_to_pass(saved, tmp_path):
    st, _odir, pdir = saved
    d = tmp_path / "edited"
    with pitstop.CheckpointManager(d, memory_tier=False) as mgr:
        mgr.save(1, st).wait()
    path = d / "step_0000000001" / "manifest.json"
    doc = json.loads(path.read_bytes())
    doc.pop("manifest_hash")
    rec = doc["layouts"]["params/w"]
    rec.update(mesh_shape=[4, 4], devices=list(range(16)))  # a job of 16 devices saved it
    path.write_bytes(seal(json.dumps(doc, separators=(",", ":")).encode(),
                          doc["hash_algorithm"]))
    abstract = jax.eval_shape(lambda: st)
    with pitstop.CheckpointManager(d, read_only=True) as mgr:
        with pytest.raises(pitstop.IncompatibleTargetError) as e:
            mgr.load(target=abstract)
        text = str(e.value)
        assert "'params/w'" in text and "NamedSharding(mesh {'data': 4, 'model': 4}, " \
            "P('data', 'model'))" in text and "16 devices and this job has 8" in text
        assert "sharding=NamedSharding(" in text
        with pytest.raises(pitstop.UnsupportedStateError, match="'params/w'.*16 devices"):
            load_arrays(mgr)
        # a sharding of this job's devices, given for that array, is used
        mesh = Mesh(np.array(DEVICES).reshape(4, 2), ("data", "model"))
        abstract["params"]["w"] = jax.ShapeDtypeStruct(
            (8, 8), jnp.float32, sharding=NamedSharding(mesh, P(None, "model")))
        got = mgr.load(target=abstract)["params"]["w"]
        assert got.sharding == abstract["params"]["w"].sharding


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_another_floating_dtype_converts_only_when_asked_with_orbax_s_bits(saved, dtype):
    st, odir, pdir = saved
    abstract = jax.eval_shape(lambda: st)
    abstract["params"]["w"] = jax.ShapeDtypeStruct((8, 8), dtype)
    abstract["e"] = jax.ShapeDtypeStruct((8, 4), dtype, sharding=st["e"].sharding)
    with ocp.CheckpointManager(odir) as omgr:  # Orbax casts without being asked
        theirs = omgr.restore(1, args=ocp.args.StandardRestore(abstract))
    with pitstop.CheckpointManager(pdir, read_only=True) as mgr:
        with pytest.raises(pitstop.IncompatibleTargetError, match=(
                r"(?s)'params/w' \(checkpoint float32\[8, 8\], target \w+\[8, 8\]\).*\n  To "
                r"convert it on restore, as Orbax's ArrayRestoreArgs.*allow_dtype_cast")):
            mgr.load(target=abstract)
        with allow_dtype_cast():
            mine = mgr.load(target=abstract)
        live = jax.tree.map(jnp.zeros_like, st)
        live["params"]["w"] = jax.device_put(jnp.zeros((8, 8), dtype), st["params"]["w"].sharding)
        live["e"] = jax.device_put(jnp.zeros((8, 4), dtype), st["e"].sharding)
        with allow_dtype_cast():  # restore() of live arrays too
            assert mgr.restore(live) == 1
        with allow_dtype_cast(), pytest.raises(pitstop.IncompatibleTargetError,
                                               match="checkpoint float32.*target int32"):
            mgr.load(target={**abstract, "one": jax.ShapeDtypeStruct((3,), jnp.int32)})
    for got in (mine, theirs, live):
        w = got["params"]["w"]
        assert w.dtype == dtype and got["e"].dtype == dtype
        assert layout(got["e"]) == layout(st["e"])
    assert layout(mine["params"]["w"]) == layout(theirs["params"]["w"]) == layout(st["params"]["w"])
    for key in (("params", "w"), ("e",)):
        a, b, c = (np.asarray(t[key[0]][key[1]] if len(key) == 2 else t[key[0]])
                   for t in (mine, theirs, live))
        assert a.tobytes() == b.tobytes() == c.tobytes()  # bitwise Orbax's rounding
