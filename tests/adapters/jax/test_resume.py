"""Exact resume of a JAX job: killed with SIGKILL twice at random steps and restarted each
time, it prints the same loss at every step and ends with the same parameters, optimizer
state and PRNG key, bit for bit, as an uninterrupted run.

The jobs are real processes (tests/adapters/jax/train_child.py: Flax MLP with dropout, Optax Adam,
a typed key split every step, async saves at every step, default memory tier). The
interrupted job runs in lockstep with the test, which kills it right after a line it has
read: once right after a step's loss line, while that step's save may be under way, and once
right after ``save()`` of a step returned while its write to disk is held back: with the
memory tier (on by default where /dev/shm is writable) that loses nothing, the restart
resumes from that very step, restored from shared memory. The plan's seed is in
every failure message.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

CHILD = Path(__file__).with_name("train_child.py")
ROOT = Path(__file__).resolve().parents[3]
STEPS = 30
SHM = os.access("/dev/shm", os.W_OK)  # the memory tier is on by default where it is


class Child:
    """One run of the training child in its own process group; stdout read line by line."""

    def __init__(self, ckpt: Path, err: Path, lockstep: bool, *args: str) -> None:
        self.err = err
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(ROOT), os.environ.get("PYTHONPATH", "")]))  # XLA_FLAGS as conftest set them
        with open(err, "ab") as se:
            self.proc = subprocess.Popen(
                [sys.executable, str(CHILD), "--dir", str(ckpt), "--steps", str(STEPS),
                 *(["--lockstep"] if lockstep else []), *args],
                stdin=subprocess.PIPE if lockstep else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=se, env=env, start_new_session=True)
        self._buf = b""

    def line(self, timeout: float = 120) -> str | None:
        """The next stdout line; None once the child has closed stdout (exited)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            ready, _, _ = select.select([fd], [], [], timeout)
            assert ready, f"no line from the child within {timeout} s: {self.stderr()}"
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def go_on(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=120)
        finally:
            self.kill()

    def stderr(self) -> str:
        return self.err.read_text()[-4000:]


@dataclass
class Run:
    start: int | None = None
    losses: dict[int, str] = field(default_factory=dict)
    committed: list[int] = field(default_factory=list)
    killed_after: int | None = None  # the last step line read before the kill
    phase: str | None = None  # killed on its "step" line or on its "saved" line
    final: str | None = None
    rc: int | None = None


def drive(child: Child, kill: tuple[int, str] | None, have_checkpoint: bool, note: str) -> Run:
    """Read the child's lines; with ``kill=(at, phase)``, SIGKILL it on the first ``phase``
    line ("step" or "saved") of a step ``>= at``, or, when no checkpoint exists yet (none
    committed, none restored), as soon as one is committed: the child, not let go on past
    that step's save, waits meanwhile."""
    run = Run()
    while (line := child.line()) is not None:
        kind, *rest = line.split()
        if kind == "start":
            run.start = None if rest[0] == "None" else int(rest[0])
            have_checkpoint |= run.start is not None
        elif kind == "committed":
            run.committed.append(int(rest[0]))
            have_checkpoint = True
        elif kind in ("step", "saved"):
            step = int(rest[0])
            if kind == "step":
                assert step not in run.losses, f"{note}: step {step} twice in one run"
                run.losses[step] = rest[1]
            if kill is not None and kind == kill[1] and step >= kill[0]:
                run.killed_after, run.phase = step, kind
            elif kill is not None and kind == "saved" and run.killed_after is None:
                child.go_on()
        elif kind == "final":
            run.final = rest[0]
        else:
            raise AssertionError(f"{note}: unexpected line {line!r}")
        if run.killed_after is not None and have_checkpoint:
            child.kill()  # the child waits for go_on meanwhile (after its "saved" line)
            break
    run.rc = child.wait()
    return run


def hold(step: int, phase: str) -> list[str]:
    """A kill after ``saved`` finds that step in the memory tier only: its write is held."""
    return ["--hold-persist-at", str(step)] if phase == "saved" else []


def test_two_sigkills_at_random_steps_then_resume_bitwise_as_uninterrupted(tmp_path):
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    note = f"seed {seed}"
    reference = Child(tmp_path / "ref_ckpt", tmp_path / "ref.err", lockstep=False)
    job = tmp_path / "job_ckpt"
    runs: list[Run] = []
    phases = rnd.sample(["step", "saved"], 2)
    try:
        first_kill = rnd.randint(2, STEPS // 2)
        note += f", first kill on the {phases[0]!r} line of step {first_kill}"
        child = Child(job, tmp_path / "job.err", True, *hold(first_kill, phases[0]))
        runs.append(drive(child, (first_kill, phases[0]), False, note))
        assert runs[0].rc == -signal.SIGKILL, f"{note}: {child.stderr()}"
        killed = runs[0].killed_after
        assert killed is not None and killed + 4 < STEPS, f"{note}: killed after {killed}"
        second_kill = rnd.randint(killed + 2, STEPS - 3)
        note += f" (at {killed}), second on the {phases[1]!r} line of step {second_kill}"
        child = Child(job, tmp_path / "job.err", True, *hold(second_kill, phases[1]))
        runs.append(drive(child, (second_kill, phases[1]), True, note))
        assert runs[1].rc == -signal.SIGKILL, f"{note}: {child.stderr()}"
        child = Child(job, tmp_path / "job.err", lockstep=False)
        runs.append(drive(child, None, True, note))
        assert runs[2].rc == 0, f"{note}: {child.stderr()}"
        ref = drive(reference, None, False, note)
        assert ref.rc == 0, f"{note}: {reference.stderr()}"
    finally:
        reference.kill()
    note += f"; runs {[(r.start, r.killed_after, r.committed) for r in runs]}"

    assert ref.start is None and sorted(ref.losses) == list(range(STEPS)) and ref.final, note
    assert runs[0].start is None, note
    for i in (1, 2):
        # resumed from a checkpoint at least as new as every commit reported and the one
        # restored before, and not newer than the last step saved (the killed run waited
        # for the test after each save)
        before, after = runs[i - 1], runs[i]
        floor = max([s for r in runs[:i] for s in r.committed]
                    + [r.start for r in runs[:i] if r.start is not None], default=-1)
        assert after.start is not None, note
        assert floor <= after.start <= before.killed_after, f"{note}: run {i}"
        if before.phase == "saved" and SHM:  # save() had returned: nothing is lost (memory)
            assert after.start == before.killed_after, f"{note}: run {i}"
    for i, run in enumerate(runs):
        first = 0 if run.start is None else run.start + 1
        last = run.killed_after if run.killed_after is not None else STEPS - 1
        assert sorted(run.losses) == list(range(first, last + 1)), f"{note}: run {i}"
        wrong = {s: (loss, ref.losses[s]) for s, loss in run.losses.items()
                 if loss != ref.losses[s]}
        assert not wrong, f"{note}: run {i}: losses (got, uninterrupted) differ: {wrong}"
    assert runs[2].final == ref.final, f"{note}: final parameters, optimizer state or key differ"
