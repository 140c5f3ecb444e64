"""A small JAX training job for test_resume.py, run as a subprocess.

A Flax linen MLP with dropout, Optax Adam (after gradient clipping), a typed PRNG key split
every step for the dropout mask, and a batch drawn from the step number. The state
``{"params", "opt_state", "key", "step"}`` is saved asynchronously at the end of every step
by a CheckpointManager with its default signal handling and memory tier, and restored at
the start. On stdout, one line each: ``start <restored step or None>``, ``step <n> <loss as
float.hex>`` before the step's save, ``saved <n>`` once ``mgr.save`` returned (the snapshot
is taken), ``committed <n>`` (from ``on_save``, once step n is on disk) and, at the end,
``final <sha256 of every parameter, optimizer and key byte>``.

``--lockstep``: after each step's save, read one line from stdin before the next step, so
the test can kill the job right after a line it has read (a step whose save may be under
way, or one whose save returned) without the job racing ahead of it.
``--hold-persist-at n``: the background write of step n never starts (it waits after the
snapshot is sealed in the memory tier), so a kill after ``saved n`` finds it in memory only.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

import pitstop

_out = threading.Lock()


def emit(line: str) -> None:
    """One whole line at a time: the persist thread's ``committed`` lines never interleave."""
    with _out:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.relu(nn.Dense(32)(x))
        x = nn.Dropout(0.3, deterministic=not train)(x)
        return nn.Dense(1)(x)[:, 0]


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    y = (x @ np.linspace(-1, 1, 8, dtype=np.float32) + 0.1 * np.sin(step)).astype(np.float32)
    return x, y


def digest(state: dict) -> str:
    h = hashlib.sha256()
    for path, leaf in jax.tree.leaves_with_path((state["params"], state["opt_state"])):
        a = np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(path)} {a.dtype} {a.shape}\n".encode())
        h.update(a.tobytes())
    h.update(np.asarray(jax.random.key_data(state["key"])).tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lockstep", action="store_true")
    p.add_argument("--hold-persist-at", type=int)
    a = p.parse_args()

    model = MLP()
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(3e-2))
    params = model.init(jax.random.key(42), jnp.zeros((1, 8)), train=False)["params"]
    state = {"params": params, "opt_state": tx.init(params), "key": jax.random.key(0),
             "step": -1}

    @jax.jit
    def train_step(params, opt_state, dropout_key, x, y):
        def loss_fn(p):
            pred = model.apply({"params": p}, x, train=True, rngs={"dropout": dropout_key})
            return jnp.mean((pred - y) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def committed(stats: pitstop.SaveStats) -> None:
        if stats.committed:
            emit(f"committed {stats.step}")

    mgr = pitstop.CheckpointManager(a.dir, on_save=committed)
    if a.hold_persist_at is not None:
        def hold(step: int) -> None:
            if step == a.hold_persist_at:
                threading.Event().wait()  # until the test kills the job
        mgr.hooks["before_write"] = hold
    restored = mgr.restore(state)
    emit(f"start {restored}")
    if restored is not None:
        assert state["step"] == restored, (state["step"], restored)
    params, opt_state, key = state["params"], state["opt_state"], state["key"]
    for step in range(0 if restored is None else restored + 1, a.steps):
        key, sub = jax.random.split(key)
        params, opt_state, loss = train_step(params, opt_state, sub, *batch(step))
        state.update(params=params, opt_state=opt_state, key=key, step=step)
        emit(f"step {step} {float(loss).hex()}")
        mgr.save(step, state)
        emit(f"saved {step}")
        if a.lockstep:
            sys.stdin.readline()
    mgr.close()
    emit(f"final {digest(state)}")


if __name__ == "__main__":
    main()
