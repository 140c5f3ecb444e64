"""A small training job for test_exact_resume.py, run as a subprocess.

Dropout, a shuffled ResumableLoader with 2 workers, AdamW, warm-up + cosine schedule, grad
clipping, and randomness from Python, numpy (global and a Generator) and torch. Appends
``start <restored step>`` and ``step <n> <loss as float.hex>`` lines to ``<out>/log.txt``
and, when it reaches the end, writes the final model and optimizer state to
``<out>/final.npz``. Fault injection: ``--kill-at`` (SIGKILL to the whole process group,
workers included, like a preempted machine; only once the first checkpoint is committed),
``--term-at`` (SIGTERM to itself: the manager saves at the step boundary and exits),
``--slow-persist-at`` (the persist of that step hangs after the snapshot is sealed in the
memory tier; the job is killed two steps later), ``--wait-at`` (at that step, before
``mgr.step``, print ``waiting <step>`` on stdout and read stdin to its end: the test signals
the whole process group meanwhile, as Slurm or ``docker stop`` would, then closes stdin).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import pitstop
from pitstop.adapters.torch import ResumableLoader


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--kill-phase", choices=["mid", "after"], default="after")
    p.add_argument("--term-at", type=int)
    p.add_argument("--slow-persist-at", type=int)
    p.add_argument("--wait-at", type=int)
    p.add_argument("--memory-tier", action="store_true")
    a = p.parse_args()

    torch.set_num_threads(1)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(100, 8, generator=g)
    y = x @ torch.randn(8, generator=g) + 0.1 * torch.randn(100, generator=g)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.01)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=5)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.steps - 5)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cosine], milestones=[5])
    loader = ResumableLoader(TensorDataset(x, y), batch_size=8, shuffle=True, seed=7,
                             num_workers=2)
    noise = np.random.default_rng(3)
    state = {"model": model, "opt": opt, "sched": sched, "loader": loader, "noise": noise,
             "rng": pitstop.RNG()}

    mgr = pitstop.CheckpointManager(a.dir, save_every_steps=a.save_every, keep_last=2,
                                    memory_tier=None if a.memory_tier else False)
    sealed = threading.Event()
    if a.slow_persist_at is not None:
        def hang(step: int) -> None:
            if step == a.slow_persist_at:
                sealed.set()  # the snapshot is sealed in /dev/shm; never reach the disk
                time.sleep(60)
        mgr.hooks["before_write"] = hang

    restored = mgr.restore(state)
    log = open(os.path.join(a.out, "log.txt"), "a")
    log.write(f"start {restored}\n")
    log.flush()
    step = 0 if restored is None else restored + 1
    first_save = None  # the handle of this run's first save
    model.train()
    while step < a.steps:
        for xb, yb in loader:
            scale = 1 + 1e-3 * (random.random() + np.random.rand() + noise.standard_normal())
            loss = F.mse_loss(model(xb).squeeze(-1), yb) * scale
            opt.zero_grad()
            loss.backward()
            if step == a.kill_at and a.kill_phase == "mid":
                assert first_save is not None, "--kill-at must come after the first save"
                first_save.wait()  # a restart must find a checkpoint to resume from
                os.killpg(0, signal.SIGKILL)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            log.write(f"step {step} {loss.item().hex()}\n")
            log.flush()
            if step == a.term_at:
                os.kill(os.getpid(), signal.SIGTERM)  # saved at this step's mgr.step, then exit
            if a.slow_persist_at is not None and step == a.slow_persist_at:
                mgr.wait()  # the previous save is committed, so this one is not skipped
            if step == a.wait_at:
                print(f"waiting {step}", flush=True)
                sys.stdin.read()  # the test signals the process group, then closes stdin
            handle = mgr.step(step, state, {"loss": loss.item()})
            if first_save is None:
                first_save = handle
            if step == a.kill_at and a.kill_phase == "after":
                assert first_save is not None, "--kill-at must come after the first save"
                first_save.wait()  # a restart must find a checkpoint to resume from
                os.killpg(0, signal.SIGKILL)
            if a.slow_persist_at is not None and step == a.slow_persist_at + 2:
                assert sealed.wait(30), "the snapshot was never sealed"
                os.killpg(0, signal.SIGKILL)
            step += 1
            if step == a.steps:
                break
    mgr.close()
    final = {f"model/{k}": v.numpy() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        final.update({f"opt/{i}/{k}": v.numpy() for k, v in s.items()})
    final["lr"] = np.array(sched.get_last_lr())
    np.savez(os.path.join(a.out, "final.npz"), **final)


if __name__ == "__main__":
    main()
