"""The JAX trainer of ``pitstop demo``: a 2-layer MLP as a pytree of jax.Arrays, optax Adam
with a warm-up + cosine schedule, batches and dropout masks from a PRNG key split every step.
Params, the optax state and the key go straight into pitstop's state; the peer is Orbax's
``StandardCheckpointer.save`` of the same pytree (asynchronous: its stall is until it
returns)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from pitstop.cli.demo import ChildRun

D_IN, HIDDEN, D_OUT, BATCH = 256, 1024, 64, 64
PARAMS = D_IN * HIDDEN + HIDDEN + HIDDEN * D_OUT + D_OUT
DESCRIPTION = (f"a JAX MLP ({PARAMS / 1e6:.2f} M parameters, dropout), optax Adam with warm-up "
               "+ cosine schedule, batches and dropout masks from a PRNG key split every step")
PEER = ("orbax save", "StandardCheckpointer.save of the same pytree, until it returns")


def state_mib(steps: int) -> float:
    return (3 * PARAMS * 4 + steps * 8) / 2**20


def train(c: ChildRun) -> int:
    """One training run; with a checkpoint directory it resumes from it when it can."""
    import jax
    import jax.numpy as jnp
    import optax

    import pitstop.adapters.jax  # noqa: F401  (JAX pytrees in pitstop's state)

    init = np.random.default_rng(c.seed)
    teacher = jnp.asarray((init.standard_normal((D_IN, D_OUT)) / 16).astype(np.float32))
    s1, s2 = 1 / np.sqrt(D_IN), 1 / np.sqrt(HIDDEN)
    params = {
        "w1": jnp.asarray(init.uniform(-s1, s1, (D_IN, HIDDEN)).astype(np.float32)),
        "b1": jnp.zeros(HIDDEN),
        "w2": jnp.asarray(init.uniform(-s2, s2, (HIDDEN, D_OUT)).astype(np.float32)),
        "b2": jnp.zeros(D_OUT),
    }
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, max(1, c.steps // 10), c.steps)
    tx = optax.adam(schedule)
    state: dict[str, Any] = {"params": params, "opt_state": tx.init(params),
                             "key": jax.random.key(c.seed + 1),
                             "losses": np.zeros(c.steps, np.float64)}
    mgr = c.manager()
    restored = None
    if mgr is not None:
        restored = mgr.restore(state)  # replaces the pytrees inside `state`
        if restored is not None and c.wrong_resume:  # on purpose: forget the random stream
            state["key"] = jax.random.key(c.seed + 99)
    start = c.restored(restored)

    def loss_fn(p: Any, x: Any, y: Any, keep: Any) -> Any:
        h = jax.nn.gelu(x @ p["w1"] + p["b1"]) * keep
        return jnp.mean(jnp.square(h @ p["w2"] + p["b2"] - y))

    @jax.jit
    def train_step(p: Any, o: Any, key: Any) -> Any:
        key, kx, kn, kd = jax.random.split(key, 4)
        x = jax.random.normal(kx, (BATCH, D_IN))
        y = jnp.tanh(x @ teacher) + 0.01 * jax.random.normal(kn, (BATCH, D_OUT))
        keep = jax.random.bernoulli(kd, 0.9, (BATCH, HIDDEN)) / 0.9
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y, keep)
        updates, o = tx.update(grads, o, p)
        return optax.apply_updates(p, updates), o, key, loss

    orbax: list[Any] = []

    def peer_save(path: str) -> None:
        import orbax.checkpoint as ocp

        if not orbax:
            orbax.append(ocp.StandardCheckpointer())
        else:
            orbax[0].wait_until_finished()  # the previous one (not timed: a new save waits)
        tree = {k: state[k] for k in ("params", "opt_state", "key")}
        orbax[0].save(f"{path}/{os.getpid()}-{len(orbax)}", jax.tree.map(
            lambda a: jax.random.key_data(a) if jax.dtypes.issubdtype(
                a.dtype, jax.dtypes.prng_key) else a, tree))
        orbax.append(None)

    for step in range(start, c.steps):
        p, o, k, loss = train_step(state["params"], state["opt_state"], state["key"])
        state["params"], state["opt_state"], state["key"] = p, o, k
        state["losses"][step] = float(loss)
        c.end_of_step(step, mgr, state, float(state["losses"][step]), peer_save)
    if orbax:
        orbax[0].wait_until_finished()
    leaves = jax.tree_util.tree_leaves_with_path({k: state[k] for k in ("params", "opt_state")})
    arrays = {jax.tree_util.keystr(path): np.asarray(v) for path, v in leaves}
    arrays["key"] = np.asarray(jax.random.key_data(state["key"]))
    arrays["losses"] = state["losses"]
    return c.finish(mgr, arrays)
