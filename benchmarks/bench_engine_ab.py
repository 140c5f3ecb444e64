"""A/B of two engine paths in one process, interleaved pair by pair (memory tier off):
hashing while writing vs hashing before writing (save -> durable, training time lost per
save), and a restore right after a save from the staging buffer vs from disk.

    python benchmarks/bench_engine_ab.py [GIB] [PAIRS]      # default 1 GiB, 4 pairs

Never part of the test run; docs/performance.md quotes its figures.
"""

import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_save import floor_memcpy, lost_to_one_save, make_state  # noqa: E402

import pitstop  # noqa: E402
from pitstop.core.save import engine as E  # noqa: E402


def save_and_train(mgr: pitstop.CheckpointManager, step: int, state: dict, w: np.ndarray,
                   g: np.ndarray) -> tuple[float, float]:
    """One save to durable commit (seconds), then the training time the next save costs a
    numpy loop that runs until its commit (bench_save.lost_to_one_save)."""
    t0 = time.perf_counter()
    mgr.save(step, state).wait()
    commit = time.perf_counter() - t0
    return commit, lost_to_one_save(mgr, step + 1, state, w, g)[1]


def main() -> None:
    size = int(float(sys.argv[1]) * (1 << 30)) if len(sys.argv) > 1 else 1 << 30
    pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    state = make_state(size)
    arrays = list(state["params"].values())
    dst = [np.zeros_like(a) for a in arrays]
    target = {"params": {k: np.zeros_like(a) for k, a in state["params"].items()}, "step": 0}
    w = np.ones(4 << 20, np.float32)
    g = np.ones_like(w)
    fused, hold = E.Engine._fused, E.Engine.hold_staged
    res: dict[str, list[float]] = {k: [] for k in (
        "commit_fused", "commit_serial", "lost_fused", "lost_serial", "restore_staged",
        "restore_disk", "memcpy")}
    d = tempfile.mkdtemp(prefix="pitstop-ab-", dir=os.path.dirname(os.path.abspath(__file__)))
    step = 1
    try:
        with pitstop.CheckpointManager(d, memory_tier=False, save_on_signals=(),
                                       keep_last=1) as mgr:
            mgr.save(0, state).wait()
            for rep in range(pairs):
                res["memcpy"].append(floor_memcpy(arrays, dst))
                for mode in ("fused", "serial")[::1 if rep % 2 == 0 else -1]:
                    E.Engine._fused = fused if mode == "fused" else (  # type: ignore[method-assign]
                        lambda self, job: False)
                    commit, lost = save_and_train(mgr, step, state, w, g)
                    step += 2
                    res[f"commit_{mode}"].append(commit)
                    res[f"lost_{mode}"].append(lost)
                E.Engine._fused = fused  # type: ignore[method-assign]
                for mode in ("staged", "disk")[::1 if rep % 2 == 0 else -1]:
                    mgr.save(step, state).wait()
                    step += 1
                    E.Engine.hold_staged = hold if mode == "staged" else (  # type: ignore[method-assign]
                        lambda self, name: None)
                    t = time.perf_counter()
                    mgr.restore(target)
                    res[f"restore_{mode}"].append(time.perf_counter() - t)
                E.Engine.hold_staged = hold  # type: ignore[method-assign]
    finally:
        shutil.rmtree(d, ignore_errors=True)
    for k, v in res.items():
        print(f"{k}: median {statistics.median(v):.3f} s  ({', '.join(f'{x:.3f}' for x in v)})")


if __name__ == "__main__":
    main()
