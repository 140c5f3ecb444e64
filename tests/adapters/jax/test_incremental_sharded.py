"""Incremental checkpoints of sharded jax.Arrays saved by one process: an unchanged array's
shards are referenced one by one (each shard entry carries its own ``ref``), and the
restore into a sharded target and ``load()`` are exact."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pitstop


def test_unchanged_shards_are_referenced_and_restore_exactly(tmp_path):
    sh = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("x",)), P("x"))
    frozen = jax.device_put(jnp.arange(4096, dtype=jnp.float32), sh)
    head = jax.device_put(jnp.zeros(4096, jnp.float32), sh)
    with pitstop.CheckpointManager(tmp_path, incremental=True, memory_tier=False,
                                   save_on_signals=None, durable=False, keep_last=1) as mgr:
        for s in range(3):
            head = head + 1
            st = mgr.save(s, {"frozen": frozen, "head": head}).result()
            assert st.reused_bytes == (0 if s == 0 else frozen.nbytes)
        doc = json.loads((tmp_path / "step_0000000002" / "manifest.json").read_text())
        assert doc["format_version"] == "4.0"
        assert {p.get("ref") for p in doc["arrays"]["frozen"]["shards"]} == {"step_0000000000"}
        assert {p.get("ref") for p in doc["arrays"]["head"]["shards"]} == {None}
        assert mgr.all_steps() == [0, 2]
        target = {"frozen": jax.device_put(jnp.zeros(4096, jnp.float32), sh),
                  "head": jax.device_put(jnp.zeros(4096, jnp.float32), sh)}
        assert mgr.restore(target) == 2
        assert bool((target["frozen"] == frozen).all()) and bool((target["head"] == 3).all())
        got = mgr.load()
        assert np.array_equal(got["frozen"], np.arange(4096, dtype=np.float32))
