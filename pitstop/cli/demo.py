"""``pitstop demo``: kill -9 a real training run part-way, let ``pitstop run`` restart it,
prove the resumed run bitwise identical to an uninterrupted one.

The training is a child process, ``python -m pitstop.cli demo --child ...``, with one small
trainer per framework (``demo_<framework>.py``: torch by default, numpy, tf, keras, jax).
The demo starts the same training twice, side by side: once without checkpoints (the
reference), once under ``pitstop run`` with a CheckpointManager. Once a few checkpoints
have committed it SIGKILLs the training process (not the supervisor), the supervisor
restarts it, and the new process restores the newest checkpoint and trains to the end. The
final weights, optimizer state and every per-step loss must equal the reference bit for
bit. At each save the trainer also times the framework's own save of the same state, so
the demo can show how long each one holds up the training thread.

A child reports to the demo on stdout, one line each: ``pid N``, ``restored STEP|None``,
``step N``, ``save STEP PITSTOP_S PEER_S``, ``done``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from pitstop.cli.watched import Watched
from pitstop.core.directory.names import DEFAULT

FRAMEWORKS = ("torch", "numpy", "tf", "keras", "jax")
#: framework -> (module it needs, the pitstop extra that installs it)
_NEEDS = {
    "torch": ("torch", "torch"),
    "numpy": ("numpy", ""),
    "tf": ("tensorflow", "tf"),
    "keras": ("keras", "keras"),
    "jax": ("jax", "jax"),
}
#: per framework: default steps and checkpoint interval (the slow-to-import ones train less)
_DEFAULTS = {"torch": (300, 25), "numpy": (200, 20), "tf": (150, 15), "keras": (150, 15),
             "jax": (150, 15)}


def add_parser(sub: Any) -> None:
    s = sub.add_parser(
        "demo",
        help="kill -9 a real training run, resume it under `pitstop run`, prove it exact",
        description=(
            "Train a small real model (PyTorch by default), SIGKILL it part-way, let\n"
            "`pitstop run` restart it, and check that the resumed run ends bitwise identical\n"
            "to an uninterrupted one. Also shows how long pitstop's save holds up the\n"
            "training thread next to the framework's own save of the same state.\n"
            "Exit status: 0 identical, 1 not identical (or a run failed), 2 bad arguments."
        ),
        epilog="example:\n  pitstop demo\n  pitstop demo --framework jax --dir /tmp/demo\n"
        "  pitstop ls /tmp/demo/checkpoints\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument(
        "--framework",
        choices=FRAMEWORKS,
        default="torch",
        help="what trains: torch (default), numpy, tf, keras (Keras 3 on the backend "
        "KERAS_BACKEND names; unset: jax if installed) or jax",
    )
    s.add_argument(
        "--dir",
        help="work directory, kept afterwards for `pitstop ls/inspect` (must be empty or "
        "absent; default: a temporary directory, removed afterwards)",
    )
    s.add_argument("--steps", type=int, help="training steps (default 300 for torch, "
                   "200 numpy, 150 tf/keras/jax)")
    s.add_argument("--save-every", type=int, help="checkpoint every N steps (default: "
                   "steps / 10 or so)")
    s.add_argument("--seed", type=int, default=0, help="seed of the data and the model")
    # internal: the training process itself
    s.add_argument("--child", metavar="DIR", help=argparse.SUPPRESS)
    s.add_argument("--out", help=argparse.SUPPRESS)
    s.add_argument("--no-checkpoint", action="store_true", help=argparse.SUPPRESS)
    s.add_argument("--wrong-resume", action="store_true", help=argparse.SUPPRESS)
    s.add_argument("--kill-after", type=int, help=argparse.SUPPRESS)
    s.set_defaults(func=run)


def _missing(framework: str) -> str | None:
    """The one line to print when ``framework`` cannot be imported here, else None."""
    needs = [_NEEDS[framework]]
    if framework == "jax":
        needs.append(("optax", "jax"))
    if framework == "keras":
        backend = _keras_backend()
        if backend not in ("jax", "torch", "tensorflow"):  # (numpy, openvino: no training)
            return (f"pitstop demo: --framework keras trains on the jax, torch or tensorflow "
                    f"Keras backend, not KERAS_BACKEND={backend}; set KERAS_BACKEND to one "
                    "of those")
        needs.append({"tensorflow": ("tensorflow", "tf")}.get(backend, (backend, backend)))
    for module, extra in needs:
        if importlib.util.find_spec(module) is None:
            return (f"pitstop demo: --framework {framework} needs {module}, which is not "
                    f"installed: pip install 'pitstop[{extra}]'")
    return None


def _keras_backend() -> str:
    """KERAS_BACKEND, or (unset) the quickest to start of those installed: jax, then torch,
    then tensorflow; set in this process's environment, which the children inherit."""
    if not os.environ.get("KERAS_BACKEND"):
        os.environ["KERAS_BACKEND"] = next(
            (b for b in ("jax", "torch", "tensorflow") if importlib.util.find_spec(b)), "jax")
    return os.environ["KERAS_BACKEND"]


