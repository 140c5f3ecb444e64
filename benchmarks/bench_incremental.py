"""Incremental checkpoints: bytes written per save, and time to commit, of a frozen-backbone
run with and without ``incremental=True``; and what the raw-bytes hash it adds costs when
compression is on and every array changes (its worst case).

    python benchmarks/bench_incremental.py [--mib 256] [--saves 5] [--dir /tmp/x]

A "frozen-backbone" state: a backbone (``--frozen`` of the bytes, default 75 %) that never
changes, and a head plus its two Adam moments that change at every step. Prints one
markdown table; figures are medians over the saves after the first (which writes in full).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile

import numpy as np

import pitstop

MiB = 1 << 20


def make_state(mib: int, frozen: float) -> tuple[dict, list[str]]:
    rng = np.random.default_rng(0)
    n_frozen = int(mib * frozen) // 16
    n_train = max(1, (mib - n_frozen * 16) // 16)
    state = {f"backbone/{i}": rng.standard_normal(4 * MiB, dtype=np.float32)
             for i in range(n_frozen)}
    train = []
    for i in range(n_train):
        k = f"head/{i}"
        state[k] = rng.standard_normal(4 * MiB, dtype=np.float32)
        train.append(k)
    return state, train


def data_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.startswith("data-"))


def run(root: str, state: dict, train: list[str], saves: int, **kw) -> dict:
    d = tempfile.mkdtemp(dir=root)
    written, persist, hashing = [], [], []
    try:
        with pitstop.CheckpointManager(d, memory_tier=False, save_on_signals=None,
                                       keep_last=2, **kw) as mgr:
            for s in range(saves + 1):
                for k in train:
                    state[k] += np.float32(1e-3)
                h = mgr.save(s, state)
                st = h.result()
                if s == 0:
                    continue  # the first save writes everything, with or without
                written.append(data_bytes(st.path))
                persist.append(st.persist_s)
                hashing.append(st.hash_s)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return {"written": statistics.median(written), "persist": statistics.median(persist),
            "hash": statistics.median(hashing), "all_p": persist}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--frozen", type=float, default=0.75)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    root = a.dir or tempfile.mkdtemp(prefix="bench-incremental-")
    os.makedirs(root, exist_ok=True)
    state, train = make_state(a.mib, a.frozen)
    total = sum(v.nbytes for v in state.values())
    print(f"state {total / MiB:.0f} MiB, {len(state)} arrays, "
          f"{sum(state[k].nbytes for k in train) / MiB:.0f} MiB change per step; "
          f"{a.saves} saves after the first, medians")
    print()
    print("| run | bytes written per save | / state | persist (s) | hash (s) |")
    print("|---|---|---|---|---|")
    rows = [("frozen backbone, full", {}), ("frozen backbone, incremental",
                                        {"incremental": True}),
            ("frozen backbone, zstd, full", {"compression": "zstd"}),
            ("frozen backbone, zstd, incremental", {"compression": "zstd",
                                                    "incremental": True})]
    for label, kw in rows:
        r = run(root, state, train, a.saves, **kw)
        print(f"| {label} | {r['written'] / MiB:.1f} MiB | {r['written'] / total:.3f} | "
              f"{r['persist']:.3f} | {r['hash']:.3f} |")
    # worst case for the added hash: compression on, every array changes
    every = list(state)
    for label, kw in [("every array changes, zstd, full", {"compression": "zstd"}),
                      ("every array changes, zstd, incremental",
                       {"compression": "zstd", "incremental": True})]:
        r = run(root, state, every, a.saves, **kw)
        print(f"| {label} | {r['written'] / MiB:.1f} MiB | {r['written'] / total:.3f} | "
              f"{r['persist']:.3f} | {r['hash']:.3f} |")
    if not a.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
