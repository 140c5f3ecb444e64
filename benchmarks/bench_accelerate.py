"""The training-thread stall of a save: ``accelerator.save_state`` against pitstop's
``Checkpointing.save()`` on the same prepared state (an MLP of ``--mib`` MiB of fp32 weights
with AdamW moments, a scheduler, a loader, RNG), and the memcpy floor of the same bytes.

``save_state`` blocks until its files are written (safetensors + torch.save; no fsync);
pitstop's ``save()`` returns after its in-memory snapshot and commits in the background
(fsynced, every byte hashed), so its stall is the snapshot. Median of ``--repeat`` saves,
after one warm-up save each. Run: ``python benchmarks/bench_accelerate.py --mib 256``.
Never part of the test run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from pitstop.integrations.accelerate import Checkpointing


def build(mib: int):
    acc = Accelerator(cpu=True)
    width = 1024
    layers = max(1, mib * 2**20 // (4 * width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    data = torch.utils.data.TensorDataset(torch.randn(64, width))
    dl = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    model(torch.randn(2, width)).sum().backward()
    opt.step()  # AdamW moments exist
    state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    return acc, model, state_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256, help="MiB of fp32 weights")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    acc, model, state_bytes = build(args.mib)
    root = Path(tempfile.mkdtemp(prefix="bench_accelerate_"))
    try:
        accelerate_s = []
        for i in range(args.repeat + 1):
            t = time.perf_counter()
            acc.save_state(str(root / f"acc_{i}"))
            accelerate_s.append(time.perf_counter() - t)
            shutil.rmtree(root / f"acc_{i}")
        ckpt = Checkpointing(acc, root / "pitstop", keep_last=2)
        pitstop_s, commit_s = [], []
        for i in range(args.repeat + 1):
            ckpt.global_step = i + 1
            t = time.perf_counter()
            handle = ckpt.save()
            pitstop_s.append(time.perf_counter() - t)
            handle.wait()
            commit_s.append(time.perf_counter() - t)
        ckpt.close()
        flat = [p.detach().clone() for p in model.parameters()] * 3
        dst = [torch.empty_like(t) for t in flat]
        memcpy_s = []
        for _ in range(args.repeat + 1):
            t = time.perf_counter()
            for d, s in zip(dst, flat, strict=True):
                d.copy_(s)
            memcpy_s.append(time.perf_counter() - t)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {name: statistics.median(v[1:]) for name, v in (
        ("accelerate_save_state_s", accelerate_s), ("pitstop_stall_s", pitstop_s),
        ("pitstop_save_to_commit_s", commit_s), ("memcpy_floor_s", memcpy_s))}
    med["state_mib"] = round(state_bytes / 2**20)
    med["stall_ratio_vs_save_state"] = med["pitstop_stall_s"] / med["accelerate_save_state_s"]
    print(json.dumps(med, indent=1))


if __name__ == "__main__":
    main()
