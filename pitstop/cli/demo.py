"""``pitstop demo``: kill -9 a numpy training run part-way, restart it, prove the resume exact.

The training (linear regression, SGD with momentum, data drawn from a numpy RNG every step)
runs as a child process, ``python -m pitstop.cli demo --child DIR``. The demo runs it once
without checkpoints as the reference, then once with a CheckpointManager and SIGKILLs it
after a few checkpoints have committed, then starts the same command again: it restores the
newest checkpoint (weights, momentum, loss history, RNG state) and resumes at the next step.
Final weights and every per-step loss must be bitwise equal to the reference.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

D_IN, D_OUT, BATCH = 1024, 512, 64
#: every child runs single-threaded BLAS: bitwise reproducible, and kind to a shared machine
_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def add_parser(sub: Any) -> None:
    s = sub.add_parser("demo", help="kill -9 a numpy training run, resume it, prove it exact")
    s.add_argument(
        "--dir",
        help="work directory (must be empty or absent; default: a temporary "
        "directory, removed afterwards)",
    )
    s.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    s.add_argument("--save-every", type=int, default=20, help="checkpoint every N steps")
    s.add_argument("--seed", type=int, default=0)
    # internal: the training process itself
    s.add_argument("--child", metavar="DIR", help=argparse.SUPPRESS)
    s.add_argument("--out", help=argparse.SUPPRESS)
    s.add_argument("--no-checkpoint", action="store_true", help=argparse.SUPPRESS)
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.child:
        return train(
            args.child,
            args.out,
            args.steps,
            args.save_every,
            args.seed,
            checkpoint=not args.no_checkpoint,
        )
    if args.steps < 3 * args.save_every or args.save_every < 1:
        print("pitstop demo: --steps must be at least 3 x --save-every", file=sys.stderr)
        return 2
    if args.dir:
        work = os.path.abspath(args.dir)
        if os.path.exists(work) and os.listdir(work):
            print(
                f"pitstop demo: {work} is not empty; pass an empty or new directory",
                file=sys.stderr,
            )
            return 2
        os.makedirs(work, exist_ok=True)
        return orchestrate(work, args, keep=True)
    with tempfile.TemporaryDirectory(prefix="pitstop-demo-") as work:
        return orchestrate(work, args, keep=False)


# ====================================================================== the training
def train(
    directory: str, out: str, steps: int, save_every: int, seed: int, checkpoint: bool
) -> int:
    """One training run; with ``checkpoint`` it resumes from ``directory`` if it can."""
    from pitstop import CheckpointManager

    w_true = np.random.default_rng(seed).standard_normal((D_IN, D_OUT), dtype=np.float32)
    w_true /= np.float32(np.sqrt(D_IN))
    rng = np.random.default_rng(seed + 1)  # draws every batch: its state is checkpointed
    state: dict[str, Any] = {
        "model": {"w": np.zeros((D_IN, D_OUT), np.float32), "b": np.zeros(D_OUT, np.float32)},
        "optimizer": {
            "w": np.zeros((D_IN, D_OUT), np.float32),
            "b": np.zeros(D_OUT, np.float32),
            "lr": 0.01,
            "momentum": 0.9,
        },
        "losses": np.zeros(steps, np.float64),
        "rng": rng.bit_generator.state,
    }
    w, b = state["model"]["w"], state["model"]["b"]
    vw, vb = state["optimizer"]["w"], state["optimizer"]["b"]
    start = 0
    mgr = (
        CheckpointManager(directory, save_every_steps=save_every, keep_last=3)
        if checkpoint
        else None
    )
    if mgr is not None:
        restored = mgr.restore(state)  # arrays in place; values (rng, lr) replaced in the dict
        if restored is not None:
            rng.bit_generator.state = state["rng"]
            start = restored + 1
        print(f"restored {restored}", flush=True)
    opt = state["optimizer"]
    for step in range(start, steps):
        x = rng.standard_normal((BATCH, D_IN), dtype=np.float32)
        y = x @ w_true + np.float32(0.01) * rng.standard_normal((BATCH, D_OUT), dtype=np.float32)
        err = x @ w + b - y
        state["losses"][step] = float(np.mean(err * err, dtype=np.float64))
        inv_batch = np.float32(1.0 / BATCH)  # gradient of 0.5 * mean over the batch of |err|^2
        vw *= np.float32(opt["momentum"])
        vw += inv_batch * (x.T @ err)
        vb *= np.float32(opt["momentum"])
        vb += inv_batch * err.sum(axis=0)
        w -= np.float32(opt["lr"]) * vw
        b -= np.float32(opt["lr"]) * vb
        state["rng"] = rng.bit_generator.state
        print(f"step {step}", flush=True)  # before the save: no checkpoint is ever ahead of it
        if mgr is not None:
            # the end of iteration `step`: a checkpoint of `step` resumes at `step + 1`
            mgr.step(step, state, metrics={"loss": float(state["losses"][step])})
    if mgr is not None:
        mgr.close()
    np.savez(out, w=w, b=b, vw=vw, vb=vb, losses=state["losses"])
    print("done", flush=True)
    return 0


# ====================================================================== the demo
class _Child:
    """A training child process whose progress lines are read on a thread."""

    def __init__(
        self, directory: str, out: str, args: argparse.Namespace, checkpoint: bool = True
    ) -> None:
        cmd = [
            sys.executable,
            "-m",
            "pitstop.cli",
            "demo",
            "--child",
            directory,
            "--out",
            out,
            "--steps",
            str(args.steps),
            "--save-every",
            str(args.save_every),
            "--seed",
            str(args.seed),
        ]
        if not checkpoint:
            cmd.append("--no-checkpoint")
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **_ENV},
        )
        self.restored: int | None = None
        self.last_step: int | None = None
        self.done = False
        self.stderr = ""
        self._out = threading.Thread(target=self._read, daemon=True)
        self._out.start()
        self._err = threading.Thread(target=self._read_err, daemon=True)
        self._err.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            kind, _, rest = line.strip().partition(" ")
            if kind == "step":
                self.last_step = int(rest)
            elif kind == "restored":
                self.restored = None if rest == "None" else int(rest)
            elif kind == "done":
                self.done = True

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        self.stderr = self.proc.stderr.read()

    def wait(self, timeout: float = 120) -> int:
        rc = self.proc.wait(timeout)
        self._out.join(5)
        self._err.join(5)
        return rc


def _committed(directory: str) -> list[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(
        int(n[5:])
        for n in names
        if n.startswith("step_")
        and n[5:].isdigit()
        and os.path.isfile(os.path.join(directory, n, "manifest.json"))
    )


def _fail(child: _Child, what: str) -> int:
    print(f"pitstop demo: {what}", file=sys.stderr)
    if child.stderr:
        print(child.stderr[-4000:], file=sys.stderr)
    return 1


def orchestrate(work: str, args: argparse.Namespace, keep: bool) -> int:
    t0 = time.perf_counter()
    ckpt = os.path.join(work, "checkpoints")
    ref_out, run_out = os.path.join(work, "reference.npz"), os.path.join(work, "resumed.npz")
    state_mib = (2 * (D_IN * D_OUT + D_OUT) * 4 + args.steps * 8) / 2**20
    print(
        f"pitstop demo: numpy linear regression, SGD + momentum, {state_mib:.1f} MiB of state, "
        f"{args.steps} steps, a checkpoint every {args.save_every} steps"
    )
    print(f"  checkpoints in {ckpt}" + ("" if keep else " (a temporary directory)"))

    # 1. the reference: the same training, never interrupted, no checkpoints
    ref = _Child(ckpt + ".unused", ref_out, args, checkpoint=False)
    if ref.wait() != 0 or not ref.done:
        return _fail(ref, "the reference run failed")
    reference = _load(ref_out)
    losses = reference["losses"]
    print(f"1. reference run, uninterrupted: loss {losses[0]:.4f} -> {losses[-1]:.4f}")

    # 2. the same training with pitstop, SIGKILLed once a few checkpoints have committed
    kill_after = max(2 * args.save_every, (args.steps // 3) // args.save_every * args.save_every)
    first = _Child(ckpt, run_out, args)
    deadline = time.monotonic() + 120
    while True:
        committed = _committed(ckpt)
        if committed and committed[-1] >= kill_after:
            break
        if first.proc.poll() is not None:
            return _fail(
                first,
                "the training run ended before it could be killed "
                f"(exit status {first.proc.returncode})",
            )
        if time.monotonic() > deadline:
            first.proc.kill()
            return _fail(first, "the training run made no progress")
        time.sleep(0.005)
    first.proc.send_signal(signal.SIGKILL)
    rc = first.wait()
    on_disk = _committed(ckpt)
    newest = on_disk[-1] if on_disk else None
    print(
        f"2. training run with pitstop: killed with SIGKILL (exit status {rc}) after step "
        f"{first.last_step}; newest committed checkpoint: step {newest}"
    )

    # 3. the same command again: it restores and resumes
    second = _Child(ckpt, run_out, args)
    if second.wait() != 0 or not second.done:
        return _fail(second, "the resumed run failed")
    restored = second.restored
    if restored is None:
        return _fail(second, "the resumed run found nothing to restore")
    source = "" if restored == newest else " (from the memory tier: it outlived the process)"
    print(
        f"3. restarted the same command: restored step {restored}{source}, resumed at step "
        f"{restored + 1}, trained to step {args.steps - 1}"
    )

    resumed = _load(run_out)
    right_step = newest is not None and newest <= restored <= (first.last_step or -1)
    same = [k for k in reference if _bitwise_equal(reference[k], resumed[k])]
    identical = len(same) == len(reference)
    if identical and right_step:
        print(
            f"identical: yes (final weights, momentum and all {args.steps} per-step losses "
            f"bitwise equal to the reference; {time.perf_counter() - t0:.1f} s)"
        )
        return 0
    differ = sorted(set(reference) - set(same))
    print(
        f"identical: NO (differ: {', '.join(differ) or 'none'}; resumed at the right step: "
        f"{'yes' if right_step else 'no'})"
    )
    return 1


def _load(path: str) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def _bitwise_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
