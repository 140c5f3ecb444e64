"""Many small tensors against the same bytes in few: the per-tensor cost of pitstop.

State A holds ``--count`` fp32 tensors of ``--elems`` elements (100,000 x 1 KiB by default);
state B the same bytes in ``--few`` tensors (64). For each, as numpy arrays in a dict and as
torch tensors (an ``nn.ParameterDict`` plus an SGD-with-momentum optimizer, when torch is
installed), this measures in one process: the ``save()`` stall (its wall time and
``stats.stall_s``) in the steady state, save to commit, ``restore`` into the live objects
in a fresh manager (warm page cache), ``load()``, parsing the manifest and
``CheckpointReader.verify``; and, as floors, a per-tensor copy loop into preallocated
arrays and, for the numpy state, ``np.savez`` and ``np.load`` into the live arrays (a
peer pays per tensor too). It prints each figure for both states and their ratio (many / few), medians of
``--repeat`` runs. ``--memory N`` also saves the many-tensor state N times on one manager
and prints the RSS after save 10 and after save N. ``--profile`` writes cProfile output of
the many-tensor save and restore to the given directory.

Run: ``python benchmarks/bench_small.py`` (never part of the test run).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import pitstop
from pitstop.core.directory.names import step_name
from pitstop.core.format.validate import parse
from pitstop.core.restore.read import CheckpointReader


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def numpy_state(count: int, elems: int, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    flat = rng.standard_normal(count * elems, dtype=np.float32)
    # separate arrays (copies), as a model's parameters are
    return {"params": {f"p{i:06d}": flat[i * elems:(i + 1) * elems].copy()
                       for i in range(count)}, "step": 0}


def torch_state(count: int, elems: int, seed: int = 0) -> dict[str, Any] | None:
    try:
        import torch
    except ImportError:
        return None
    g = torch.Generator().manual_seed(seed)
    params = torch.nn.ParameterDict({f"p{i:06d}": torch.nn.Parameter(torch.randn(elems, generator=g))
                                     for i in range(count)})
    model = torch.nn.Module()
    model.params = params
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # momentum buffers exist: the optimizer state is as many tensors again
    opt.zero_grad(set_to_none=True)
    return {"model": model, "optim": opt}


def tensors_of(state: dict[str, Any]) -> list[np.ndarray]:
    if "params" in state:
        return list(state["params"].values())
    model, opt = state["model"], state["optim"]
    out = [p.detach().numpy() for p in model.parameters()]
    out += [v.numpy() for s in opt.state.values() for v in s.values() if hasattr(v, "numpy")]
    return out


def median(fn: Callable[[], float], repeat: int) -> float:
    return statistics.median(fn() for _ in range(repeat))


def measure(state: dict[str, Any], root: str, repeat: int, profile: str | None,
            tag: str) -> dict[str, float]:
    out: dict[str, float] = {}
    arrays = tensors_of(state)
    dst = [np.empty_like(a) for a in arrays]

    def copy_loop() -> float:
        t = time.perf_counter()
        for d, a in zip(dst, arrays, strict=True):
            np.copyto(d, a)
        return time.perf_counter() - t

    out["copy loop"] = median(copy_loop, repeat)
    if "params" in state:
        # a peer's per-tensor cost beside pitstop's: numpy's own uncompressed archive, the
        # whole save, then each array read back into the live one
        npz = os.path.join(root, f"{tag}.npz")

        def savez() -> float:
            t = time.perf_counter()
            np.savez(npz, **state["params"])
            return time.perf_counter() - t

        def loadz() -> float:
            t = time.perf_counter()
            with np.load(npz) as z:
                for k, a in state["params"].items():
                    np.copyto(a, z[k])
            return time.perf_counter() - t

        out["np.savez (whole save)"] = median(savez, repeat)
        out["np.load + copyto"] = median(loadz, repeat)
        os.unlink(npz)
    d = os.path.join(root, tag)
    stalls, walls, commits = [], [], []
    with pitstop.CheckpointManager(d, keep_last=1) as mgr:
        for step in range(repeat + 1):
            gc.collect()
            if profile and step == repeat:
                prof = cProfile.Profile()
                prof.enable()
            t = time.perf_counter()
            h = mgr.save(step, state)
            t_saved = time.perf_counter()
            h.wait()
            t_done = time.perf_counter()
            if profile and step == repeat:
                prof.disable()
                prof.dump_stats(os.path.join(profile, f"{tag}-save.prof"))
            if step:  # the first save allocates the staging buffer
                walls.append(t_saved - t)
                stalls.append(h.stats.stall_s)
                commits.append(t_done - t)
        last = mgr.latest_step()
    out["save() wall"] = statistics.median(walls)
    out["stats.stall_s"] = statistics.median(stalls)
    out["save -> commit"] = statistics.median(commits)

    def restore() -> float:
        with pitstop.CheckpointManager(d, keep_last=1) as m2:
            gc.collect()
            t = time.perf_counter()
            got = m2.restore(state)
            dt = time.perf_counter() - t
        assert got == last, got
        return dt

    out["restore (warm)"] = median(restore, repeat)
    if profile:
        prof = cProfile.Profile()
        with pitstop.CheckpointManager(d, keep_last=1) as m2:
            prof.enable()
            m2.restore(state)
            prof.disable()
        prof.dump_stats(os.path.join(profile, f"{tag}-restore.prof"))

    def load() -> float:
        with pitstop.CheckpointManager(d, keep_last=1) as m2:
            gc.collect()
            t = time.perf_counter()
            m2.load()
            return time.perf_counter() - t

    out["load()"] = median(load, repeat)
    ckpt = os.path.join(d, step_name(last))
    with open(os.path.join(ckpt, "manifest.json"), "rb") as f:
        data = f.read()
    out["manifest bytes"] = float(len(data))

    def parse_once() -> float:
        t = time.perf_counter()
        parse(data, ckpt)
        return time.perf_counter() - t

    out["manifest parse"] = median(parse_once, repeat)
    from pitstop.core.storage.local import LocalStorage

    def verify() -> float:
        storage = LocalStorage(d)
        t = time.perf_counter()
        CheckpointReader(storage, os.path.basename(ckpt)).verify()
        return time.perf_counter() - t

    out["reader verify"] = median(verify, repeat)
    return out


def memory(state: dict[str, Any], root: str, saves: int) -> tuple[int, int, int]:
    """RSS after save 10, after the middle save and after the last one."""
    d = os.path.join(root, "memory")
    at10 = mid = 0
    with pitstop.CheckpointManager(d, keep_last=1) as mgr:
        for step in range(saves):
            mgr.save(step, state).wait()
            if step == 9:
                gc.collect()
                at10 = rss()
            if step == saves // 2 - 1:
                gc.collect()
                mid = rss()
        gc.collect()
        return at10, mid, rss()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=100_000)
    ap.add_argument("--elems", type=int, default=256)
    ap.add_argument("--few", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--kinds", default="numpy,torch")
    ap.add_argument("--memory", type=int, default=0, help="saves for the RSS growth figure")
    ap.add_argument("--profile", default=None, help="directory for cProfile output")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench-small-", dir=args.dir)
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    total = args.count * args.elems
    try:
        for kind in args.kinds.split(","):
            make = numpy_state if kind == "numpy" else torch_state
            many = make(args.count, args.elems)
            if many is None:
                print(f"({kind}: not installed)")
                continue
            a = measure(many, root, args.repeat, args.profile, f"{kind}-many")
            if args.memory:
                at10, mid, at_n = memory(many, root, args.memory)
            del many
            gc.collect()
            few = make(args.few, total // args.few)
            b = measure(few, root, args.repeat, None, f"{kind}-few")
            del few
            n_many = args.count * (2 if kind == "torch" else 1)
            n_few = args.few * (2 if kind == "torch" else 1)
            print(f"\n## {kind}: {n_many} tensors vs {n_few} tensors, "
                  f"{total * 4 * (n_many // args.count) / 2**20:.0f} MiB, median of "
                  f"{args.repeat}")
            print(f"| figure | {n_many} tensors | {n_few} tensors | ratio |")
            print("|---|---|---|---|")
            for k in a:
                unit = "" if k == "manifest bytes" else " s"
                fmt = "{:.0f}" if k == "manifest bytes" else "{:.4f}"
                print(f"| {k} | {fmt.format(a[k])}{unit} | {fmt.format(b[k])}{unit} | "
                      f"{a[k] / b[k] if b[k] else float('nan'):.2f} |")
            print(f"| stall / copy loop of the same tensors | {a['save() wall'] / a['copy loop']:.2f}"
                  f" | {b['save() wall'] / b['copy loop']:.2f} | |")
            if args.memory:
                print(f"\nRSS after save 10: {at10 / 2**20:.1f} MiB; after save "
                      f"{args.memory // 2}: {mid / 2**20:.1f} MiB; after save {args.memory}: "
                      f"{at_n / 2**20:.1f} MiB (growth {(at_n - at10) / 2**20:+.1f} MiB)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