def run(args: argparse.Namespace) -> int:
    steps, every = _DEFAULTS[args.framework]
    args.steps = steps if args.steps is None else args.steps
    args.save_every = every if args.save_every is None else args.save_every
    if args.child:
        return _trainer(args.framework).train(ChildRun.from_args(args))
    if args.save_every < 1 or args.steps <= 3 * args.save_every:
        # (the kill comes once step 2 x --save-every or later has committed, and the run
        # must then still have a whole interval to train, in which it waits to be killed)
        print("pitstop demo: --steps must be more than 3 x --save-every (and --save-every "
              f"at least 1), got --steps {args.steps} --save-every {args.save_every}",
              file=sys.stderr)
        return 2
    if not 0 <= args.seed < 2**32:
        print(f"pitstop demo: --seed must be 0 to {2**32 - 1}, got {args.seed}",
              file=sys.stderr)
        return 2
    missing = _missing(args.framework)
    if missing:
        print(missing, file=sys.stderr)
        return 2
    if args.dir:
        work = os.path.abspath(args.dir)
        if os.path.exists(work) and (not os.path.isdir(work) or os.listdir(work)):
            print(f"pitstop demo: {work} is not an empty directory; pass an empty or new "
                  "one", file=sys.stderr)
            return 2
        try:
            os.makedirs(work, exist_ok=True)
        except OSError as e:
            print(f"pitstop demo: cannot create {work}: {e.strerror}", file=sys.stderr)
            return 2
        return _interruptible(work, args, keep=True)
    # (a training process being stopped may still remove a file of its own meanwhile)
    with tempfile.TemporaryDirectory(prefix="pitstop-demo-", ignore_cleanup_errors=True) \
            as work:
        try:
            return _interruptible(work, args, keep=False)
        finally:
            _drop_memory_tier(os.path.join(work, "checkpoints"))


def _drop_memory_tier(ckpt: str) -> None:
    """Remove the memory-tier files (/dev/shm) of the temporary checkpoint directory: a
    snapshot kept for a restart (the killed process's, when Ctrl+C came before the restart
    took it over) would otherwise outlive the directory it belongs to."""
    if not os.path.isdir(os.path.join(ckpt, ".pitstop")):
        return
    from pitstop.cli.commands.gc import cmd_gc  # (`pitstop gc --drop-recoverable CKPT`)
    args = argparse.Namespace(dir=ckpt, storage_option=[], dry_run=False, memory_tier=None,
                              drop_recoverable=True)
    with contextlib.suppress(Exception, KeyboardInterrupt), \
            contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        cmd_gc(args)


class _Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP to the demo (``kill PID``, a closed session): stop as on Ctrl+C,
    the training processes included, and remove the temporary directory."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


#: while a process starts (its Popen and the bookkeeping that lets it be stopped): a
#: SIGTERM or SIGHUP then is held here and raised right after, never in between
_starting: list[int] = []


def _stop(signum: int, _frame: Any) -> None:
    if _starting:
        _starting.append(signum)
        return
    raise _Stopped(signum)


@contextlib.contextmanager
def _holding_signals() -> Iterator[None]:
    """Around a process's start and the assignment that lets the demo stop it."""
    _starting.append(0)
    try:
        yield
    finally:
        held = [s for s in _starting[1:] if s]
        _starting.clear()
        if held:
            raise _Stopped(held[0])


