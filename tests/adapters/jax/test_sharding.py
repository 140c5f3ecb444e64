"""Sharded ``jax.Array`` saves: shard by shard, each distinct shard once, global shape and
shard indices in the manifest; restores into the same sharding or another (resharding)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pitstop
from pitstop.core.format.seal import seal

ROOT = Path(__file__).resolve().parents[3]
DEVICES = jax.devices()
pytestmark = pytest.mark.skipif(len(DEVICES) < 8, reason="needs 8 host devices (XLA_FLAGS)")


def mesh_1d() -> Mesh:
    return Mesh(np.array(DEVICES), ("x",))


def mesh_2d() -> Mesh:
    return Mesh(np.array(DEVICES).reshape(4, 2), ("x", "y"))


def sharding(name: str):
    return {
        "rows8": NamedSharding(mesh_1d(), P("x")),
        "cols8": NamedSharding(mesh_1d(), P(None, "x")),
        "grid": NamedSharding(mesh_2d(), P("x", "y")),
        "rows4_rep2": NamedSharding(mesh_2d(), P("x")),     # each row block on 2 devices
        "replicated": NamedSharding(mesh_2d(), P()),
        "single": jax.sharding.SingleDeviceSharding(DEVICES[3]),
    }[name]


def value(dtype=jnp.float32) -> jax.Array:
    return (jnp.arange(16 * 24, dtype=jnp.float32).reshape(16, 24) * 0.5).astype(dtype)


def open_mgr(d, **kw) -> pitstop.CheckpointManager:
    opts = dict(async_save=False, save_on_signals=None, memory_tier=False)
    opts.update(kw)
    return pitstop.CheckpointManager(d, **opts)


def same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize(("saved", "n_shards"), [
    ("rows8", 8), ("cols8", 8), ("grid", 8), ("rows4_rep2", 4), ("replicated", 0)])
def test_each_distinct_shard_is_written_once(tmp_path, saved, n_shards):
    x = jax.device_put(value(), sharding(saved))
    with open_mgr(tmp_path / "c") as mgr:
        mgr.save(1, {"w": x})
        entry = mgr.metadata(1).arrays["w"]
    assert entry.shape == [16, 24]
    if n_shards == 0:  # fully replicated: one copy, stored as a whole array
        assert entry.shards is None and entry.length == x.nbytes
        return
    assert entry.shards is not None and len(entry.shards) == n_shards
    assert sum(s.length for s in entry.shards) == x.nbytes  # replicas not duplicated
    want = sorted(tuple((sl.start or 0, sl.stop or n) for sl, n in zip(s.index, x.shape, strict=True))
                  for s in x.addressable_shards)
    assert sorted(tuple(map(tuple, s.index)) for s in entry.shards) == sorted(set(want))
    doc = json.loads((tmp_path / "c" / "step_0000000001" / "manifest.json").read_bytes())
    assert doc["format_version"] == "2.0" and "shards" in doc["arrays"]["w"]


PAIRS = [("grid", "grid"), ("rows8", "grid"), ("grid", "cols8"), ("cols8", "replicated"),
         ("replicated", "rows4_rep2"), ("rows4_rep2", "single"), ("single", "grid")]


@pytest.mark.parametrize(("saved", "target"), PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_restore_reshards(tmp_path, saved, target):
    x = jax.device_put(value(jnp.bfloat16), sharding(saved))
    with open_mgr(tmp_path / "c") as mgr:
        mgr.save(1, {"w": x, "step": 1})
        live = {"w": jax.device_put(jnp.zeros((16, 24), jnp.bfloat16), sharding(target)),
                "step": 0}
        assert mgr.restore(live) == 1
        assert live["w"].sharding == sharding(target) and same(live["w"], x)
        assert live["step"] == 1
        spec = jax.ShapeDtypeStruct((16, 24), jnp.bfloat16, sharding=sharding(target))
        got = mgr.load(target={"w": spec, "step": 0})
        assert got["w"].sharding == sharding(target) and same(got["w"], x)
        plain = mgr.load()  # no target: one global numpy array, as before
        assert isinstance(plain["w"], np.ndarray) and same(plain["w"], x)


def test_restore_reads_only_the_shards_a_device_needs(tmp_path, monkeypatch):
    x = jax.device_put(value(), sharding("rows8"))
    with open_mgr(tmp_path / "c") as mgr:
        mgr.save(1, {"w": x})
        from pitstop.core.restore import read as reader_mod
        reads = []
        real = reader_mod.CheckpointReader.read_array

        def counting(self, key, entry, out=None):
            if entry.index is not None:
                reads.append(tuple(map(tuple, entry.index)))
            return real(self, key, entry, out)

        monkeypatch.setattr(reader_mod.CheckpointReader, "read_array", counting)
        live = {"w": jax.device_put(jnp.zeros((16, 24)), sharding("rows8"))}
        mgr.restore(live)
    assert sorted(reads) == sorted(set(reads)) and len(reads) == 8  # each shard read once
    assert same(live["w"], x)


def test_a_corrupt_shard_is_named_and_the_previous_step_used(tmp_path):
    d = tmp_path / "c"
    with open_mgr(d) as mgr:
        mgr.save(1, {"w": jax.device_put(value(), sharding("grid"))})
        mgr.save(2, {"w": jax.device_put(value() + 1, sharding("grid"))})
        entry = mgr.metadata(2).arrays["w"].shards[5]
    path = d / "step_0000000002" / entry.file
    data = bytearray(path.read_bytes())
    data[entry.offset + 3] ^= 0xFF
    path.write_bytes(bytes(data))
    with open_mgr(d) as mgr:
        live = {"w": jax.device_put(jnp.zeros((16, 24)), sharding("grid"))}
        with pytest.warns(UserWarning, match="'w'"):
            assert mgr.restore(live) == 1
        assert same(live["w"], value())
    assert [p.name for p in d.iterdir() if ".corrupt-" in p.name]  # moved aside, not deleted


@pytest.mark.parametrize("edit", ["overlap", "gap", "outside"])
def test_shards_that_do_not_tile_the_array_are_corruption(tmp_path, edit):
    d = tmp_path / "c"
    with open_mgr(d) as mgr:
        mgr.save(1, {"w": jax.device_put(value(), sharding("rows8"))})
    path = d / "step_0000000001" / "manifest.json"
    doc = json.loads(path.read_bytes())
    doc.pop("manifest_hash")
    shards = doc["arrays"]["w"]["shards"]
    if edit == "overlap":
        shards[1]["index"] = shards[0]["index"]
    elif edit == "gap":
        del shards[-1]
    else:
        shards[0]["index"] = [[0, 2], [20, 26]]
    path.write_bytes(seal(json.dumps(doc, separators=(",", ":")).encode(), doc["hash_algorithm"]))
    with open_mgr(d) as mgr:
        with pytest.raises(pitstop.CorruptCheckpointError, match="'w'"):
            mgr.load(step=1)
    r = subprocess.run([sys.executable, "-m", "pitstop.cli", "verify", str(d)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr


def test_cli_inspect_and_verify_show_shards(tmp_path):
    d = tmp_path / "c"
    with open_mgr(d) as mgr:
        mgr.save(3, {"w": jax.device_put(value(), sharding("grid"))})
    for cmd in ("inspect", "verify"):
        r = subprocess.run([sys.executable, "-m", "pitstop.cli", cmd, str(d)],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert r.returncode == 0, r.stderr
    assert "8 shards" in subprocess.run(
        [sys.executable, "-m", "pitstop.cli", "inspect", str(d)], capture_output=True,
        text=True, cwd=ROOT, timeout=120).stdout


_KILLED = textwrap.dedent("""
    import os, signal, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import pitstop
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    mgr = pitstop.CheckpointManager(sys.argv[1], save_on_signals=None)
    w = jax.device_put(jnp.arange(16 * 24, dtype=jnp.float32).reshape(16, 24),
                       NamedSharding(mesh, P("x", "y")))
    mgr.save(1, {"w": w}).wait()
    mgr.save(2, {"w": w * 2})             # returns after the snapshot
    os.kill(os.getpid(), signal.SIGKILL)  # before that save commits
