"""A training job for the preemption tests (tests/e2e/test_preemption_resume.py): it resumes
from its directory, trains to step TOTAL under a CheckpointManager that watches SOURCE's
notices (saving only on a notice), prints ``STEP s`` before each ``step()``, and writes its
final state's bytes to OUT (an .npz). Usage: preemption_job.py torch|numpy DIR OUT TOTAL
[SOURCE]."""

from __future__ import annotations

import sys
import time

import numpy as np

import pitstop


def torch_job(directory: str, total: int, source: str | None) -> dict[str, np.ndarray]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = {"model": model, "opt": opt, "rng": pitstop.RNG()}

    def train(step: int) -> None:
        x = torch.randn(32, 8)
        y = x[:, :2].sin() + 0.1 * torch.randn(32, 2)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    run(directory, total, source, state, train)
    out = {f"p.{k}": v.detach().numpy() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            out[f"opt.{i}.{k}"] = np.asarray(v)
    out["rng"] = torch.get_rng_state().numpy()
    return out


def numpy_job(directory: str, total: int, source: str | None) -> dict[str, np.ndarray]:
    state = {"w": np.linspace(-1.0, 1.0, 64), "m": np.zeros(64),
             "rng": np.random.default_rng(1234)}

    def train(step: int) -> None:
        g = state["w"] - state["rng"].normal(size=64)
        state["m"] = 0.9 * state["m"] + g
        state["w"] = state["w"] - 0.01 * state["m"]

    run(directory, total, source, state, train)
    return {"w": state["w"], "m": state["m"],
            "rng": np.frombuffer(repr(state["rng"].bit_generator.state).encode(), np.uint8)}


def run(directory: str, total: int, source: str | None, state: dict, train) -> None:
    with pitstop.CheckpointManager(directory, preemption=source, memory_tier=False) as mgr:
        restored = mgr.restore(state)
        print("START", restored, flush=True)
        for step in range(0 if restored is None else restored + 1, total):
            train(step)
            print("STEP", step, flush=True)
            mgr.step(step, state)
            time.sleep(0.03)


if __name__ == "__main__":
    kind, directory, out, total = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    source = sys.argv[5] if len(sys.argv) > 5 else None
    final = (torch_job if kind == "torch" else numpy_job)(directory, total, source)
    np.savez(out, **final)
    print("DONE", flush=True)
