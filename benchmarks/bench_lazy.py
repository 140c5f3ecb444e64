"""snapshot="eager" vs "lazy": training time lost per save in a torch training loop.

The loop: a small MLP forward/backward on a fixed batch plus Adam over a larger parameter set
(a "bulk" parameter with a fixed gradient, standing in for embeddings), ~256 MiB of
parameters + Adam moments in all, ``--steps`` steps with one ``save()`` after the second. Each
mode runs in fresh processes, interleaved (eager, lazy, eager, ...), and medians are
reported. Lost time per save = loop time with the save - the same loop without it, run back
to back in the same process (paired, so the machine's drifting load cancels) (it catches
work deferred into later steps: the fence's wait, the persist's use of the cores). Also the
stall (what save() blocked), the lazy copy's duration and the fences' wait, and the memcpy
floor of the same bytes measured in the same process.

Run: ``python benchmarks/bench_lazy.py`` (``--state 256M --reps 5 --processes 2``). Never part of the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


def child(mode: str, state_bytes: int, steps: int, width: int, batch: int,
          reps: int, threads: int) -> dict:
    import numpy as np
    import torch

    import pitstop

    if threads:
        torch.set_num_threads(threads)

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    mlp = sum(p.numel() for p in model.parameters())
    bulk_n = max(1, state_bytes // 4 // 3 - mlp)  # params + exp_avg + exp_avg_sq
    bulk = torch.nn.Parameter(torch.randn(bulk_n))
    bulk_grad = torch.randn(bulk_n) * 1e-3
    emb = torch.nn.Module()  # the "embeddings": a module holding the bulk parameter
    emb.w = bulk
    opt = torch.optim.Adam([*model.parameters(), bulk], lr=1e-4)
    x = torch.randn(batch, width)

    def train_step() -> None:
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        bulk.grad = bulk_grad
        opt.step()

    for _ in range(3):  # warm-up: Adam state exists, allocator warm
        train_step()
    state = {"model": model, "emb": emb, "opt": opt}
    total = (mlp + bulk_n) * 4 * 3
    # the memcpy floor of the same bytes, into preallocated memory
    srcs = [p.detach().numpy() for p in [*model.parameters(), bulk]]
    srcs += [v.numpy() for s in opt.state.values() for v in s.values() if v.numel() > 1]
    dsts = [np.empty_like(a) for a in srcs]
    for d, s in zip(dsts, srcs, strict=True):
        np.copyto(d, s)
    t = time.perf_counter()
    for d, s in zip(dsts, srcs, strict=True):
        np.copyto(d, s)
    memcpy = time.perf_counter() - t
    del dsts
    def loop(mgr: Any, step: int) -> tuple[float, Any, list[float]]:
        handle = None
        times = []
        t0 = time.perf_counter()
        for i in range(steps):
            ts = time.perf_counter()
            train_step()
            if mgr is not None and i == save_at:
                handle = mgr.save(step, state)
            times.append(time.perf_counter() - ts)
        return time.perf_counter() - t0, handle, times

    save_at = 1
    out: dict[str, Any] = {"mode": mode, "bytes": total, "memcpy_s": memcpy, "base_s": [],
                           "loop_s": [], "lost_s": [], "stall_s": [], "lazy_copy_s": [],
                           "fence_wait_s": [], "window_s": [], "committed_in_loop": 0}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        mgr = pitstop.CheckpointManager(os.path.join(d, "ckpt"), snapshot=mode, keep_last=1,
                                        memory_tier=False, save_on_signals=None)
        mgr.save(0, state).wait()  # staging buffer allocated, outside the timing
        for rep in range(reps):
            # paired: the same loop without and with one save, back to back (the machine's
            # load drifts; a pair sees the same load)
            base, _, bt = loop(None, 0)
            took, handle, st = loop(mgr, rep + 1)
            # the step that saves and the next one: where eager and lazy differ (the stall;
            # the fence and the copy's share of the cores)
            w = slice(save_at, save_at + 2)
            out["window_s"].append(sum(st[w]) - sum(bt[w]))
            out["committed_in_loop"] += handle.done()
            s = handle.result()
            out["base_s"].append(base)
            out["loop_s"].append(took)
            out["lost_s"].append(took - base)
            out["stall_s"].append(s.stall_s)
            out["lazy_copy_s"].append(s.lazy_copy_s)
            out["fence_wait_s"].append(s.fence_wait_s)
        mgr.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--state", default="256M", help="parameters + Adam moments (K/M/G)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5, help="paired loops per process")
    ap.add_argument("--processes", type=int, default=2, help="fresh processes per mode")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch.set_num_threads in the loop (0: torch's default, every core)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    size = int(float(a.state[:-1]) * units[a.state[-1].upper()]) \
        if a.state[-1].upper() in units else int(a.state)
    if a.child:
        print(json.dumps(child(a.child, size, a.steps, a.width, a.batch, a.reps,
                               a.torch_threads)))
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    runs: dict[str, list[dict]] = {"eager": [], "lazy": []}
    for rep in range(a.processes):
        for mode in runs:
            r = subprocess.run([sys.executable, __file__, "--child", mode, "--state", a.state,
                                "--steps", str(a.steps), "--width", str(a.width),
                                "--batch", str(a.batch), "--reps", str(a.reps),
                                "--torch-threads", str(a.torch_threads)],
                               capture_output=True, text=True, env=env)
            if r.returncode:
                sys.exit(f"the {mode} run failed:\n{r.stderr}")
            res = json.loads(r.stdout.strip().splitlines()[-1])
            runs[mode].append(res)
            print(f"process {rep} {mode:5s} lost " + ", ".join(f"{v:.3f}" for v in res["lost_s"])
                  + " s; stall " + ", ".join(f"{v:.4f}" for v in res["stall_s"])
                  + " s; fence wait " + ", ".join(f"{v:.4f}" for v in res["fence_wait_s"])
                  + " s; window " + ", ".join(f"{v:.3f}" for v in res["window_s"]) + " s",
                  flush=True)

    def med(mode: str, key: str) -> float:
        return statistics.median(v for r in runs[mode] for v in r[key])

    memcpy = statistics.median(r["memcpy_s"] for rs in runs.values() for r in rs)
    nbytes = runs["eager"][0]["bytes"]
    base = med("eager", "base_s") / a.steps
    n = sum(len(r["lost_s"]) for r in runs["eager"])
    print(f"\nstate {nbytes / 2**20:.0f} MiB, loops of {a.steps} steps (~{base:.3f} s each) "
          f"with one save after step 2; memcpy floor {memcpy:.3f} s; medians of {n} paired "
          f"loops ({a.processes} processes x {a.reps})\n")
    print("| mode | lost per save s | lost / memcpy | save step + next, extra s | stall s | "
          "stall / memcpy | lazy copy s | fence wait s | committed in loop |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode in runs:
        lost, stall = med(mode, "lost_s"), med(mode, "stall_s")
        print(f"| {mode} | {lost:.3f} | {lost / memcpy:.2f} | {med(mode, 'window_s'):.3f} | "
              f"{stall:.4f} | "
              f"{stall / memcpy:.2f} | {med(mode, 'lazy_copy_s'):.3f} | "
              f"{med(mode, 'fence_wait_s'):.4f} | "
              f"{sum(r['committed_in_loop'] for r in runs[mode])}/{n} |")


if __name__ == "__main__":
    main()
