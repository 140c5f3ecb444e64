"""The numpy trainer of ``pitstop demo``: linear regression, SGD with momentum, a fresh batch
drawn from a numpy Generator every step (its state is checkpointed with the weights)."""

from __future__ import annotations

from typing import Any

import numpy as np

from pitstop.cli.demo import ChildRun

D_IN, D_OUT, BATCH = 1024, 512, 64
DESCRIPTION = ("linear regression in numpy, SGD + momentum, a new batch from a seeded "
               "numpy Generator every step")
PEER = ("np.savez", "the same arrays to one .npz file, no fsync")


def state_mib(steps: int) -> float:
    return (2 * (D_IN * D_OUT + D_OUT) * 4 + steps * 8) / 2**20


def train(c: ChildRun) -> int:
    """One training run; with a checkpoint directory it resumes from it when it can."""
    w_true = np.random.default_rng(c.seed).standard_normal((D_IN, D_OUT), dtype=np.float32)
    w_true /= np.float32(np.sqrt(D_IN))
    rng = np.random.default_rng(c.seed + 1)  # draws every batch: its state is checkpointed
    state: dict[str, Any] = {
        "model": {"w": np.zeros((D_IN, D_OUT), np.float32), "b": np.zeros(D_OUT, np.float32)},
        "optimizer": {
            "w": np.zeros((D_IN, D_OUT), np.float32),
            "b": np.zeros(D_OUT, np.float32),
            "lr": 0.01,
            "momentum": 0.9,
        },
        "losses": np.zeros(c.steps, np.float64),
        "rng": rng.bit_generator.state,
    }
    w, b = state["model"]["w"], state["model"]["b"]
    vw, vb = state["optimizer"]["w"], state["optimizer"]["b"]
    mgr = c.manager()
    restored = None
    if mgr is not None:
        restored = mgr.restore(state)  # arrays in place; values (rng, lr) replaced in the dict
        if restored is not None and not c.wrong_resume:  # --wrong-resume: forget the RNG
            rng.bit_generator.state = state["rng"]
    start = c.restored(restored)

    def peer_save(path: str) -> None:
        np.savez(path + ".npz", w=w, b=b, vw=vw, vb=vb, losses=state["losses"])

    opt = state["optimizer"]
    for step in range(start, c.steps):
        x = rng.standard_normal((BATCH, D_IN), dtype=np.float32)
        y = x @ w_true + np.float32(0.01) * rng.standard_normal((BATCH, D_OUT), dtype=np.float32)
        err = x @ w + b - y
        state["losses"][step] = float(np.mean(err * err, dtype=np.float64))
        inv_batch = np.float32(1.0 / BATCH)  # gradient of 0.5 * mean over the batch of |err|^2
        vw *= np.float32(opt["momentum"])
        vw += inv_batch * (x.T @ err)
        vb *= np.float32(opt["momentum"])
        vb += inv_batch * err.sum(axis=0)
        w -= np.float32(opt["lr"]) * vw
        b -= np.float32(opt["lr"]) * vb
        state["rng"] = rng.bit_generator.state
        # the end of iteration `step`: a checkpoint of `step` resumes at `step + 1`
        c.end_of_step(step, mgr, state, float(state["losses"][step]), peer_save)
    return c.finish(mgr, {"w": w, "b": b, "vw": vw, "vb": vb, "losses": state["losses"]})
