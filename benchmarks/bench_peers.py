"""pitstop and its peers, side by side on the same state, each in a fresh process.

One command, one markdown table. For each state size (fp32 "weights + Adam m + v", in each
framework's own objects) and each peer, a child process (``--child save``) does one warm-up
save and ``--reps`` measured saves, then runs a fixed CPU training loop with and without one
save in it, then measures one save's background CPU, a numpy loop's speed while a save
persists, and the time lost by optimizer passes run back to back during a save (torch with its
default threads); a second fresh child (``--child restore``) restores into live objects, warm (the
page cache as the save left it) and cold (the checkpoint's files dropped from the page cache).
The floors (memcpy into preallocated memory, one file written + fsync, the same file read warm
and cold) are measured in the same run, and every figure is printed as a ratio to its floor
and to the best peer's (pitstop rows excluded from "best peer"). Definitions:
docs/performance.md.

    python benchmarks/bench_peers.py                      # 64M,1G,4G + 100,000 small tensors
    python benchmarks/bench_peers.py --quick              # 64M, 1 rep, for development
    python benchmarks/bench_peers.py --sizes 64M --peers torch.save,pitstop --json out.json

Never part of the test run (tests/test_bench_peers.py runs a 4M smoke check only).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_save import (  # noqa: E402
    PeakRSS,
    floor_memcpy,
    floor_write,
    loop_speed,
    lost_in_passes,
    parse_size,
    pass_time,
    passes_during,
    process_cpu,
    rss,
    thread_cpu,
    train_step,
)

import pitstop  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
#: parameters in a regular state; with Adam's m and v that is 63 arrays (+ step counters)
PARAMS = 21
#: bytes of one tensor in the --small case
SMALL_TENSOR = 1024

PITSTOP_OPTIONS: dict[str, dict[str, Any]] = {
    "pitstop": {"memory_tier": False},
    "pitstop+memtier": {"memory_tier": True},
    "pitstop+zstd": {"memory_tier": False, "compression": "zstd+shuffle"},
    "pitstop+lazy": {"memory_tier": False, "snapshot": "lazy"},
    "pitstop+incremental": {"memory_tier": False, "incremental": True},
    "pitstop+hash_in_copy": {"memory_tier": False, "hash_in_copy": True},
}
PEERS = ["torch.save", "dcp.save", "dcp.async_save", "tf.Checkpoint", "tf.Checkpoint+async",
         "keras.ModelCheckpoint", "orbax.CheckpointManager", *PITSTOP_OPTIONS]
#: the rows of the --small case (and of the same bytes in 63 tensors): torch's own and
#: pitstop's default; each of them takes minutes with 100,000 tensors on 2 cores
SMALL_PEERS = {"torch.save", "dcp.save", "dcp.async_save", "pitstop"}
KERAS_BACKEND = "tensorflow"
#: The training step runs on one core in every framework (torch.set_num_threads(1), TF
#: intra/inter-op 1, XLA without its thread pool): on this 2-core machine the other core is
#: what a checkpointer's background work runs on. With torch's default 2 OpenMP threads, any
#: other load made Adam steps ~15x slower and the lost-time figure noise.
THREADS = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"}
LOST_SECONDS = [4.0]  # set from --lost-seconds, handed to every child
#: a peer whose warm-up save took longer gets one measured save and one cold restore (the
#: notes say so): DCP with 100,000 tensors takes ~30 s a save on 2 cores
SLOW_SAVE_S = 20.0
SLOW_SMALL_S = 5.0  # the same in the 100,000-tensor case, where every peer takes seconds


def slow_s(spec: dict[str, Any]) -> float:
    """Above this warm-up save (or warm restore) time a peer gets one measured rep."""
    return SLOW_SMALL_S if spec["label"].startswith("small:") else SLOW_SAVE_S


# --------------------------------------------------------------------------------------------
# the state: sizes, fingerprints, page cache, disk


def shapes(nbytes: int, nparams: int) -> list[int]:
    """Element counts of ``nparams`` equal parameters whose weights + m + v make ``nbytes``."""
    return [max(1, nbytes // 4 // 3 // nparams)] * nparams


def spec_of(label: str) -> dict[str, Any]:
    """``64M`` -> 21 parameters of that total; ``small:100000`` -> 100000 tensors of 1 KiB;
    ``as63:100000`` -> the same bytes as ``small:100000`` in 21 parameters (63 tensors)."""
    if label.startswith("small:"):
        n = int(label.split(":")[1])
        p = n // 3
        return {"label": label, "nparams": p, "elems": SMALL_TENSOR // 4,
                "bytes": p * 3 * SMALL_TENSOR}
    if label.startswith("as63:"):
        n = int(label.split(":")[1])
        total = (n // 3) * 3 * SMALL_TENSOR
        e = total // 4 // 3 // PARAMS
        return {"label": label, "nparams": PARAMS, "elems": e, "bytes": e * 4 * 3 * PARAMS}
    n = parse_size(label)
    e = shapes(n, PARAMS)[0]
    return {"label": label, "nparams": PARAMS, "elems": e, "bytes": e * 4 * 3 * PARAMS}


def random_arrays(spec: dict[str, Any], seed: int, scale: float) -> list[np.ndarray]:
    """``nparams`` random arrays; a 16 MiB random block tiled (each array scaled and shifted
    differently) when they are large, so a 4 GiB state is made at memcpy speed. The block is
    far larger than zstd's window, so compression ratios stay those of random data."""
    rng = np.random.default_rng(seed)
    e, n = spec["elems"], spec["nparams"]
    if e * n <= 4 << 20:
        return [rng.standard_normal(e, dtype=np.float32) * np.float32(scale) for _ in range(n)]
    block = rng.standard_normal(4 << 20, dtype=np.float32) * np.float32(scale)
    out = []
    for i in range(n):
        a = np.empty(e, np.float32)
        for p in range(0, e, block.size):
            k = min(block.size, e - p)
            src = np.roll(block, 7919 * i)[:k] if p == 0 else block[:k]
            np.multiply(src, np.float32(1.0 + 0.01 * i), out=a[p:p + k])
        out.append(a)
    return out


def init_values(spec: dict[str, Any], seed: int = 0) -> list[np.ndarray]:
    """The weights (random, so that compression figures are honest)."""
    return random_arrays(spec, seed, 0.02)


def grad_values(spec: dict[str, Any], restore: bool) -> list[np.ndarray]:
    """Fixed gradients: random, so Adam's m and v are as incompressible as real ones."""
    if restore:
        return [np.zeros(spec["elems"], np.float32) for _ in range(spec["nparams"])]
    return random_arrays(spec, 1, 1e-3)


