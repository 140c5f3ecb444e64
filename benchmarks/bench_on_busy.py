"""What ``on_busy="wait"`` costs beside ``"skip"`` when saves come due faster than they persist.

A numpy training loop (one matmul step of ``--step-ms`` milliseconds, repeated) saves a state
of ``--size`` fp32 bytes every ``--every`` steps through ``CheckpointManager.step``; the save
interval is chosen shorter than one persist (hash, write, fsync, commit). The same loop runs
without saves, with ``on_busy="skip"`` and with ``on_busy="wait"`` (``--reps`` times each,
interleaved), and the table says, per mode: the loop's wall time and its ratio to the loop
without saves; the checkpoints committed and the save steps skipped; and what a crash would
cost: the most training steps between two commits, and the longest wall time between two
commits (the work a failure at the worst moment loses). Never part of the test run.

    python benchmarks/bench_on_busy.py                  # 256 MiB, 400 steps of ~5 ms, every 20
    python benchmarks/bench_on_busy.py --size 64M --steps 200 --every 10 --reps 3
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

import pitstop


def parse_size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units \
        else int(text)


def workdir(asked: str | None) -> str:
    if asked:
        os.makedirs(asked, exist_ok=True)
        return tempfile.mkdtemp(dir=asked)
    base = tempfile.gettempdir()
    with open("/proc/mounts") as f:
        tmpfs = any(line.split()[1] == base and line.split()[2] == "tmpfs" for line in f)
    if tmpfs:  # a persist to memory would not be slower than the interval
        base = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            ".bench")
        os.makedirs(base, exist_ok=True)
    return tempfile.mkdtemp(dir=base, prefix="on_busy-")


def calibrate(step_ms: float) -> tuple[np.ndarray, int]:
    """A matrix and a repeat count whose matmuls take about ``step_ms``."""
    a = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    one = (time.perf_counter() - t0) / 20
    return a, max(1, round(step_ms / 1000 / one))


def run(mode: str | None, args: argparse.Namespace, state: dict, a: np.ndarray, reps: int,
        root: str) -> dict:
    """One loop; ``mode`` None: no manager at all."""
    directory = os.path.join(root, f"run-{mode}-{time.monotonic_ns()}")
    commits: list[tuple[int, float]] = []
    mgr = None
    if mode is not None:
        mgr = pitstop.CheckpointManager(
            directory, save_every_steps=args.every, on_busy=mode, memory_tier=False,
            save_on_signals=None, keep_last=2,
            on_save=lambda st: commits.append((st.step, time.perf_counter())))
    t0 = time.perf_counter()
    for step in range(args.steps):
        for _ in range(reps):
            a @ a
        state["w0"][:1] = step
        if mgr is not None:
            mgr.step(step, state)
    if mgr is not None:
        mgr.wait()
    wall = time.perf_counter() - t0
    out = {"wall_s": wall, "commits": len(commits), "skipped": 0, "max_gap_steps": 0,
           "max_gap_s": 0.0}
    if mgr is not None:
        out["skipped"] = mgr.skipped_saves
        mgr.close()
        pts = [(-1, t0)] + sorted(commits)
        out["max_gap_steps"] = max(b[0] - a_[0] for a_, b in zip(pts, pts[1:], strict=False))
        out["max_gap_s"] = max(b[1] - a_[1] for a_, b in zip(pts, pts[1:], strict=False))
        out["persist_s"] = statistics.median(
            s.persist_s for s in mgr.stats if s.persist_s) if mgr.stats else 0.0
    shutil.rmtree(directory, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="256M", help="state bytes (fp32), e.g. 64M, 1G")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--every", type=int, default=20, help="save_every_steps")
    p.add_argument("--step-ms", type=float, default=5.0)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    logging.getLogger("pitstop").setLevel(logging.ERROR)  # the skip warnings: counted below
    n = parse_size(args.size) // 4
    state = {f"w{i}": np.random.default_rng(i).standard_normal(n // 8).astype(np.float32)
             for i in range(8)}
    a, reps = calibrate(args.step_ms)
    root = workdir(args.workdir)
    results: dict[str, list[dict]] = {"none": [], "skip": [], "wait": []}
    try:
        for _ in range(args.reps):
            for mode in ("none", "skip", "wait"):
                results[mode].append(run(None if mode == "none" else mode, args, state, a,
                                         reps, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = statistics.median(r["wall_s"] for r in results["none"])
    persist = statistics.median(r.get("persist_s", 0) for r in results["skip"] + results["wait"])
    interval = base / args.steps * args.every
    print(f"state {args.size}, {args.steps} steps of {base / args.steps * 1000:.1f} ms, "
          f"save_every_steps={args.every} (an interval of {interval:.2f} s), one persist "
          f"{persist:.2f} s (median); medians of {args.reps} runs")
    print()
    print("| on_busy | loop wall time | vs no saves | checkpoints committed | saves skipped "
          "| most steps between commits | longest time between commits |")
    print("|---|---|---|---|---|---|---|")
    for mode in ("none", "skip", "wait"):
        rs = results[mode]
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "persist_s"}
        if mode == "none":
            print(f"| (no saves) | {med['wall_s']:.2f} s | 1.00x | - | - | - | - |")
            continue
        print(f"| `{mode}` | {med['wall_s']:.2f} s | {med['wall_s'] / base:.2f}x | "
              f"{med['commits']:.0f} of {args.steps // args.every} | {med['skipped']:.0f} | "
              f"{med['max_gap_steps']:.0f} | {med['max_gap_s']:.2f} s |")


if __name__ == "__main__":
    main()