def _interruptible(work: str, args: argparse.Namespace, keep: bool) -> int:
    before = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGHUP)} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        return orchestrate(work, args, keep)
    except _Stopped as e:
        print(f"pitstop demo: stopped by {signal.Signals(e.signum).name}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:  # Ctrl+C: the training processes got it too, and stop
        print("pitstop demo: interrupted", file=sys.stderr)
        return 130
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _trainer(framework: str) -> Any:
    return importlib.import_module(f"{__package__}.demo_{framework}")


# ====================================================================== the child side
@dataclass
class ChildRun:
    """What one training process is asked to do, and its reports to the demo (stdout)."""

    directory: str | None  # None: the reference run, no checkpoints
    out: str
    steps: int
    save_every: int
    seed: int
    wrong_resume: bool = False
    peer_path: str = ""
    #: the step whose commit the demo waits for to kill this process (first run only)
    kill_after: int | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ChildRun:
        directory = None if args.no_checkpoint else args.child
        peer = os.path.join(os.path.dirname(os.path.abspath(args.out)), "peer-save")
        first = os.environ.get("PITSTOP_RESTART", "0") == "0"  # pitstop run sets it
        return cls(directory, args.out, args.steps, args.save_every, args.seed,
                   args.wrong_resume, peer, args.kill_after if first else None)

    @staticmethod
    def say(line: str) -> None:
        """One report line in one write(2): stdout is unbuffered (PYTHONUNBUFFERED), and a
        print() writes the text and its newline apart, so a SIGKILL between the two left a
        line without its end, which the restarted process's first line ("pid N") then
        continued: the demo counted one start and failed a run that had restarted."""
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), f"{line}\n".encode())

    def manager(self) -> Any:
        """The run's CheckpointManager (None for the reference run); reports the pid."""
        self.say(f"pid {os.getpid()}")
        if self.directory is None:
            return None
        from pitstop import CheckpointManager

        return CheckpointManager(self.directory, save_every_steps=self.save_every,
                                 keep_last=3)

    def restored(self, step: int | None) -> int:
        """Report the restored step; returns the first step to train."""
        self.say(f"restored {step}")
        return 0 if step is None else step + 1

    def end_of_step(self, step: int, mgr: Any, state: Any, loss: float,
                    peer_save: Callable[[str], None]) -> None:
        """The end of step ``step``: report it, then let the manager save when it is due.
        At a save, ``peer_save(path)`` (the framework's own save of the same state) is
        timed first, then pitstop's save: how long each holds up this thread."""
        self.say(f"step {step}")  # before the save: no checkpoint is ever ahead of it
        if mgr is None:
            return
        if step % self.save_every != 0:  # the manager's save_every_steps policy
            mgr.step(step, state, metrics={"loss": loss})
            return
        t0 = time.perf_counter()
        peer_save(self.peer_path)
        t1 = time.perf_counter()
        handle = mgr.step(step, state, metrics={"loss": loss})
        t2 = time.perf_counter()
        if handle is not None:
            self.say(f"save {step} {t2 - t1:.6f} {t1 - t0:.6f}")
        if self.kill_after is not None and step >= self.kill_after + self.save_every:
            # a whole interval past the step the demo kills at, and still alive: the demo
            # has not been scheduled yet (a busy machine). Wait for its SIGKILL here rather
            # than finish unkilled; the checkpoint it waits for commits in the background.
            # (Bounded: should the demo be gone, training goes on.)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                time.sleep(0.01)
            self.kill_after = None

    def finish(self, mgr: Any, arrays: dict[str, np.ndarray]) -> int:
        """Close the manager, write what the comparison reads, report ``done``."""
        if mgr is not None:
            mgr.close()
        savez: Any = np.savez  # (numpy's stubs take a keyword argument for allow_pickle)
        savez(self.out, **arrays)
        self.say("done")
        return 0


# ====================================================================== the demo side


def _child_cmd(framework: str, directory: str, out: str, args: argparse.Namespace,
               checkpoint: bool = True, kill_after: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "pitstop.cli", "demo", "--framework", framework, "--child",
           directory, "--out", out, "--steps", str(args.steps), "--save-every",
           str(args.save_every), "--seed", str(args.seed)]
    if not checkpoint:
        cmd.append("--no-checkpoint")
    if args.wrong_resume:
        cmd.append("--wrong-resume")
    if kill_after is not None:
        cmd += ["--kill-after", str(kill_after)]
    return cmd