def fingerprint(arrays: list[np.ndarray]) -> float:
    """A cheap sum over the ends of every array, to check a restore brought the bytes back."""
    s = 0.0
    for a in arrays:
        a = np.asarray(a).reshape(-1)
        s += float(a[:64].astype(np.float64).sum()) + float(a[-64:].astype(np.float64).sum())
    return s


def files_under(path: str | list[str]) -> list[str]:
    if isinstance(path, list):
        return path
    if os.path.isfile(path):
        return [path]
    out = []
    for root, _dirs, names in os.walk(path):
        out.extend(os.path.join(root, n) for n in names)
    return out


def fsync_tree(path: str) -> None:
    """Make what a peer wrote durable (a no-op for files it already fsynced)."""
    for f in files_under(path):
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    d = path if os.path.isdir(path) else os.path.dirname(path)
    fd = os.open(d, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def drop_cache(path: str | list[str]) -> str:
    """Drop ``path``'s files from the page cache; says how."""
    os.sync()
    if os.access("/proc/sys/vm/drop_caches", os.W_OK):
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "drop_caches"
        except OSError:
            pass
    for f in files_under(path):
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def disk_bytes(path: str | list[str]) -> int:
    total = 0
    for f in files_under(path):
        try:
            total += os.stat(f).st_blocks * 512
        except OSError:
            pass
    return total


def io_written() -> int:
    """Bytes this process sent to the storage layer so far (/proc/self/io)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


# --------------------------------------------------------------------------------------------
# frameworks: the state in native objects, and one training step on it


class Compute:
    """The stand-in for forward/backward: memory-bound numpy passes over a separate working
    set (half the weights' size per array, 4-256 MiB), the same for every peer."""

    def __init__(self, spec: dict[str, Any]) -> None:
        n = min(max(spec["bytes"] // 6, 4 * MiB), 256 * MiB) // 4
        self.w = np.ones(n, np.float32)
        self.g = np.ones(n, np.float32)

    def __call__(self) -> None:
        train_step(self.w, self.g)


class TorchState:
    def __init__(self, spec: dict[str, Any], restore: bool, frozen: float = 0.0) -> None:
        import torch

        torch.set_num_threads(1)  # see THREADS
        self.torch = torch
        vals = init_values(spec)
        p = [torch.nn.Parameter(torch.full((spec["elems"],), 1.0) if restore
                                else torch.from_numpy(v)) for v in vals]
        nfrozen = int(len(p) * frozen)
        for q in p[:nfrozen]:
            q.requires_grad_(False)
        self.model = torch.nn.Module()
        self.model.params = torch.nn.ParameterList(p)
        trainable = [q for q in p if q.requires_grad]
        self.opt = torch.optim.Adam(trainable, lr=1e-4)
        for q, g in zip(trainable, grad_values(spec, restore), strict=False):
            q.grad = torch.from_numpy(g)
        self.opt.step()  # the optimizer's state exists, as in a job that has trained

    def step(self) -> None:
        self.opt.step()

    def arrays(self) -> list[np.ndarray]:
        out = [q.detach().numpy() for q in self.model.params]
        for st in self.opt.state.values():
            out += [st["exp_avg"].numpy(), st["exp_avg_sq"].numpy()]
        return out

    def sd(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def pitstop_state(self) -> dict[str, Any]:
        return {"model": self.model, "optim": self.opt}


class TFState:
    """tf.Variables and a Keras 3 Adam (TensorFlow backend) with its slots."""

    def __init__(self, spec: dict[str, Any], restore: bool, keras_model: bool = False) -> None:
        import keras
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)  # see THREADS
        tf.config.threading.set_inter_op_parallelism_threads(1)
        self.tf = tf
        vals = init_values(spec)
        if keras_model:
            class Blob(keras.Model):
                def __init__(self) -> None:
                    super().__init__()
                    self.ws = [self.add_weight(shape=(spec["elems"],), initializer="ones",
                                               name=f"w{i}") for i in range(spec["nparams"])]
                    self.built = True

                def call(self, x: Any) -> Any:
                    return x

            self.model = Blob()
            self.vars = list(self.model.ws)
            if not restore:
                for v, a in zip(self.vars, vals, strict=True):
                    v.assign(a)
        else:
            self.vars = [tf.Variable(np.ones(spec["elems"], np.float32) if restore else a)
                         for a in vals]
        self.opt = keras.optimizers.Adam(1e-4)
        if keras_model:
            self.model.compile(optimizer=self.opt, loss="mse")
        self.opt.build(self.vars)
        self.grads = [tf.constant(g) for g in grad_values(spec, restore)]
        pairs = list(zip(self.grads, self.vars, strict=True))
        self._step = tf.function(lambda: self.opt.apply_gradients(pairs))
        self._step()

    def step(self) -> None:
        self._step()

    def arrays(self) -> list[np.ndarray]:
        slots = [v for v in self.opt.variables if len(v.shape) == 1]
        return [v.numpy() for v in self.vars] + [v.numpy() for v in slots]


class JaxState:
    """jax arrays and an optax adam state, updated by a jitted step (as JAX does it: new
    arrays each step)."""

    def __init__(self, spec: dict[str, Any], restore: bool) -> None:
        import jax
        import jax.numpy as jnp
        import optax

        vals = init_values(spec)
        self.params = {f"p{i:05d}": jnp.asarray(np.ones(spec["elems"], np.float32) if restore
                                                else v) for i, v in enumerate(vals)}
        tx = optax.adam(1e-4)
        self.opt_state = tx.init(self.params)
        grads = dict(zip(self.params, map(jnp.asarray, grad_values(spec, restore)), strict=True))

        @jax.jit
        def update(params: Any, opt_state: Any) -> Any:
            u, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, u), opt_state

        self._update = update
        self.step()
        jax.block_until_ready(self.params)

    def step(self) -> None:
        """One update, waited for (as a loop that reads its loss does; without the wait JAX's
        async dispatch queues the work and the step times mean nothing)."""
        import jax

        self.params, self.opt_state = self._update(self.params, self.opt_state)
        jax.block_until_ready((self.params, self.opt_state))

    def tree(self) -> dict[str, Any]:
        return {"params": self.params, "opt": self.opt_state}

    def arrays(self) -> list[np.ndarray]:
        import jax

        return [np.asarray(x) for x in jax.tree.leaves(self.tree()) if np.ndim(x) >= 1]


# --------------------------------------------------------------------------------------------
# peers: save(step) -> a waiter for the durable commit; restore() into the live objects

Waiter = Callable[[], None]


class Peer:
    name = ""

    def __init__(self, spec: dict[str, Any], wd: str, restore: bool) -> None:
        self.spec = spec
        self.wd = wd
        self.dir = os.path.join(wd, "ckpt")
        os.makedirs(self.dir, exist_ok=True)
        self.state: Any = None
        self.last: str | None = None

    def step(self) -> None:
        self.state.step()

    def arrays(self) -> list[np.ndarray]:
        return self.state.arrays()

    def save(self, step: int) -> Waiter:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def retire(self) -> None:
        """Delete checkpoints older than the newest (untimed; managers do their own)."""
        for n in os.listdir(self.dir):
            p = os.path.join(self.dir, n)
            if self.last is not None and not p.startswith(self.last):
                shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)

    def newest(self) -> list[str]:
        """The files of the newest checkpoint."""
        if self.last is None:
            return files_under(self.dir)
        if os.path.exists(self.last):
            return files_under(self.last)
        return [f for f in files_under(self.dir) if f.startswith(self.last)]

    def close(self) -> None:
        pass


class TorchSave(Peer):
    name = "torch.save"

    def __init__(self, spec: dict[str, Any], wd: str, restore: bool) -> None:
        super().__init__(spec, wd, restore)
        self.state = TorchState(spec, restore)

    def save(self, step: int) -> Waiter:
        path = self.last = os.path.join(self.dir, f"{step:08d}.pt")
        self.state.torch.save(self.state.sd(), path)
        return lambda: fsync_tree(path)

    def restore(self) -> None:
        path = sorted(files_under(self.dir))[-1]
        sd = self.state.torch.load(path, weights_only=True)
        self.state.model.load_state_dict(sd["model"])
        self.state.opt.load_state_dict(sd["optim"])


class DCP(Peer):
    name = "dcp.save"
    is_async = False

    def __init__(self, spec: dict[str, Any], wd: str, restore: bool) -> None:
        super().__init__(spec, wd, restore)
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        self.state = TorchState(spec, restore)

    def save(self, step: int) -> Waiter:
        path = self.last = os.path.join(self.dir, f"{step:08d}")
        if self.is_async:
            f = self.dcp.async_save(self.state.sd(), checkpoint_id=path)
            return lambda: (f.result(), fsync_tree(path))  # type: ignore[func-returns-value]
        self.dcp.save(self.state.sd(), checkpoint_id=path)
        return lambda: fsync_tree(path)

    def restore(self) -> None:
        path = os.path.join(self.dir, sorted(os.listdir(self.dir))[-1])
        sd = self.state.sd()
        self.dcp.load(sd, checkpoint_id=path)
        self.state.model.load_state_dict(sd["model"])
        self.state.opt.load_state_dict(sd["optim"])


class DCPAsync(DCP):
    name = "dcp.async_save"
    is_async = True


class TFCheckpoint(Peer):
    name = "tf.Checkpoint"
    is_async = False

    def __init__(self, spec: dict[str, Any], wd: str, restore: bool) -> None:
        super().__init__(spec, wd, restore)
        self.state = TFState(spec, restore)
        tf = self.state.tf
        # the optimizer's slots as their tf.Variables: tf's async option fails on a Keras 3
        # optimizer object ("tf.function only supports singleton tf.Variables created on the
        # first call", keras/src/backend/tensorflow/core.py _copy_trackable_to_cpu); the same
        # bytes, for the sync and async rows alike
        slots = [getattr(v, "value", v) for v in self.state.opt.variables]
        self.ckpt = tf.train.Checkpoint(vars=self.state.vars, slots=slots)
        self.options = tf.train.CheckpointOptions(
            experimental_enable_async_checkpoint=self.is_async)

    def save(self, step: int) -> Waiter:
        prefix = self.last = os.path.join(self.dir, f"{step:08d}")
        self.ckpt.write(prefix, options=self.options)
        if self.is_async:
            return lambda: (self.ckpt.sync(), fsync_tree(self.dir))  # type: ignore[func-returns-value]
        return lambda: fsync_tree(self.dir)

    def restore(self) -> None:
        prefix = sorted(files_under(self.dir))[-1].rsplit(".", 1)[0]
        self.ckpt.read(prefix).assert_existing_objects_matched()


class TFCheckpointAsync(TFCheckpoint):
    name = "tf.Checkpoint+async"
    is_async = True


class KerasCheckpoint(Peer):
    name = "keras.ModelCheckpoint"

    def __init__(self, spec: dict[str, Any], wd: str, restore: bool) -> None:
        super().__init__(spec, wd, restore)
        import keras

        self.state = TFState(spec, restore, keras_model=True)
        self.path = self.last = os.path.join(self.dir, "ckpt.weights.h5")
        self.cb = keras.callbacks.ModelCheckpoint(self.path, save_weights_only=True)
        self.cb.set_model(self.state.model)

    def save(self, step: int) -> Waiter:
        self.cb.on_epoch_end(step, {})
        return lambda: fsync_tree(self.path)

    def restore(self) -> None:
        self.state.model.load_weights(self.path)

    def retire(self) -> None:
        pass


class Orbax(Peer):
    name = "orbax.CheckpointManager"

    def __init__(self, spec: dict[str, Any], wd: str, restore: bool) -> None:
        super().__init__(spec, wd, restore)
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.state = JaxState(spec, restore)
        self.mgr = ocp.CheckpointManager(os.path.abspath(self.dir), options=(
            ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=True)))

    def save(self, step: int) -> Waiter:
        self.mgr.save(step, args=self.ocp.args.StandardSave(self.state.tree()))
        return lambda: (self.mgr.wait_until_finished(), fsync_tree(self.dir))  # type: ignore[func-returns-value]

    def restore(self) -> None:
        r = self.mgr.restore(self.mgr.latest_step(),
                             args=self.ocp.args.StandardRestore(self.state.tree()))
        self.state.params, self.state.opt_state = r["params"], r["opt"]

    def retire(self) -> None:
        pass

    def close(self) -> None:
        self.mgr.wait_until_finished()
        self.mgr.close()


class Pitstop(Peer):
    def __init__(self, spec: dict[str, Any], wd: str, restore: bool, name: str,
                 frozen: float = 0.0, **extra: Any) -> None:
        super().__init__(spec, wd, restore)
        self.name = name
        self.state = TorchState(spec, restore, frozen=frozen)
        opts = {"keep_last": 1, **PITSTOP_OPTIONS[name], **extra}  # as the peers keep one
        self.mgr = pitstop.CheckpointManager(self.dir, save_on_signals=(), **opts)
        self.stats: Any = None

    def save(self, step: int) -> Waiter:
        h = self.mgr.save(step, self.state.pitstop_state())

        def wait() -> None:
            self.stats = h.result()
            fsync_tree(self.dir)
        return wait

    def restore(self) -> None:
        self.mgr.restore(self.state.pitstop_state())

    def retire(self) -> None:
        pass

    def newest(self) -> list[str]:
        s = self.mgr.latest_step()
        from pitstop.core.manager import step_name
        return files_under(os.path.join(self.dir, step_name(s)) if s is not None else self.dir)

    def close(self) -> None:
        self.mgr.close()


PEER_CLASSES: dict[str, type[Peer]] = {c.name: c for c in (
    TorchSave, DCP, DCPAsync, TFCheckpoint, TFCheckpointAsync, KerasCheckpoint, Orbax)}


def make_peer(name: str, spec: dict[str, Any], wd: str, restore: bool, **kw: Any) -> Peer:
    if name in PITSTOP_OPTIONS:
        return Pitstop(spec, wd, restore, name, **kw)
    return PEER_CLASSES[name](spec, wd, restore)


def pitstop_available() -> dict[str, str | None]:
    """Each pitstop row -> None when it can run, else why not (an option not built yet)."""
    params = inspect.signature(pitstop.CheckpointManager).parameters
    out: dict[str, str | None] = {}
    for name, opts in PITSTOP_OPTIONS.items():
        missing = [k for k in opts if k not in params]
        out[name] = f"skipped: CheckpointManager has no {missing[0]}= yet" if missing else None
    return out


# --------------------------------------------------------------------------------------------
# the child: one (peer, size), one process


def timed_save(peer: Peer, step: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    wait = peer.save(step)
    stall = time.perf_counter() - t0
    wait()
    return stall, time.perf_counter() - t0


def child_save(peer_name: str, spec: dict[str, Any], wd: str, reps: int,
               lost_seconds: float = 4.0) -> dict[str, Any]:
    """Warm-up save, ``reps`` measured saves (stall, commit, memory), then the training loop
    with and without one save (lost time), then a last save for the restore child to read."""
    t_setup = time.perf_counter()
    peer = make_peer(peer_name, spec, wd, restore=False)
    compute = Compute(spec)

    def train() -> None:
        compute()
        peer.step()

    out: dict[str, Any] = {"setup_s": time.perf_counter() - t_setup}
    gc.collect()
    base_rss = rss()
    step = 0
    out["warmup_stall_s"], out["warmup_commit_s"] = timed_save(peer, step)
    peer.retire()
    stalls, commits, peaks, retained, written, wfloors = [], [], [], [], [], []
    if out["warmup_commit_s"] > slow_s(spec):
        reps = out["reps_cut"] = 1  # a slow peer: one measured save, to keep the run's length
    small = spec["label"].startswith(("small:", "as63:"))
    floor_path = os.path.join(wd, "floor.bin")  # beside the peer's ckpt/, on the same disk
    for _ in range(reps):
        train()
        step += 1
        out["fingerprint"] = fingerprint(peer.arrays())  # what the restore child must find
        if not small:  # floor, save, floor, save, ..., floor: the same drift hits both
            wfloors.append(floor_write(peer.arrays(), floor_path))
        io0 = io_written()
        with PeakRSS() as peak:
            s, c = timed_save(peer, step)
        written.append(io_written() - io0)
        stalls.append(s)
        commits.append(c)
        peaks.append(peak.peak - base_rss)
        gc.collect()
        retained.append(rss() - base_rss)
        peer.retire()
    if wfloors:
        wfloors.append(floor_write(peer.arrays(), floor_path))
        os.unlink(floor_path)
        out.update(write_floor_interleaved_s=statistics.median(wfloors), write_floors=wfloors)
    out.update(stall_s=statistics.median(stalls), commit_s=statistics.median(commits),
               peak_mem=statistics.median(peaks), retained_mem=statistics.median(retained),
               io_written=statistics.median(written), stalls=stalls, commits=commits)
    if isinstance(peer, Pitstop) and peer.stats is not None:
        out["pitstop_stats"] = {k: getattr(peer.stats, k) for k in (
            "bytes", "stall_s", "persist_s", "hash_s", "write_s", "commit_s")}
    out["disk_bytes"] = disk_bytes(peer.newest())

    if small:
        # the small-tensor case compares stall and restore with the same bytes in 63
        # tensors; its lost time (and the figures after it) are left out to keep a full run
        # near 25 minutes
        peer.close()
        return out
    # lost time: a loop of n steps with one save in it, minus the same loop without
    for _ in range(2):
        train()
    t = time.perf_counter()
    for _ in range(3):
        train()
    step_s = (time.perf_counter() - t) / 3
    n = max(6, min(400, math.ceil((1.3 * max(commits) + 3 * step_s) / step_s) + 2))

    def loop(with_save: bool) -> tuple[float, bool]:
        nonlocal step
        waiter: threading.Thread | None = None
        t = time.perf_counter()
        for i in range(n):
            train()
            step += 1
            if with_save and i == 1:
                wait = peer.save(step)
                waiter = threading.Thread(target=wait, daemon=True)
                waiter.start()
        covered = waiter is None or not waiter.is_alive()
        if waiter is not None:
            waiter.join()  # a commit that outlasts the loop is lost time too
        return time.perf_counter() - t, covered

    base_loops, save_loops, covered = [loop(False)[0]], [], True
    # short loops are noisy on a shared machine: more of them, up to ~lost_seconds in all.
    # A loop without a save follows every loop with one, however long: with only the first
    # and the last as the base, one slow base loop moved every figure by seconds (torch.save,
    # which blocks 2.2 s a save at 1 GiB, came out at -0.12 s lost)
    lreps = max(reps, min(15, int(lost_seconds / max(2 * n * step_s, 1e-3))))
    for _ in range(lreps):
        s, c = loop(True)
        save_loops.append(s)
        covered &= c
        peer.retire()
        base_loops.append(loop(False)[0])
    base = statistics.median(base_loops)
    lost = [s - base for s in save_loops]
    out.update(lost_s=statistics.median(lost), losts=lost, loop_steps=n, step_s=step_s,
               loop_base_s=statistics.median(base_loops), loop_covered_commit=covered)
    step = background_cpu(peer, spec, step, out)
    step = numpy_rate(peer, compute, step, 1 if statistics.median(commits) > 2.0 else reps, out)
    step = lost_passes(peer, step, reps, out)
    return finish(peer, step, train, out)


def save_on_thread(peer: Peer, step: int) -> tuple[float, threading.Thread, dict[str, Any]]:
    """``peer.save(step)``, its wait run on a daemon thread: the stall, the thread, and a
    dict the thread fills with its own CPU seconds (``cpu``) or the wait's exception."""
    box: dict[str, Any] = {}
    t = time.perf_counter()
    wait = peer.save(step)
    stall = time.perf_counter() - t
    box["cpu0"] = (process_cpu(), thread_cpu())  # background work starts here

    def run() -> None:
        c = thread_cpu()
        try:
            wait()
        except BaseException as e:  # re-raised by joined()
            box["error"] = e
        box["cpu"] = thread_cpu() - c

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return stall, th, box


def joined(th: threading.Thread, box: dict[str, Any]) -> dict[str, Any]:
    th.join()
    if "error" in box:
        raise box["error"]
    return box


def background_cpu(peer: Peer, spec: dict[str, Any], step: int, out: dict[str, Any]) -> int:
    """One save while the caller sleeps in 5 ms slices until it is durable: the process's
    CPU time on threads other than the caller's (and the waiter's own, which only waits and
    fsyncs), per GiB of state, from the save's return: the save's background work (a
    helper thread's share of the stall's copy is stall, not background)."""
    step += 1
    _, th, box = save_on_thread(peer, step)
    c0, m0 = box["cpu0"]
    while th.is_alive():
        time.sleep(0.005)
    joined(th, box)
    cpu = process_cpu() - c0 - (thread_cpu() - m0) - box["cpu"]
    peer.retire()
    out.update(bg_cpu_s_per_gib=cpu / (spec["bytes"] / GiB), bg_waiter_cpu_s=box["cpu"])
    return step


def numpy_rate(peer: Peer, compute: Compute, step: int, reps: int, out: dict[str, Any]) -> int:
    """``Compute()`` calls per second from the save's return until it is durable, over the
    rate with no save (measured just before and just after; each rep's after is the next
    one's before)."""
    base_s = min(2.0, max(0.25, out["commit_s"]))
    before = loop_speed(compute, base_s)
    rates = []
    for _ in range(reps):
        step += 1
        _, th, box = save_on_thread(peer, step)
        t = time.perf_counter()
        compute()  # at least one call, however soon the save is durable
        k, _ = passes_during(compute, lambda th=th: not th.is_alive())
        during = (k + 1) / (time.perf_counter() - t)
        joined(th, box)
        after = loop_speed(compute, base_s)
        rates.append(during / ((before + after) / 2))
        before = after
        peer.retire()
    out.update(numpy_rate=statistics.median(rates), numpy_rates=rates)
    return step


def lost_passes(peer: Peer, step: int, reps: int, out: dict[str, Any]) -> int:
    """Lost time with back-to-back optimizer passes (no ``Compute()``), as bench_lost.py
    measures it: ``peer.step()`` runs from the save's return until it is durable; lost = the
    stall + that wall time - the same passes at their plain speed (5 passes just before and
    5 just after; each rep's after is the next one's before). Torch states run with torch's
    default intra-op threads (all cores), as users run them; TF and JAX keep their step.
    Two threads on two cores make any other load slow a pass 10-100x: a rep whose before and
    after differ more than 2x is taken again (twice at most; the notes flag what is left)."""
    ts = peer.state if isinstance(peer.state, TorchState) else None
    threads = (os.cpu_count() or 1) if ts else 1
    if ts:
        ts.torch.set_num_threads(threads)
    try:
        peer.step()  # the thread pool exists before anything is timed
        before = pass_time(peer.step)
        losts, passes, times, drift, retried = [], [], [before], [], 0
        for _ in range(reps):
            for attempt in range(3):
                step += 1
                stall, th, box = save_on_thread(peer, step)
                k, wall = passes_during(peer.step, lambda th=th: not th.is_alive())
                joined(th, box)
                after = pass_time(peer.step)
                times.append(after)
                d = max(before, after) / max(min(before, after), 1e-9)
                lost = lost_in_passes(stall, k, wall, before, after)
                before = after
                peer.retire()
                if d <= 2 or attempt == 2:
                    break
                retried += 1
            losts.append(lost)
            passes.append(k)
            drift.append(d)
    finally:
        if ts:
            ts.torch.set_num_threads(1)  # see THREADS
    out.update(lost_passes_s=statistics.median(losts), lost_passes=losts, passes=passes,
               pass_s=statistics.median(times), pass_times=times, pass_drift=drift,
               passes_retried=retried, pass_threads=threads)
    return step


def finish(peer: Peer, step: int, train: Callable[[], None], out: dict[str, Any]
           ) -> dict[str, Any]:
    """The checkpoint the restore child reads, and what it must find there."""
    train()
    out["fingerprint"] = fingerprint(peer.arrays())
    peer.save(step + 1)()
    peer.retire()
    peer.close()
    return out


def child_restore(peer_name: str, spec: dict[str, Any], wd: str, reps: int,
                  expect: float | None) -> dict[str, Any]:
    """Restore into live objects: first warm (the page cache as the save left it), then cold."""
    peer = make_peer(peer_name, spec, wd, restore=True)
    gc.collect()
    base = rss()
    newest = peer.newest()
    with PeakRSS() as peak:
        t = time.perf_counter()
        peer.restore()
        warm = time.perf_counter() - t
    out: dict[str, Any] = {"restore_warm_s": warm, "restore_peak_mem": peak.peak - base}
    fp = fingerprint(peer.arrays())
    out["restored_ok"] = expect is None or math.isclose(fp, expect, rel_tol=1e-9, abs_tol=1e-9)
    colds = []
    if warm > slow_s(spec):
        reps = out["reps_cut"] = 1
    for _ in range(reps):
        out["drop"] = drop_cache(newest)
        t = time.perf_counter()
        peer.restore()
        colds.append(time.perf_counter() - t)
    out.update(restore_cold_s=statistics.median(colds), colds=colds)
    peer.close()
    return out


def child_floors(spec: dict[str, Any], wd: str, reps: int) -> dict[str, Any]:
    """memcpy into preallocated memory; one file written + fsync; that file read into
    preallocated memory warm (as written) and cold (dropped from the page cache)."""
    vals = init_values(spec)
    arrays = vals + [v.copy() for v in vals] + [v.copy() for v in vals]
    dst = [np.empty_like(a) for a in arrays]
    path = os.path.join(wd, "floor.bin")
    floor_memcpy(arrays, dst)

    def read() -> float:
        t = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        off = 0
        for d in dst:
            mv = memoryview(d).cast("B")
            while mv:
                k = os.preadv(fd, [mv], off)
                off += k
                mv = mv[k:]
        os.close(fd)
        return time.perf_counter() - t

    rows: dict[str, list[float]] = {k: [] for k in ("memcpy", "write", "read_warm", "read_cold")}
    for _ in range(reps):
        rows["memcpy"].append(floor_memcpy(arrays, dst))
        rows["write"].append(floor_write(arrays, path))
        rows["read_warm"].append(read())
        drop_cache(path)
        rows["read_cold"].append(read())
    os.unlink(path)
    return {k: statistics.median(v) for k, v in rows.items()}


def child_frozen(spec: dict[str, Any], wd: str, reps: int, frozen: float) -> dict[str, Any]:
    """A frozen backbone (``frozen`` of the parameters never change; the head and its Adam
    state do): bytes written per save, pitstop incremental vs a full pitstop save."""
    out: dict[str, Any] = {}
    for name in ("pitstop", "pitstop+incremental"):
        d = os.path.join(wd, name)
        peer = Pitstop(spec, d, False, name, frozen=frozen, keep_last=2)
        state_bytes = sum(a.nbytes for a in peer.arrays())
        timed_save(peer, 0)
        written, stalls, commits = [], [], []
        for step in range(1, reps + 1):
            peer.step()
            before = disk_bytes(peer.dir)
            io0 = io_written()
            s, c = timed_save(peer, step)
            written.append(io_written() - io0)
            stalls.append(s)
            commits.append(c)
            out.setdefault(name + " disk_delta", []).append(disk_bytes(peer.dir) - before)
        peer.close()
        out[name] = {"state_bytes": state_bytes, "written": statistics.median(written),
                     "stall_s": statistics.median(stalls), "commit_s": statistics.median(commits)}
        shutil.rmtree(d, ignore_errors=True)
    return out


def child_growth(spec: dict[str, Any], wd: str, saves: int) -> dict[str, Any]:
    """RSS after save 10 and after save ``saves`` (each committed, then gc) with one manager."""
    peer = Pitstop(spec, wd, False, "pitstop")
    marks: dict[int, int] = {}
    for step in range(1, saves + 1):
        peer.step()
        peer.save(step)()
        if step in (10, saves):
            gc.collect()
            marks[step] = rss()
    peer.close()
    return {"rss_10": marks[10], "rss_last": marks[saves], "saves": saves}


def run_child(args: argparse.Namespace) -> None:
    spec = spec_of(args.size)
    if args.child == "save":
        out = child_save(args.peer, spec, args.workdir, args.reps, args.lost_seconds)
    elif args.child == "restore":
        out = child_restore(args.peer, spec, args.workdir, args.reps, args.expect)
    elif args.child == "floors":
        out = child_floors(spec, args.workdir, args.reps)
    elif args.child == "frozen":
        out = child_frozen(spec, args.workdir, args.reps, 0.8)
    elif args.child == "growth":
        out = child_growth(spec, args.workdir, args.growth)
    else:
        raise SystemExit(f"unknown child mode {args.child}")
    print("\n@@RESULT " + json.dumps(out), flush=True)


# --------------------------------------------------------------------------------------------
# the parent: children, table


def spawn(mode: str, size: str, wd: str, reps: int, timeout: float, peer: str | None = None,
          extra: list[str] | None = None) -> dict[str, Any]:
    """Run one child; its JSON, or {"failed": why}."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--size", size,
           "--workdir", wd, "--reps", str(reps), "--lost-seconds", str(LOST_SECONDS[0])] + (["--peer", peer] if peer else []) + (extra or [])
    env = {**os.environ, "KERAS_BACKEND": KERAS_BACKEND, "TF_CPP_MIN_LOG_LEVEL": "3",
           "JAX_PLATFORMS": "cpu", "PYTHONWARNINGS": "ignore", **THREADS}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    except subprocess.TimeoutExpired:
        return {"failed": f"timeout after {timeout:.0f} s"}
    for line in p.stdout.splitlines():
        if line.startswith("@@RESULT "):
            return json.loads(line[len("@@RESULT "):])
    err = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    why = err[-1] if err else f"exit {p.returncode}"
    return {"failed": why[:160].replace("|", "/")}


def default_workdir() -> str:
    """A temp dir on a real disk: /tmp unless it is tmpfs, else .bench/ in the repo."""
    tmp = tempfile.gettempdir()
    fstype = ""
    best = ""
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1]
            if (tmp == mnt or tmp.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, fstype = mnt, parts[2]
    base = tmp
    if fstype in ("tmpfs", "ramfs", ""):
        base = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".bench")
        os.makedirs(base, exist_ok=True)
    return tempfile.mkdtemp(prefix="pitstop-peers-", dir=base)


def machine_facts(workdir: str) -> dict[str, str]:
    """What the figures depend on: cores, memory, disk, versions."""
    facts: dict[str, str] = {"cpus": str(os.cpu_count())}
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                         "?")
        facts["cpu"] = model
    except OSError:
        pass
    facts["ram_gib"] = f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GiB:.1f}"
    st = os.statvfs(workdir)
    dev, fstype, mnt = "?", "?", ""
    with open("/proc/mounts") as f:
        for line in f:
            p = line.split()
            if (workdir == p[1] or workdir.startswith(p[1].rstrip("/") + "/")) and \
                    len(p[1]) >= len(mnt):
                dev, mnt, fstype = p[0], p[1], p[2]
    rota = "?"
    name = os.path.basename(dev)
    try:
        with open(f"/sys/block/{name}/queue/rotational") as f:
            rota = "rotational" if f.read().strip() == "1" else "non-rotational"
    except OSError:
        pass
    facts["disk"] = (f"{dev} ({fstype} on {mnt}, {st.f_blocks * st.f_frsize / GiB:.0f} GiB, "
                     f"{rota} per the kernel)")
    facts["python"] = platform.python_version()
    facts["numpy"] = np.__version__
    facts["pitstop"] = (f"{getattr(pitstop, '__version__', '?')} "
                        f"({os.path.dirname(os.path.dirname(pitstop.__file__))})")
    code = ("import importlib.metadata as m\n"
            "for n in ('torch','tensorflow','tensorflow-cpu','keras','jax','jaxlib','optax',"
            "'orbax-checkpoint'):\n"
            "    try: print(n, m.version(n))\n"
            "    except Exception: pass\n")
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        for line in p.stdout.splitlines():
            k, v = line.split()
            facts[k] = v
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    facts["kernel"] = platform.release()
    return facts


RAW = "raw"  # a floor key: the figure is printed as it is, with no best-peer ratio
FIGURES = [  # key, column, floor key (None: state bytes; RAW: the value itself)
    ("stall_s", "stall", "memcpy"),
    ("lost_s", "lost / save", "memcpy"),
    ("lost_passes_s", "lost / save (passes)", "memcpy"),
    ("commit_s", "save → durable", "write"),
    ("restore_warm_s", "restore warm", "read_warm"),
    ("restore_cold_s", "restore cold", "read_cold"),
    ("peak_mem", "peak mem", None),
    ("retained_mem", "retained mem", None),
    ("disk_bytes", "disk", None),
    ("bg_cpu_s_per_gib", "bg CPU-s/GiB", RAW),
    ("numpy_rate", "numpy rate", RAW),
]
#: figures divided by a floor the row's own child measured, when it did (else by the floors
#: child's): save → durable by the write + fsync floor taken interleaved with the saves
ROW_FLOORS = {"commit_s": "write_floor_interleaved_s"}
#: the figures in seconds (their best peer is in the line above the table)
TIMES = [k for k, _, f in FIGURES if f not in (None, RAW)]


def cell(row: dict[str, Any], key: str, floors: dict[str, Any], floor_key: str | None,
         best: float | None) -> str:
    v = row.get(key)
    if v is None or "failed" in row:
        return "—"
    if floor_key == RAW:
        return f"{v:.2f}"
    f = row.get(ROW_FLOORS.get(key, "")) or (floors.get(floor_key) if floor_key
                                              else row["state_bytes"])
    a = f"{v / f:.2f}" if f else "?"
    if best is None or best <= 0 or (floor_key is None and best < 0.01 * row["state_bytes"]):
        return f"{a} · —"
    return f"{a} · {v / best:.2f}"


def size_label(spec: dict[str, Any]) -> str:
    label = spec["label"]
    b = spec["bytes"]
    human = f"{b / GiB:.2f} GiB" if b >= GiB else f"{b / MiB:.1f} MiB"
    if label.startswith("small:"):
        return f"{int(label.split(':')[1]):,} tensors of 1 KiB ({human})"
    if label.startswith("as63:"):
        return f"{human} in 63 tensors (same bytes as the small case)"
    return f"{label} ({human}, 63 tensors)"


def render(results: dict[str, Any]) -> str:
    lines: list[str] = []
    facts = results["facts"]
    lines.append("Machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    lines.append(f"Command: `{results['command']}` ({results['elapsed_s'] / 60:.1f} min)")
    lines.append("")
    lines.append("Each cell: ratio to the floor · ratio to the best peer (pitstop rows excluded "
                 "from best peer; lower is better). Floors: stall and lost time vs memcpy into "
                 "preallocated memory (lost / save in a compute + step loop; (passes): "
                 "optimizer steps back to back, torch with its default threads); save → durable "
                 "vs one file written + fsync of the same bytes, taken interleaved with the "
                 "saves in the peer's own process (floor, save, floor, ...); restore warm / cold "
                 "vs reading the floors' file warm / cold; memory and disk vs the state's bytes. "
                 "bg CPU-s/GiB: CPU seconds of the save's background threads per GiB, as is; "
                 "numpy rate: a numpy loop's speed while the save persists over its speed "
                 "without one, as is (goal ≥ 0.6).")
    lines.append("")
    for size in results["sizes"]:
        fl = size["floors"]
        spec = size["spec"]
        if "failed" in fl:
            lines.append(f"**{size_label(spec)}**: floors failed: {fl['failed']}")
            continue
        best_txt = []
        for key, col, _ in FIGURES:
            b = size["best"].get(key) if key in TIMES else None
            if b:
                best_txt.append(f"{col} {b[0]:.3g} s ({b[1]})")
        lines.append(f"- **{size_label(spec)}** — floors: memcpy {fl['memcpy']:.3f} s, write + "
                     f"fsync {fl['write']:.3f} s, read warm {fl['read_warm']:.3f} s, read cold "
                     f"{fl['read_cold']:.3f} s. Best peer: " + ", ".join(best_txt) + ".")
    lines.append("")
    head = ["size", "peer"] + [c for _, c, _ in FIGURES] + ["notes"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for size in results["sizes"]:
        fl = size["floors"]
        for row in size["rows"]:
            label = size["spec"]["label"].replace("small:", "small ").replace("as63:", "63× ")
            if "failed" in row or "skipped" in row:
                why = row.get("failed") or row.get("skipped")
                why = why if str(why).startswith("skipped") else f"failed: {why}"
                lines.append(f"| {label} | {row['peer']} | " + " | ".join(
                    "—" for _ in FIGURES) + f" | {why} |")
                continue
            cells = [cell(row, k, fl, f, (size["best"].get(k) or (None,))[0])
                     for k, _, f in FIGURES]
            lines.append(f"| {label} | {row['peer']} | " + " | ".join(cells) +
                         f" | {'; '.join(row.get('notes', []))} |")
    extra = results.get("extra", [])
    if extra:
        lines.append("")
        lines += [f"- {e}" for e in extra]
    return "\n".join(lines)


def best_of(rows: list[dict[str, Any]]) -> dict[str, tuple[float, str]]:
    best: dict[str, tuple[float, str]] = {}
    for key, _, f in FIGURES:
        if f == RAW:
            continue
        cands = [(r[key], r["peer"]) for r in rows if r.get(key) is not None and
                 "failed" not in r and "skipped" not in r and not r["peer"].startswith("pitstop")]
        if cands:
            best[key] = min(cands)
    return best


def notes_of(row: dict[str, Any], floors: dict[str, Any]) -> list[str]:
    notes = []
    if row["peer"] == "pitstop+zstd" and row.get("disk_bytes"):
        notes.append(f"zstd ratio {row['state_bytes'] / row['disk_bytes']:.2f}x, "
                     f"{row['state_bytes'] / row['commit_s'] / 1e9:.2f} GB/s save → durable")
    if not row.get("restored_ok", True):
        notes.append("RESTORE MISMATCH")
    if row.get("reps_cut"):
        notes.append("1 rep (a slow save or restore)")
    if row.get("peer") and "lost_s" not in row and "failed" not in row:
        notes.append("lost time, bg CPU, numpy rate not measured (small-tensor case)")
    drift = max(row.get("pass_drift") or [0])
    if drift > 2:  # other load on the cores, most likely
        notes.append(f"passes: pass time before/after differ {drift:.1f}x (noisy)")
    if not row.get("loop_covered_commit", True):
        notes.append("commit outlasted the loop")
    if row.get("drop") == "fadvise" and row["peer"] == "pitstop+memtier":
        notes.append("cold: /dev/shm tier not dropped")
    return notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64M,1G,4G")
    ap.add_argument("--small", type=int, default=100_000,
                    help="tensors in the small-tensor case (0: skip); run with torch peers and "
                         "beside the same bytes in 63 tensors")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--quick", action="store_true", help="64M only, 1 rep (development)")
    ap.add_argument("--json", default=None, help="also write every figure to this file")
    ap.add_argument("--markdown", action="store_true", default=True,
                    help="print the markdown table (the default)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--growth", type=int, default=100,
                    help="pitstop saves for the memory-growth check (0: skip)")
    ap.add_argument("--no-frozen", action="store_true", help="skip the frozen-backbone case")
    ap.add_argument("--lost-seconds", type=float, default=4.0,
                    help="repeat short lost-time loops (beyond --reps, up to 15) until they "
                         "take about this long: they are noisy")
    ap.add_argument("--timeout", type=float, default=None, help="per child, seconds")
    # child mode
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--size", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--peer", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--expect", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        run_child(args)
        return
    command = "python benchmarks/bench_peers.py " + " ".join(sys.argv[1:])
    if args.quick:
        args.sizes = "64M" if "--sizes" not in sys.argv else args.sizes
        args.reps = 1
        args.small = 0 if "--small" not in sys.argv else args.small
        args.growth = 0 if "--growth" not in sys.argv else args.growth
        args.no_frozen = True if "--no-frozen" not in sys.argv else args.no_frozen
    LOST_SECONDS[0] = args.lost_seconds
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    for p in peers:
        if p not in PEERS:
            raise SystemExit(f"unknown peer {p!r}; known: {', '.join(PEERS)}")
    own = args.workdir is None
    workdir = args.workdir or default_workdir()
    os.makedirs(workdir, exist_ok=True)
    workdir = os.path.abspath(workdir)
    t_start = time.perf_counter()
    avail = pitstop_available()
    labels = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if args.small:
        labels += [f"as63:{args.small}", f"small:{args.small}"]
    results: dict[str, Any] = {"command": command, "facts": machine_facts(workdir), "sizes": [],
                               "extra": []}

    def dump(results: dict[str, Any]) -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2, default=str)

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.0f} s] {msg}", file=sys.stderr, flush=True)

    for label in labels:
        spec = spec_of(label)
        gib = spec["bytes"] / GiB
        timeout = args.timeout or (180 + 400 * gib + (600 if label.startswith("small") else 0))
        fd = os.path.join(workdir, "floors")
        os.makedirs(fd, exist_ok=True)
        floors = spawn("floors", label, fd, args.reps, timeout)
        shutil.rmtree(fd, ignore_errors=True)
        log(f"{label}: floors {floors}")
        rows = []
        these = [p for p in peers if p in SMALL_PEERS] if label.startswith(("small", "as63")) \
            else peers
        for peer in these:
            row: dict[str, Any] = {"peer": peer, "state_bytes": spec["bytes"]}
            if avail.get(peer):
                row["skipped"] = avail[peer]
                rows.append(row)
                log(f"{label} {peer}: {avail[peer]}")
                continue
            wd = os.path.join(workdir, peer.replace("+", "_"))
            shutil.rmtree(wd, ignore_errors=True)
            os.makedirs(wd)
            t = time.perf_counter()
            s = spawn("save", label, wd, args.reps, timeout, peer)
            row.update(s)
            if "failed" not in s:
                r = spawn("restore", label, wd, args.reps, timeout, peer,
                          ["--expect", repr(s["fingerprint"])])
                if "failed" in r:
                    row["restore_failed"] = r["failed"]
                else:
                    row.update(r)
            shutil.rmtree(wd, ignore_errors=True)
            row["notes"] = notes_of(row, floors)
            if "restore_failed" in row:
                row["notes"].append(f"restore failed: {row['restore_failed']}")
            rows.append(row)
            log(f"{label} {peer}: " + (f"failed: {row['failed']}" if "failed" in row else
                ", ".join(f"{k} {row[k]:.3f}" for k in (
                    "stall_s", "lost_s", "lost_passes_s", "commit_s", "write_floor_interleaved_s",
                    "restore_warm_s", "restore_cold_s", "bg_cpu_s_per_gib", "numpy_rate")
                          if k in row)) + f" ({time.perf_counter() - t:.0f} s)")
            results["sizes_partial"] = [*results["sizes"], {"spec": spec, "floors": floors,
                                                            "rows": rows}]
            dump(results)  # a long run that is stopped keeps what it measured
        results.pop("sizes_partial", None)
        results["sizes"].append({"spec": spec, "floors": floors, "rows": rows,
                                 "best": best_of(rows)})

    # 100,000 small tensors vs the same bytes in 63
    by = {s["spec"]["label"]: s for s in results["sizes"]}
    if args.small and f"small:{args.small}" in by and f"as63:{args.small}" in by:
        small = {r["peer"]: r for r in by[f"small:{args.small}"]["rows"]}
        big = {r["peer"]: r for r in by[f"as63:{args.small}"]["rows"]}
        parts = []
        for p, r in small.items():
            b = big.get(p, {})
            if all(k in r and k in b and b[k] for k in ("stall_s", "restore_warm_s")):
                parts.append(f"{p} stall {r['stall_s'] / b['stall_s']:.1f}x, restore warm "
                             f"{r['restore_warm_s'] / b['restore_warm_s']:.1f}x")
        results["extra"].append(f"{args.small:,} small tensors vs the same bytes in 63 "
                                f"(goal for pitstop: <= 2x): " + "; ".join(parts))

    regular = [lb for lb in labels if not lb.startswith(("small", "as63"))]
    if not args.no_frozen and regular and "pitstop" in peers:
        label = min(regular, key=lambda lb: abs(spec_of(lb)["bytes"] - GiB))
        if avail.get("pitstop+incremental"):
            results["extra"].append(f"frozen backbone (80% of the parameters frozen): "
                                    f"{avail['pitstop+incremental']}")
        else:
            wd = os.path.join(workdir, "frozen")
            os.makedirs(wd, exist_ok=True)
            fz = spawn("frozen", label, wd, args.reps, 600 + 400 * spec_of(label)["bytes"] / GiB)
            shutil.rmtree(wd, ignore_errors=True)
            results["frozen"] = fz
            if "failed" in fz:
                results["extra"].append(f"frozen backbone: failed: {fz['failed']}")
            else:
                full, inc = fz["pitstop"], fz["pitstop+incremental"]
                results["extra"].append(
                    f"frozen backbone at {label} (80% of the parameters frozen; the head and its "
                    f"Adam state change): bytes written per save, incremental "
                    f"{inc['written'] / MiB:.1f} MiB vs full {full['written'] / MiB:.1f} MiB "
                    f"({inc['written'] / max(full['written'], 1):.2f}x); stall "
                    f"{inc['stall_s']:.3f} vs {full['stall_s']:.3f} s; save → durable "
                    f"{inc['commit_s']:.3f} vs {full['commit_s']:.3f} s")
            log(f"frozen: {fz}")

    if args.growth and regular and "pitstop" in peers:
        label = min(regular, key=lambda lb: spec_of(lb)["bytes"])
        wd = os.path.join(workdir, "growth")
        os.makedirs(wd, exist_ok=True)
        g = spawn("growth", label, wd, 1, 900, extra=["--growth", str(args.growth)])
        shutil.rmtree(wd, ignore_errors=True)
        results["growth"] = g
        if "failed" in g:
            results["extra"].append(f"memory growth: failed: {g['failed']}")
        else:
            results["extra"].append(
                f"pitstop memory growth at {label}: RSS after save 10 {g['rss_10'] / MiB:.0f} MiB, "
                f"after save {g['saves']} {g['rss_last'] / MiB:.0f} MiB "
                f"({(g['rss_last'] - g['rss_10']) / MiB:+.1f} MiB)")
        log(f"growth: {g}")

    results["elapsed_s"] = time.perf_counter() - t_start
    dump(results)
    print(render(results))
    if own:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
