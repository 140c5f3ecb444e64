"""What the fault and concurrency scenarios share: deterministic states, bit-exact checks,
a small tmpfs, child processes and a quiet pitstop logger that still counts its warnings."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

import pitstop
from pitstop.core.directory.names import DEFAULT

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def trial_rng(seed: int, trial: int, salt: str = "") -> random.Random:
    """The random choices of one trial: the same for the same seed and trial."""
    return random.Random(f"{salt}:{seed}:{trial}")


def counted_trial(res: Any, name: str, seed: int, t: int, fn: Any, *args: Any) -> None:
    """Run one trial ``fn(*args)``, counted; anything it raises is a broken promise, counted
    as a failure with the scenario, seed and trial."""
    res.trials += 1
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - a broken promise, counted
        res.fail(f"{name} seed {seed} trial {t}: {type(e).__name__}: {e}")


def state_of(seed: int, step: int, n: int = 4096) -> dict[str, Any]:
    """The training state of ``step``: arrays and values that differ at every step and seed."""
    rng = np.random.default_rng([seed, step, n])
    return {
        "model": {"w": rng.standard_normal(n, dtype=np.float32),
                  "b": rng.integers(-2**40, 2**40, size=max(1, n // 64), dtype=np.int64)},
        "opt": {"m": rng.standard_normal(max(1, n // 4))},
        "step": step,
        "lr": float(rng.random()),
    }


def target_of(n: int = 4096) -> dict[str, Any]:
    """A live state to restore into, shaped as :func:`state_of`'s."""
    return {"model": {"w": np.zeros(n, np.float32), "b": np.zeros(max(1, n // 64), np.int64)},
            "opt": {"m": np.zeros(max(1, n // 4))}, "step": -1, "lr": -1.0}


def state_bytes(n: int) -> int:
    return 4 * n + 8 * max(1, n // 64) + 8 * max(1, n // 4)


def diff(got: Any, want: Any, where: str = "") -> str | None:
    """None when ``got`` equals ``want`` bit for bit (arrays: dtype, shape and bytes)."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return f"{where or 'root'}: keys {sorted(got) if isinstance(got, dict) else got!r}"
        for k in want:
            d = diff(got[k], want[k], f"{where}/{k}")
            if d:
                return d
        return None
    if isinstance(want, np.ndarray):
        if not isinstance(got, np.ndarray) or got.dtype != want.dtype or \
                got.shape != want.shape or got.tobytes() != want.tobytes():
            return f"{where}: array differs"
        return None
    if type(got) is not type(want) or got != want:
        return f"{where}: {got!r} != {want!r}"
    return None


def committed_on_disk(d: Path) -> list[int]:
    """Committed steps, read from the directory itself (a manifest in a named entry)."""
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return []
    return sorted(s for s in (DEFAULT.parse(e) for e in names)
                  if s is not None and (d / DEFAULT.name(s) / "manifest.json").is_file())


def leftovers(d: Path) -> list[str]:
    """Temporaries of interrupted saves, deletions and index writes."""
    out = [e for e in os.listdir(d) if e.startswith(".tmp-")] if d.is_dir() else []
    meta = d / ".pitstop"
    if meta.is_dir():
        out += [f".pitstop/{e}" for e in os.listdir(meta) if ".tmp-" in e]
    return out


def check_all_exact(d: Path, seed: int, n_of: dict[int, int] | int) -> list[str]:
    """Every committed checkpoint in ``d`` loads bit-exact as the state of its step (through
    a read-only manager, as another process would read it); the problems found."""
    problems = []
    with pitstop.CheckpointManager(d, read_only=True) as ro:
        for s in ro.all_steps():
            n = n_of if isinstance(n_of, int) else n_of.get(s)
            if n is None:
                problems.append(f"step {s} is committed but was never saved")
                continue
            try:
                got = ro.load(s)
            except pitstop.CheckpointError as e:
                problems.append(f"step {s} does not load: {type(e).__name__}: {e}")
                continue
            d_ = diff(got, state_of(seed, s, n))
            if d_:
                problems.append(f"step {s} is not the state saved: {d_}")
    return problems


class _Counter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def count(self, level: int, text: str = "") -> int:
        return sum(r.levelno == level and text in r.getMessage() for r in self.records)


@contextlib.contextmanager
def quiet_pitstop() -> Iterator[_Counter]:
    """pitstop's log records kept (not printed) and its warnings recorded, for counting."""
    log = logging.getLogger("pitstop")
    handler = _Counter()
    old = (log.level, log.propagate)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            handler.warned = seen  # type: ignore[attr-defined]
            yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(old[0])
        log.propagate = old[1]


def can_mount() -> bool:
    return os.geteuid() == 0


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[bool]:
    """A tmpfs of ``size`` at ``path`` (True), or False where mounting is not permitted."""
    path.mkdir(parents=True, exist_ok=True)
    ok = can_mount() and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True).returncode == 0
    try:
        yield ok
    finally:
        if ok:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def spawn(code: str, *args: str, user: int | None = None) -> subprocess.Popen[str]:
    """A Python child running ``code`` (argv: ``args``), lines in and out; ``user``: the uid
    it drops to before running anything."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONDONTWRITEBYTECODE="1")
    pre = None
    if user is not None:
        def pre() -> None:
            os.setgid(user)
            os.setgroups([])
            os.setuid(user)
    # -X faulthandler: a SIGABRT (see _stacks) prints every thread's stack before it dies
    return subprocess.Popen([PY, "-X", "faulthandler", "-c", code, *args], env=env,
                            cwd=str(ROOT), text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=pre)


def read_json_line(proc: subprocess.Popen[str], timeout: float = 120,
                   waiting: str = "a line") -> Any:
    """The next JSON line the child prints (other lines skipped); raises ChildDied when it
    exits, and TimeoutError (``waiting``: what for) with the child's stacks when it prints
    nothing in time (the child is then ended).

    Lines are read from the pipe itself into a buffer kept on ``proc``, never through
    ``proc.stdout``: its reader takes every line already in the pipe, and a wait on the
    pipe does not see those again, so a child that printed two lines before the parent
    read and then waited for the parent (``two_writers``: a commit, then "held") looked
    silent."""
    import selectors
    import time
    assert proc.stdout is not None
    pending: bytearray = proc.__dict__.setdefault("_json_lines_pending", bytearray())
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    try:
        while True:
            while b"\n" in pending:
                cut = pending.index(b"\n") + 1
                line = pending[:cut].decode(errors="replace")
                del pending[:cut]
                if line.startswith("{") or line.startswith("["):
                    return json.loads(line)
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise TimeoutError(f"the child (pid {proc.pid}) said nothing in {timeout:g} s "
                                   f"while the parent waited for {waiting}; its stacks:\n"
                                   + _stacks(proc))
            chunk = os.read(fd, 1 << 16)
            if chunk:
                pending += chunk
                continue
            if pending:  # a last line without its newline
                pending += b"\n"
                continue
            err = proc.stderr.read() if proc.stderr else ""
            raise ChildDied(f"the child exited ({proc.wait()}): {err[-2000:]}")
    finally:
        sel.close()


def _stacks(proc: subprocess.Popen[str]) -> str:
    """End a silent child with SIGABRT, so that its faulthandler prints every thread's stack
    on its stderr, and return that (the tail of what it wrote there)."""
    import signal
    if proc.poll() is None:
        proc.send_signal(signal.SIGABRT)
        try:
            proc.wait(timeout=60)  # the dump is written before it dies (or it is stuck in D)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=60)
    err = proc.stderr.read() if proc.stderr else ""
    return err[-6000:] or "(it wrote nothing on stderr)"


class ChildDied(RuntimeError):
    pass


def send(proc: subprocess.Popen[str], doc: Any) -> None:
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(doc) + "\n")
    proc.stdin.flush()


def end(proc: subprocess.Popen[str]) -> None:
    """Kill a child that is still running, and reap it."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=60)
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()