def _committed(directory: str) -> list[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(
        step
        for n in names
        if (step := DEFAULT.parse(n)) is not None
        and os.path.isfile(os.path.join(directory, n, "manifest.json"))
    )


def _fail(proc: Watched, what: str) -> int:
    print(f"pitstop demo: {what}", file=sys.stderr)
    tail = proc.tail()
    if tail:
        print(tail, file=sys.stderr)
    return 1


def _say(text: str) -> None:
    """One line on stdout in one write: the relay of the supervisor's reports prints from
    another thread, and ``print`` writes the text and its newline apart."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _ms(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1e3:7.1f} ms"


def orchestrate(work: str, args: argparse.Namespace, keep: bool) -> int:
    """The demo itself: reference and supervised runs side by side, the kill, the check."""
    t0 = time.perf_counter()
    fw = args.framework
    trainer = _trainer(fw)
    ckpt = os.path.join(work, "checkpoints")
    ref_dir, run_dir = os.path.join(work, "reference"), os.path.join(work, "resumed")
    os.makedirs(ref_dir, exist_ok=True)
    os.makedirs(run_dir, exist_ok=True)
    ref_out, run_out = os.path.join(ref_dir, "final.npz"), os.path.join(run_dir, "final.npz")
    print(f"pitstop demo --framework {fw}: {trainer.DESCRIPTION}")
    print(f"  {args.steps} steps, a checkpoint every {args.save_every} steps, in {ckpt}"
          + ("" if keep else " (a temporary directory)"))

    # kill once a few checkpoints have committed, in the first third or so of the run
    kill_after = max(2 * args.save_every,
                     (args.steps // 3) // args.save_every * args.save_every)
    child = _child_cmd(fw, ckpt, run_out, args, kill_after=kill_after)
    cmd = [sys.executable, "-m", "pitstop.cli", "run", "--dir", ckpt, "--max-restarts", "3",
           "--backoff", "0.2", "--", *child]
    shown = (f"pitstop run --dir {ckpt} --max-restarts 3 --backoff 0.2 -- python -m "
             f"pitstop.cli demo --framework {fw} --child ...")

    announced = threading.Event()

    def relay(line: str) -> None:  # the supervisor's own reports, as it prints them
        if line.startswith("pitstop run:"):
            announced.wait(30)  # after the demo's line that says what it killed
            _say(f"     {line.rstrip()}")

    # 1. the reference (never interrupted, no checkpoints) and 2. the run under pitstop,
    # side by side: each is single-threaded, and this machine has cores for both
    _say("1. reference run: the same training, uninterrupted, without checkpoints "
         "(runs alongside 2.)")
    ref: Watched | None = None
    sup: Watched | None = None
    try:  # (from the first start: a signal may come while the second starts)
        with _holding_signals():
            ref = Watched(_child_cmd(fw, os.path.join(work, "unused"), ref_out, args,
                                      checkpoint=False))
        _say(f"2. the run with pitstop: {shown}")
        with _holding_signals():
            sup = Watched(cmd, on_err=relay)
        return _supervised(args, trainer, ckpt, ref, sup, kill_after, announced, ref_out,
                           run_out, run_dir, keep, t0)
    finally:
        # only on the way out of a failure or a signal: no strays. pitstop run passes
        # SIGTERM on to the training process and exits once it has saved and exited (a
        # second signal, after Ctrl+C reached it too, makes it kill the job at once)
        announced.set()  # (its lines about stopping are relayed at once)
        running = [w for w in (ref, sup) if w is not None and w.proc.poll() is None]
        for w in running:
            w.proc.terminate()
        for w in running:
            try:
                w.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                w.proc.kill()
            w.wait()
        # (should pitstop run have been killed: its job dies with it, and saves first)
        deadline = time.monotonic() + 30
        while sup is not None and any(_alive(p) for p in sup.pids) and \
                time.monotonic() < deadline:
            time.sleep(0.02)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (an exited one not yet reaped does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] not in (b"Z", b"X")
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return not os.path.isdir("/proc")  # (/proc said it is gone)


def _supervised(args: argparse.Namespace, trainer: Any, ckpt: str, ref: Watched,
                sup: Watched, kill_after: int, announced: threading.Event, ref_out: str,
                run_out: str, run_dir: str, keep: bool, t0: float) -> int:
    """From the start of both runs to the verdict."""
    deadline = time.monotonic() + 300
    while True:
        committed = _committed(ckpt)
        if committed and committed[-1] >= kill_after and sup.pids:
            break
        if sup.proc.poll() is not None:
            return _fail(sup, "the training run ended before it could be killed "
                         f"(exit status {sup.proc.returncode})")
        if time.monotonic() > deadline:
            return _fail(sup, "the training run made no progress")
        time.sleep(0.005)
    victim = sup.pids[0]
    os.kill(victim, signal.SIGKILL)
    newest = _committed(ckpt)[-1]  # (nothing commits after the kill: its writer died too)
    _say(f"   kill -9 {victim}: the training process (not `pitstop run`); newest committed "
         f"checkpoint: step {newest}")
    announced.set()
    rc = sup.wait()
    ref_rc = ref.wait()
    if ref_rc != 0 or not ref.done:
        return _fail(ref, f"the reference run failed (exit status {ref_rc})")
    if rc != 0 or not sup.done:
        return _fail(sup, f"the run with pitstop failed (exit status {rc})")
    restored = sup.restored[-1] if sup.restored else None
    if len(sup.pids) < 2:
        return _fail(sup, "the training process was not restarted (it reported "
                     f"{len(sup.pids)} start(s))")
    if restored is None:
        return _fail(sup, "the restarted training found nothing to restore (it reported "
                     f"restores of {sup.restored})")
    killed_after = sup.last_step.get(victim, -1)
    source = ("" if restored == newest else
              " (from the memory tier: the snapshot outlived the killed process)")
    _say(f"   the killed process had finished step {killed_after}; the restarted one "
         f"restored step {restored}{source}, resumed at step {restored + 1} and trained to "
         f"step {args.steps - 1}")

    # 3. the comparison
    reference, resumed = _load(ref_out), _load(run_out)
    losses = reference["losses"]
    right_step = newest <= restored <= killed_after
    differ = sorted(k for k in reference
                    if k not in resumed or not _bitwise_equal(reference[k], resumed[k]))
    differ += sorted(set(resumed) - set(reference))
    identical = not differ and right_step
    _say(f"3. compare with the reference: {len(reference) - 1} arrays of final weights and "
         f"optimizer state, and all {len(losses)} per-step losses "
         f"(loss {losses[0]:.4f} -> {losses[-1]:.4f})")
    if identical:
        _say("   identical: yes, bit for bit")
    else:
        first_bad = _first_difference(reference.get("losses"), resumed.get("losses"))
        _say(f"   identical: NO (differ: {', '.join(differ[:8]) or 'none'}"
             + ("" if len(differ) <= 8 else f" and {len(differ) - 8} more")
             + (f"; the losses first differ at step {first_bad}" if first_bad is not None
                 else "")
             + ("" if right_step else "; resumed at the wrong step") + ")")
    if sup.saves:
        pit = [s[1] for s in sup.saves]
        peer = [s[2] for s in sup.saves]
        name, note = trainer.PEER
        _say(f"training-thread stall per save, median of {len(pit)} saves of the same "
             f"state ({trainer.state_mib(args.steps):.1f} MiB) in the same process:")
        width = max(len(name), 7)
        _say(f"   {'pitstop':<{width}} {_ms(pit)}  (copy to a staging buffer; written, "
             "hashed and fsynced in the background)")
        _say(f"   {name:<{width}} {_ms(peer)}  ({note})")
    for name in os.listdir(run_dir):  # the peer's files: only their timing mattered
        if name.startswith("peer-save"):
            path = os.path.join(run_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    _say(f"took {time.perf_counter() - t0:.1f} s")
    if keep:
        _say("look inside the checkpoints:")
        for c in ("ls", "inspect", "verify"):
            _say(f"   pitstop {c} {ckpt}")
    return 0 if identical else 1


def _load(path: str) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def _bitwise_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _first_difference(a: np.ndarray | None, b: np.ndarray | None) -> int | None:
    """The first index where two 1-D arrays differ in any bit, or None."""
    if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype or a.ndim != 1:
        return None
    ne = np.flatnonzero((a.view(np.uint8).reshape(a.size, -1)
                         != b.view(np.uint8).reshape(b.size, -1)).any(axis=1))
    return int(ne[0]) if len(ne) else None
