"""Save, commit and restore against the physical floors of the same run.

For each state size (fp32 "weights + Adam m + v" split over several arrays) this measures,
in one process and one run:

* floors: memcpy into preallocated buffers; one file written from memory with fsync;
  a warm read-back of that file into preallocated memory;
* pitstop: the training-thread stall of ``save``; training time lost per save (stall plus
  the slowdown of a numpy training loop's steps until the commit); save-to-durable-commit;
  ``restore`` into live arrays (hashes verified); extra memory while saving and restoring;
* what a background persist costs the training thread: the speed of a numpy loop and of a
  pure-Python loop while a persist runs (threads, as pitstop does it), and while the same
  bytes are hashed and written by a separate process reading the shared-memory snapshot.

Every figure is reported as a ratio to its floor. Run: ``python benchmarks/bench_save.py
--sizes 64M,1G`` (``make bench``). ``--encryption`` adds, per size, the same figures with
``encryption=pitstop.Encryption(...)`` (AES-256-GCM), measured against the same floors in the
same run, and their ratio to the plaintext ones. Never part of the test run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np

import pitstop
from pitstop.core.manager import step_name

ARRAYS = 24


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def make_state(nbytes: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    per = nbytes // 4 // ARRAYS
    arrays = {f"p{i:02d}": rng.standard_normal(per, dtype=np.float32) for i in range(ARRAYS)}
    return {"params": arrays, "step": 0}


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples RSS every millisecond on a thread; ``peak`` is the largest seen."""

    def __init__(self) -> None:
        self.peak = rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __enter__(self) -> PeakRSS:
        self._t.start()
        return self

    def __exit__(self, *a: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())


def train_step(w: np.ndarray, g: np.ndarray) -> None:
    """A CPU 'training step': a few memory-bound numpy passes over a fixed working set."""
    np.multiply(g, 0.999, out=g)
    np.add(w, g, out=w)
    np.multiply(w, 1.0001, out=w)


def thread_cpu() -> float:
    """CPU seconds (user + system) of the calling thread so far."""
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime + r.ru_stime


