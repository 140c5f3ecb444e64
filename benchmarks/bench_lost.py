"""The training time a save costs, measured the hard way (issue 30's figures), for a torch
state of fp32 weights + Adam m and v, pitstop beside ``torch.save``:

- first stall / later stall: the first save of a process (after a few ``step()`` calls that
  do not save, as a training loop makes them) against the median later one;
- lost per save, optimizer passes: Adam steps over the whole state run back to back from
  ``save()`` until the save is durable; lost = that wall time - the same passes at their
  plain speed (measured just before and just after, so drift cancels), / memcpy;
- background CPU-s per GiB: the process's CPU time on threads other than the caller's from
  ``save()``'s return until durable, while the caller sleeps (the save's own background work);
- persist / write floor: save -> durable against one file written + fsync of the same bytes,
  taken interleaved (floor, save, floor, save...) in the same process;
- restart restore: a fresh process restoring what this one saved (its files as the save left
  them in the page cache) against a warm read of the same bytes and ``torch.load`` +
  ``load_state_dict`` in a fresh process.

    python benchmarks/bench_lost.py --mib 1024 --reps 3
    python benchmarks/bench_lost.py --mib 64 --reps 1      # a quick look

Never part of the test run; the comparison table lives in docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import pitstop

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_save import (  # noqa: E402
    floor_write,
    lost_in_passes,
    pass_time,
    passes_during,
    process_cpu,
    thread_cpu,
)


def build(mib: int, n: int = 21) -> tuple[torch.nn.ParameterList, torch.optim.Adam]:
    torch.manual_seed(0)
    per = mib * 2**20 // 4 // 3 // n
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(per)) for _ in range(n)])
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def write_floor(tensors: list[torch.Tensor], path: str) -> float:
    return floor_write([x.detach().numpy() for x in tensors], path)


def read_floor(tensors: list[torch.Tensor], path: str) -> float:
    t = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    off = 0
    for x in tensors:
        mv = memoryview(x.detach().numpy()).cast("B")
        while mv:
            k = os.preadv(fd, [mv], off)
            off += k
            mv = mv[k:]
    os.close(fd)
    return time.perf_counter() - t


def all_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.data for p in model.parameters()]
    for s in opt.state.values():
        out += [v for v in s.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
    return out


def measure(mib: int, reps: int, wd: str) -> dict:
    model, opt = build(mib)
    tensors = all_tensors(model, opt)
    nbytes = sum(x.numel() * 4 for x in tensors)
    src = [x.clone() for x in tensors]

    def copy() -> float:
        t = time.perf_counter()
        for d, s in zip(tensors, src, strict=True):
            d.copy_(s)
        return time.perf_counter() - t

    memcpy = statistics.median(copy() for _ in range(3))  # (one alone drifts 0.06-0.1 s)
    src.clear()
    state = {"model": model, "opt": opt}
    out: dict = {"mib": nbytes / 2**20, "memcpy_s": memcpy}
    mgr = pitstop.CheckpointManager(os.path.join(wd, "pitstop"), keep_last=1, memory_tier=False,
                                    save_every_steps=10**9, save_on_signals=None)
    for s in range(3):  # training steps that do not save (the staging memory is made then)
        opt.step()
        mgr.step(s, state)
    time.sleep(max(1.0, 4 * mib / 1024))
    t = time.perf_counter()
    h = mgr.save(10, state)
    out["first_stall_s"] = time.perf_counter() - t
    h.wait()
    stalls, lost, bg, persists, floors = [], [], [], [], []
    floor_path = os.path.join(wd, "floor.bin")
    for r in range(reps):
        floors.append(write_floor(tensors, floor_path))
        before = pass_time(opt.step)
        t = time.perf_counter()
        h = mgr.save(11 + 2 * r, state)
        stalls.append(time.perf_counter() - t)
        k, wall = passes_during(opt.step, h.done)
        h.wait()
        after = pass_time(opt.step)
        lost.append(lost_in_passes(stalls[-1], k, wall, before, after))
        persists.append(h.result().persist_s)
        floors.append(write_floor(tensors, floor_path))
        # background work: the caller sleeps until durable
        h = mgr.save(12 + 2 * r, state)
        c0, m0 = process_cpu(), thread_cpu()  # from the return: the copy helpers' share is stall
        while not h.done():
            time.sleep(0.005)
        h.wait()
        bg.append((process_cpu() - c0 - (thread_cpu() - m0)) / (nbytes / 2**30))
        persists.append(h.result().persist_s)
    mgr.close()
    out.update(later_stall_s=statistics.median(stalls), lost_s=statistics.median(lost),
               background_cpu_s_per_gib=statistics.median(bg),
               persist_s=statistics.median(persists), write_floor_s=statistics.median(floors),
               pass_s=pass_time(opt.step))
    read_floor(tensors, floor_path)
    out["warm_read_s"] = statistics.median(read_floor(tensors, floor_path) for _ in range(3))
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
               os.path.join(wd, "t.pt"))
    os.unlink(floor_path)
    return out


def child(kind: str, mib: int, wd: str) -> float:
    model, opt = build(mib)
    t = time.perf_counter()
    if kind == "pitstop":
        with pitstop.CheckpointManager(os.path.join(wd, "pitstop"), read_only=True) as mgr:
            mgr.restore({"model": model, "opt": opt})
    else:
        sd = torch.load(os.path.join(wd, "t.pt"), weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="write the figures here too")
    ap.add_argument("--child", choices=["pitstop", "torch"], help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.mib, args.workdir)))
        return
    wd = tempfile.mkdtemp(prefix="bench-lost-", dir=os.environ.get("BENCH_DIR"))
    try:
        out = measure(args.mib, args.reps, wd)
        for kind in ("pitstop", "torch"):
            r = subprocess.run([sys.executable, __file__, "--child", kind, "--mib",
                                str(args.mib), "--workdir", wd], capture_output=True,
                               text=True, check=True)
            out[f"restart_{kind}_s"] = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(wd, ignore_errors=True)
    m = out["memcpy_s"]
    rows = [
        ("first stall / later stall", out["first_stall_s"] / out["later_stall_s"], "≤ 2"),
        ("later stall / memcpy", out["later_stall_s"] / m, "≤ 1.3"),
        ("lost per save (optimizer passes) / memcpy", out["lost_s"] / m, "≤ 1.5"),
        ("background CPU-s per GiB", out["background_cpu_s_per_gib"], "(reported)"),
        ("persist / interleaved write floor", out["persist_s"] / out["write_floor_s"], "≤ 1.1"),
        ("restart restore / warm read", out["restart_pitstop_s"] / out["warm_read_s"], "≤ 1.3"),
        ("restart restore / torch.load + lsd", out["restart_pitstop_s"] / out["restart_torch_s"],
         "< 1"),
    ]
    print(f"| {out['mib']:.0f} MiB torch + Adam | ratio | goal |\n|---|---|---|")
    for name, v, goal in rows:
        print(f"| {name} | {v:.2f} | {goal} |")
    print("seconds: " + ", ".join(f"{k} {v:.3f}" for k, v in out.items()
                                   if isinstance(v, float) and k.endswith("_s")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
