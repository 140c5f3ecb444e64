"""Exact resume: a run killed (SIGKILL at a random step, SIGTERM, or with its newest
snapshot only in the memory tier) and restarted ends bitwise identical to an uninterrupted
run: same final parameters, same optimizer state, same loss at every step.

The jobs are real processes (tests/torch/train_child.py). The first run of every scenario
and the uninterrupted reference start together (they are mostly torch's import time); each
test then restarts its own job from the checkpoint and compares.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

CHILD = Path(__file__).with_name("train_child.py")
STEPS, SAVE_EVERY = 30, 4
ROOT = Path(__file__).resolve().parents[2]
SHM = os.access("/dev/shm", os.W_OK)


class Job:
    """One run of the training child, in its own process group (its DataLoader workers
    die with it, as on a preempted machine)."""

    def __init__(self, out: Path, *args: str) -> None:
        self.out, self.ckpt = out, out / "ckpt"
        out.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        with open(out / "stdout.txt", "ab") as so, open(out / "stderr.txt", "ab") as se:
            self.proc = subprocess.Popen(
                [sys.executable, str(CHILD), "--dir", str(self.ckpt), "--out", str(out),
                 "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), *args],
                stdout=so, stderr=se, env=env, start_new_session=True)

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=240)
        finally:
            self.kill()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # leftover workers, if any
        except (ProcessLookupError, PermissionError):
            pass

    def restart(self, *args: str) -> int:
        self.proc = Job(self.out, *args).proc
        return self.wait()

    def stderr(self) -> str:
        return (self.out / "stderr.txt").read_text()[-4000:]


def read_log(out: Path) -> tuple[list[int | None], dict[int, str]]:
    """The ``start`` lines and the loss logged for each step; a step logged twice
    (recomputed after a restart) must have logged the same loss both times."""
    starts: list[int | None] = []
    losses: dict[int, str] = {}
    for line in (out / "log.txt").read_text().splitlines():
        kind, *rest = line.split()
        if kind == "start":
            starts.append(None if rest[0] == "None" else int(rest[0]))
        else:
            step, loss = int(rest[0]), rest[1]
            assert losses.setdefault(step, loss) == loss, f"step {step} differs when recomputed"
    return starts, losses


def committed_steps(ckpt: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in ckpt.glob("step_*") if p.is_dir())


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    plan = {
        "reference": [],
        "kill": ["--kill-at", str(rnd.randrange(3, STEPS - 2)),
                 "--kill-phase", rnd.choice(["mid", "after"])],
        "term": ["--term-at", str(rnd.choice([s for s in range(1, STEPS - 2)
                                              if s % SAVE_EVERY])),  # not a periodic save
                 ],
    }
    if SHM:
        plan["memory"] = ["--memory-tier", "--slow-persist-at",
                          str(SAVE_EVERY * rnd.randrange(2, (STEPS - 3) // SAVE_EVERY + 1))]
    started = {name: Job(tmp_path_factory.mktemp(name), *args) for name, args in plan.items()}
    for job in started.values():
        job.seed, job.args = seed, plan  # for failure messages
    yield started
    for job in started.values():
        job.kill()


@pytest.fixture(scope="module")
def reference(jobs) -> Path:
    job = jobs["reference"]
    assert job.wait() == 0, job.stderr()
    starts, losses = read_log(job.out)
    assert starts == [None] and sorted(losses) == list(range(STEPS))
    return job.out


def check_resumed(reference: Path, out: Path) -> None:
    starts, losses = read_log(out)
    _, ref_losses = read_log(reference)
    assert starts[0] is None and len(starts) == 2
    assert losses == ref_losses  # every step's loss, bit for bit
    fa, fb = np.load(reference / "final.npz"), np.load(out / "final.npz")
    assert sorted(fa.files) == sorted(fb.files)
    for k in fa.files:  # parameters, every optimizer moment and step count, the lr
        assert fa[k].dtype == fb[k].dtype and fa[k].shape == fb[k].shape, k
        assert fa[k].tobytes() == fb[k].tobytes(), f"{k} differs"


def test_sigkill_at_a_random_step(jobs, reference):
    job = jobs["kill"]
    kill_at = int(job.args["kill"][1])
    note = f"plan {job.args['kill']}, seed {job.seed}"
    assert job.wait() == -signal.SIGKILL, f"{note}: {job.stderr()}"
    assert job.restart() == 0, f"{note}: {job.stderr()}"
    starts, _ = read_log(job.out)
    assert starts[1] is not None and starts[1] <= kill_at, note
    check_resumed(reference, job.out)


def test_sigterm_saves_at_the_step_boundary_and_resumes_there(jobs, reference):
    job = jobs["term"]
    term_at = int(job.args["term"][1])
    assert job.wait() == -signal.SIGTERM, f"term at {term_at}: {job.stderr()}"
    assert committed_steps(job.ckpt)[-1] == term_at
    assert job.restart() == 0, job.stderr()
    assert read_log(job.out)[0][1] == term_at
    check_resumed(reference, job.out)


@pytest.mark.skipif(not SHM, reason="needs a writable /dev/shm")
def test_restore_from_the_memory_tier(jobs, reference):
    job = jobs["memory"]
    slow_at = int(job.args["memory"][2])
    assert job.wait() == -signal.SIGKILL, job.stderr()
    assert committed_steps(job.ckpt)[-1] < slow_at  # the newest snapshot never reached disk
    assert job.restart("--memory-tier") == 0, job.stderr()
    assert read_log(job.out)[0][1] == slow_at  # restored from memory
    check_resumed(reference, job.out)
