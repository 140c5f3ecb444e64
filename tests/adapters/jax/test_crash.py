"""Adversarial probes run in fresh processes: SIGKILL right after a save with the memory
tier on. A failing test is a defect. (Shards spanning data files: test_sharding.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("jax")

ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
       "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}

PRELUDE = textwrap.dedent("""
    import sys, warnings
    warnings.simplefilter("ignore")
    import jax, jax.numpy as jnp, numpy as np
    import pitstop
    from flax import struct
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    DEV = jax.devices()
    MESH8 = Mesh(np.array(DEV).reshape(4, 2), ("x", "y"))

    @struct.dataclass
    class S:
        params: dict
        lr: jax.Array
        key: jax.Array
        n: int

    def state(v):
        return {"s": S({"w": jnp.full((4, 4), v, jnp.bfloat16), "b": jnp.full(4, v)},
                       jnp.asarray(v * 0.1), jax.random.key(int(v), impl="rbg"), int(v)),
                "x": jax.device_put(jnp.full((16, 8), v), NamedSharding(MESH8, P("x", "y")))}

    def same(a, b):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
""")


def _run(code: str, *args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code), *args],
                          env=ENV, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


KILLED = """
import os, signal
d = sys.argv[1]

m = pitstop.CheckpointManager(d, save_on_signals=None, async_save=True)
m.save(1, state(1.0)).wait()
m.save(2, state(2.0))          # returns after the snapshot: now killed before the commit
os.kill(os.getpid(), signal.SIGKILL)
"""

RECOVER = """
d = sys.argv[1]

with pitstop.CheckpointManager(d, save_on_signals=None) as m:
    tgt = state(0.0)
    got = m.restore(tgt)
    assert got == 2, got
    want = state(2.0)
    for a, b in zip(jax.tree.leaves(tgt), jax.tree.leaves(want)):
        if isinstance(b, int):
            assert a == b, (a, b)
        else:
            assert same(a, b), (a, b)
    assert tgt["s"].lr.weak_type
print("OK")
"""


def test_sigkill_right_after_an_async_save_of_jax_state_recovers_from_memory(tmp_path):
    d = str(tmp_path / "ckpt")
    r = _run(KILLED, d)
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-2000:])
    r = _run(RECOVER, d)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