""")


def test_sigkill_after_a_sharded_snapshot_restores_it_from_memory(tmp_path):
    d = tmp_path / "c"
    r = subprocess.run([sys.executable, "-c", _KILLED, str(d)], capture_output=True,
                       text=True, timeout=120, cwd=ROOT, env=os.environ.copy())
    assert r.returncode == -signal.SIGKILL, r.stderr
    mgr = pitstop.CheckpointManager(d, save_on_signals=None)
    try:
        live = {"w": jax.device_put(jnp.zeros((16, 24)), sharding("cols8"))}
        assert mgr.restore(live) == 2
        assert same(live["w"], jnp.arange(16 * 24, dtype=jnp.float32).reshape(16, 24) * 2)
        # a target without a sharding: placed as saved, from memory and once persisted
        bare = {"w": jax.ShapeDtypeStruct((16, 24), jnp.float32)}
        assert mgr.load(2, target=bare)["w"].sharding.spec == P("x", "y")
        mgr.wait()
        assert mgr.metadata(2).arrays["w"].shards is not None  # persisted shard by shard
        assert mgr.metadata(2).layouts["w"]["spec"] == ["x", "y"]
        assert mgr.load(2, target=bare)["w"].sharding.spec == P("x", "y")
    finally:
        mgr.close()


def test_the_format_pages_numpy_reader_and_schema_read_a_sharded_checkpoint(tmp_path):
    """docs/format.md's reader (numpy only) and manifest.schema.json know format 2.0."""
    import re

    jsonschema = pytest.importorskip("jsonschema")
    page = (ROOT / "docs" / "format.md").read_text()
    src, = re.findall(r"```python\n(.*?)```", page, re.S)
    ns: dict = {"__name__": "format_md_reader"}
    exec(compile(src, "docs/format.md", "exec"), ns)
    x = jax.device_put(value(jnp.bfloat16), sharding("grid"))
    with open_mgr(tmp_path / "c") as mgr:
        mgr.save(4, {"w": x, "b": np.arange(3)})
    ckpt = ns["latest"](str(tmp_path / "c"))
    got = ns["load"](ckpt)
    assert same(got["w"].view(np.uint16), np.asarray(x).view(np.uint16))
    schema = json.loads((ROOT / "docs" / "manifest.schema.json").read_text())
    manifest = json.loads((Path(ckpt) / "manifest.json").read_text())
    assert not list(jsonschema.Draft202012Validator(schema).iter_errors(manifest))


def test_shards_spread_over_several_data_files_read_back_whole_every_time(tmp_path):
    """With two writer threads the shards of one array land in two data files, which the
    restore reads one thread per file: a file read by two threads must never hand one of
    them the other's bytes (a valid checkpoint was once reported corrupt and moved aside)."""
    x = jax.device_put(value(), sharding("grid"))
    keys = jax.device_put(jax.random.split(jax.random.key(0), 8), sharding("rows8"))
    with open_mgr(tmp_path / "c", writer_threads=2) as mgr:
        mgr.save(0, {"x": x, "k": keys})
        files = {s.file for s in mgr.metadata(0).arrays["x"].shards}
        assert len(files) == 2  # the case this test is about
        for _ in range(20):
            live = {"x": jax.device_put(jnp.zeros((16, 24)), sharding("cols8")),
                    "k": jax.device_put(jax.random.split(jax.random.key(9), 8),
                                        sharding("rows4_rep2"))}
            assert mgr.restore(live) == 0
            assert same(live["x"], x)
            assert same(jax.random.key_data(live["k"]), jax.random.key_data(keys))
            assert same(mgr.load()["x"], x)
    assert not [p for p in (tmp_path / "c").iterdir() if "corrupt" in p.name]