def process_cpu() -> float:
    """CPU seconds (user + system) of this process, all its threads, so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def passes_during(step: Callable[[], object], done: Callable[[], bool]) -> tuple[int, float]:
    """``step()`` back to back until ``done()``: how many calls, and their wall time."""
    t = time.perf_counter()
    k = 0
    while not done():
        step()
        k += 1
    return k, time.perf_counter() - t


def pass_time(step: Callable[[], object], n: int = 5) -> float:
    """The mean wall time of ``n`` calls of ``step()``."""
    t = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t) / n


def lost_in_passes(stall: float, k: int, wall: float, before: float, after: float) -> float:
    """Time lost to one save by a loop of passes run back to back from its return until it
    is durable: the stall, plus the ``k`` passes' ``wall`` time minus the same passes at
    their plain speed (the mean of the pass times just ``before`` and just ``after``, so
    drift cancels)."""
    return stall + wall - k * (before + after) / 2


def floor_memcpy(arrays: list[np.ndarray], dst: list[np.ndarray]) -> float:
    t = time.perf_counter()
    for d, a in zip(dst, arrays, strict=True):
        np.copyto(d, a)
    return time.perf_counter() - t


def floor_write(arrays: list[np.ndarray], path: str) -> float:
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for a in arrays:
        mv = memoryview(a).cast("B")
        while mv:
            mv = mv[os.write(fd, mv):]
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - t


def floor_read(dst: list[np.ndarray], ckpt: str) -> float:
    """Read the same bytes (the checkpoint's own data files, so placement and page-cache
    state are the same) into preallocated arrays: no hashing, no checks."""
    with open(os.path.join(ckpt, "manifest.json"), "rb") as f:
        entries = list(json.load(f)["arrays"].values())
    t = time.perf_counter()
    fds: dict[str, int] = {}
    for d, e in zip(dst, entries, strict=True):
        fd = fds.get(e["file"])
        if fd is None:
            fd = fds[e["file"]] = os.open(os.path.join(ckpt, e["file"]), os.O_RDONLY)
        os.preadv(fd, [memoryview(d).cast("B")], e["offset"])
    for fd in fds.values():
        os.close(fd)
    return time.perf_counter() - t


def lost_to_one_save(mgr: pitstop.CheckpointManager, step: int, state: dict, w: np.ndarray,
                     g: np.ndarray) -> tuple[float, float]:
    """Training time lost to one save: a numpy loop runs from ``save()`` until the commit;
    returns its wall time and that time minus its steps at their plain speed (measured just
    before and just after, so drift cancels): the stall plus the slowdown until the commit."""
    for _ in range(5):
        train_step(w, g)
    t = time.perf_counter()
    for _ in range(30):
        train_step(w, g)
    step_s = (time.perf_counter() - t) / 30
    t0 = time.perf_counter()
    h = mgr.save(step, state)
    steps = 0
    while not h.done():
        train_step(w, g)
        steps += 1
    t1 = time.perf_counter()
    h.wait()
    t = time.perf_counter()
    for _ in range(30):
        train_step(w, g)
    step_s = (step_s + (time.perf_counter() - t) / 30) / 2
    return t1 - t0, max(0.0, (t1 - t0) - steps * step_s)


def measure(state: dict, workdir: str, reps: int, memory_tier: bool,
            writer_threads: int | None = None, encryption: object = None) -> dict:
    """Each figure next to its floor, interleaved rep by rep (floor, pitstop, floor, ...) so
    drift of this shared machine hits both; ratios are medians of per-rep ratios."""
    d = os.path.join(workdir, "ckpt")
    floor_path = os.path.join(workdir, "floor.bin")
    shutil.rmtree(d, ignore_errors=True)
    arrays = list(state["params"].values())
    nbytes = sum(a.nbytes for a in arrays)
    dst = [np.zeros_like(a) for a in arrays]
    w = np.ones(4 << 20, np.float32)
    g = np.ones_like(w)
    rows: dict[str, list[float]] = {k: [] for k in (
        "memcpy", "write_fsync", "read_warm", "stall", "save_to_commit", "save_to_commit_training",
        "lost_per_save", "restore")}
    out: dict = {}
    target = {"params": {k: np.zeros_like(a) for k, a in state["params"].items()}, "step": 0}
    with pitstop.CheckpointManager(d, memory_tier=memory_tier, save_on_signals=(),
                                   writer_threads=writer_threads, encryption=encryption) as mgr:
        base_rss = rss()
        with PeakRSS() as peak:
            mgr.save(0, state).wait()  # allocates the staging buffer, once
        out["extra_mem_first_save"] = (peak.peak - base_rss) / nbytes
        reader = pitstop.CheckpointManager(d, read_only=True, encryption=encryption)
        reader.restore(target, step=0)  # warm the page cache, as the floor's read is warm
        base = rss()
        with PeakRSS() as peak:
            reader.restore(target, step=0)
        out["extra_mem_restore"] = (peak.peak - base) / nbytes
        floor_memcpy(arrays, dst)
        for rep in range(reps):
            step = 2 * rep + 1
            rows["memcpy"].append(floor_memcpy(arrays, dst))
            t0 = time.perf_counter()
            h = mgr.save(step, state)
            rows["stall"].append(time.perf_counter() - t0)
            h.wait()
            rows["save_to_commit"].append(time.perf_counter() - t0)
            rows["write_fsync"].append(floor_write(arrays, floor_path))
            loop_s, lost_s = lost_to_one_save(mgr, step + 1, state, w, g)
            rows["save_to_commit_training"].append(loop_s)
            rows["lost_per_save"].append(lost_s)
            rows["read_warm"].append(floor_read(dst, os.path.join(d, step_name(0))))
            t = time.perf_counter()
            reader.restore(target, step=0)
            rows["restore"].append(time.perf_counter() - t)
        reader.close()
    os.unlink(floor_path)
    for k in state["params"]:
        assert np.array_equal(target["params"][k], state["params"][k])
    shutil.rmtree(d, ignore_errors=True)
    for k, v in rows.items():
        out[k] = statistics.median(v)
    pairs = {"stall/memcpy": ("stall", "memcpy"), "lost/memcpy": ("lost_per_save", "memcpy"),
             "commit/write": ("save_to_commit", "write_fsync"),
             "restore/read": ("restore", "read_warm")}
    for name, (a, b) in pairs.items():
        out[name] = statistics.median(x / y for x, y in zip(rows[a], rows[b], strict=True))
    return out


def loop_speed(fn, seconds: float, stop: threading.Event | None = None) -> float:
    n = 0
    t = time.perf_counter()
    end = t + seconds
    while time.perf_counter() < end and not (stop is not None and stop.is_set()):
        fn()
        n += 1
    return n / (time.perf_counter() - t)


def py_step() -> None:
    s = 0
    for i in range(2000):
        s += i * i


_NP_STEP_A = np.ones((192, 192), np.float32)


def np_step(a: np.ndarray = _NP_STEP_A) -> None:
    a @ a


_PROC_WRITER = r"""
import mmap, os, sys, xxhash
src, dst = sys.argv[1], sys.argv[2]
fd = os.open(src, os.O_RDONLY); size = os.fstat(fd).st_size
mm = mmap.mmap(fd, size, prot=mmap.PROT_READ); mv = memoryview(mm)
h = xxhash.xxh3_128()
for p in range(0, size, 8 << 20): h.update(mv[p:p + (8 << 20)])
out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
for p in range(0, size, 32 << 20):
    b = mv[p:p + (32 << 20)]
    while b: b = b[os.write(out, b):]
os.fsync(out); os.close(out)
"""


def contention(state: dict, workdir: str) -> dict:
    """Loop speed while a persist runs: pitstop's threads vs a separate writer process."""
    res: dict = {}
    for name, fn in (("numpy_loop", np_step), ("python_loop", py_step)):
        idle = loop_speed(fn, 1.0)
        d = os.path.join(workdir, "c")
        shutil.rmtree(d, ignore_errors=True)
        speeds = []
        with pitstop.CheckpointManager(d, memory_tier=False, save_on_signals=()) as mgr:
            mgr.save(0, state).wait()
            for step in range(1, 3):
                h = mgr.save(step, state)
                done = threading.Event()
                threading.Thread(target=lambda h=h, done=done: (h.wait(), done.set()),
                                 daemon=True).start()
                speeds.append(loop_speed(fn, 30.0, done))
        res[f"{name}_threads"] = statistics.median(speeds) / idle
        # the alternative design: a persister process reading the /dev/shm snapshot
        shm = "/dev/shm/pitstop-bench.buf"
        with open(shm, "wb") as f:
            for a in state["params"].values():
                f.write(memoryview(a).cast("B"))
            f.truncate(-(-f.tell() // 4096) * 4096)  # O_DIRECT writes whole pages
        speeds = []
        for _ in range(2):
            p = subprocess.Popen([sys.executable, "-c", _PROC_WRITER, shm,
                                  os.path.join(workdir, "proc.bin")])
            done = threading.Event()
            threading.Thread(target=lambda p=p, done=done: (p.wait(), done.set()),
                             daemon=True).start()
            speeds.append(loop_speed(fn, 30.0, done))
        os.unlink(shm)
        res[f"{name}_process"] = statistics.median(speeds) / idle
        shutil.rmtree(d, ignore_errors=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64M,1G")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir on /tmp)")
    ap.add_argument("--memory-tier", action="store_true", help="stage in /dev/shm")
    ap.add_argument("--writer-threads", type=int, default=None)
    ap.add_argument("--no-contention", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--encryption", action="store_true",
                    help="also measure every size with AES-256-GCM encryption at rest")
    args = ap.parse_args()
    workdir = args.dir or tempfile.mkdtemp(prefix="pitstop-bench-")
    os.makedirs(workdir, exist_ok=True)
    rows = []
    for text in args.sizes.split(","):
        n = parse_size(text)
        state = make_state(n)
        p = measure(state, workdir, args.reps, args.memory_tier, args.writer_threads)
        c = {} if args.no_contention else contention(state, workdir)
        row = {"size": text, "bytes": n, **p, **c}
        rows.append(row)
        if args.encryption:
            key = os.urandom(32)
            e = measure(state, workdir, args.reps, args.memory_tier, args.writer_threads,
                        pitstop.Encryption(lambda key=key: key))
            e.update({f"{k} vs plain": e[k] / p[k] for k in (
                "stall", "save_to_commit", "restore", "lost_per_save") if p[k] > 0})
            rows.append({"size": text + " aes-256-gcm", "bytes": n, **e})
        del state
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        target = {"stall/memcpy": 1.3, "lost/memcpy": 1.5, "commit/write": 1.1,
                  "restore/read": 1.3, "extra_mem_first_save": 1.05, "extra_mem_restore": 0.25,
                  "numpy_loop_threads": 0.60, "python_loop_threads": 0.95}
        for row in rows:
            print(f"\n== {row['size']} ({row['bytes'] / 2**20:.0f} MiB); floors (medians): "
                  f"memcpy {row['memcpy']:.3f} s, write+fsync {row['write_fsync']:.3f} s, "
                  f"warm read {row['read_warm']:.3f} s")
            print(f"   stall {row['stall']:.3f} s, lost/save {row['lost_per_save']:.3f} s, "
                  f"save->commit {row['save_to_commit']:.3f} s (while training: "
                  f"{row['save_to_commit_training']:.3f} s), restore {row['restore']:.3f} s")
            for k, goal in target.items():
                if k in row:
                    v = row[k]
                    ok = v >= goal if k.endswith(("_threads",)) else v <= goal
                    print(f"   {k:24s} {v:7.3f}   (target {'>=' if k.endswith('_threads') else '<='} "
                          f"{goal}) {'ok' if ok else 'MISS'}")
            for k in ("stall vs plain", "save_to_commit vs plain", "restore vs plain",
                      "lost_per_save vs plain"):
                if k in row:
                    print(f"   {k:24s} {row[k]:7.3f}   (encrypted / plaintext, same run)")
            for k in ("numpy_loop_process", "python_loop_process"):
                if k in row:
                    print(f"   {k:24s} {row[k]:7.3f}   (alternative: separate writer process)")
    if not args.dir:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\nmax RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB",
          file=sys.stderr)


if __name__ == "__main__":
    main()
