"""Exact resume: a run killed (SIGKILL at a random step, SIGTERM, SIGTERM or SIGINT to the
whole process group, or with its newest snapshot only in the memory tier) and restarted ends
bitwise identical to an uninterrupted run: same final parameters, same optimizer state, same
loss at every step.

The jobs are real processes (tests/adapters/torch/train_child.py). The first run of every scenario
and the uninterrupted reference start together (they are mostly torch's import time); each
test then restarts its own job from the checkpoint and compares. The random plan's seed is
in every failure message.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

CHILD = Path(__file__).with_name("train_child.py")
STEPS, SAVE_EVERY = 30, 4
ROOT = Path(__file__).resolve().parents[3]
SHM = os.access("/dev/shm", os.W_OK)


class Job:
    """One run of the training child, in its own process group (its DataLoader workers
    die with it, as on a preempted machine). ``interactive``: stdin and stdout are pipes
    (for ``--wait-at``)."""

    seed: int = -1
    args: dict[str, list[str]] = {}

    def __init__(self, out: Path, *args: str, interactive: bool = False) -> None:
        self.out, self.ckpt = out, out / "ckpt"
        out.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        with open(out / "stdout.txt", "ab") as so, open(out / "stderr.txt", "ab") as se:
            self.proc = subprocess.Popen(
                [sys.executable, str(CHILD), "--dir", str(self.ckpt), "--out", str(out),
                 "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), *args],
                stdin=subprocess.PIPE if interactive else subprocess.DEVNULL,
                stdout=subprocess.PIPE if interactive else so, stderr=se, env=env,
                start_new_session=True)

    def note(self, name: str) -> str:
        """What a failure message starts with: the plan and the seed that drew it."""
        return f"plan {name}: {self.args.get(name)}, seed {self.seed}"

    def wait_for_line(self, expected: str, timeout: float = 120) -> None:
        """Read the child's stdout until the line ``expected`` (fails if it exits first)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        seen = b""
        while True:
            ready, _, _ = select.select([fd], [], [], timeout)
            assert ready, f"no {expected!r} from the child within {timeout} s: {self.stderr()}"
            chunk = os.read(fd, 4096)
            assert chunk, f"the child exited before {expected!r}: {self.stderr()}"
            seen += chunk
            if expected.encode() in seen.splitlines():
                return

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

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to every process of the job (trainer and DataLoader workers), as
        Slurm preemption, scancel or docker stop do, then let it go on (close its stdin)."""
        os.killpg(self.proc.pid, signum)
        assert self.proc.stdin is not None
        self.proc.stdin.close()

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
        elif kind == "step":
            step, loss = int(rest[0]), rest[1]
            assert losses.setdefault(step, loss) == loss, f"step {step} differs when recomputed"
    return starts, losses


def committed_steps(ckpt: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in ckpt.glob("step_*") if p.is_dir())


def not_a_periodic_save(rnd: random.Random) -> int:
    return rnd.choice([s for s in range(1, STEPS - 2) if s % SAVE_EVERY])


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    plan = {
        "reference": [],
        # after the first save (step 0, or SAVE_EVERY were that policy to change); the child
        # also waits for that save to commit before it kills, so a restart always resumes
        "kill": ["--kill-at", str(rnd.randrange(SAVE_EVERY + 1, STEPS - 2)),
                 "--kill-phase", rnd.choice(["mid", "after"])],
        "term": ["--term-at", str(not_a_periodic_save(rnd))],
        "group_term": ["--wait-at", str(not_a_periodic_save(rnd))],
        "group_int": ["--wait-at", str(not_a_periodic_save(rnd))],
    }
    if SHM:
        plan["memory"] = ["--memory-tier", "--slow-persist-at",
                          str(SAVE_EVERY * rnd.randrange(2, (STEPS - 3) // SAVE_EVERY + 1))]
    Job.seed, Job.args = seed, plan  # for failure messages
    started = {name: Job(tmp_path_factory.mktemp(name), *args,
                         interactive=name.startswith("group_"))
               for name, args in plan.items()}
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


def check_resumed(reference: Path, out: Path, note: str) -> None:
    starts, losses = read_log(out)
    _, ref_losses = read_log(reference)
    assert starts[0] is None and len(starts) == 2, f"{note}: starts {starts}"
    assert losses == ref_losses, note  # every step's loss, bit for bit
    fa, fb = np.load(reference / "final.npz"), np.load(out / "final.npz")
    assert sorted(fa.files) == sorted(fb.files), note
    for k in fa.files:  # parameters, every optimizer moment and step count, the lr
        assert fa[k].dtype == fb[k].dtype and fa[k].shape == fb[k].shape, f"{note}: {k}"
        assert fa[k].tobytes() == fb[k].tobytes(), f"{note}: {k} differs"


def test_sigkill_at_a_random_step(jobs, reference):
    job = jobs["kill"]
    kill_at = int(job.args["kill"][1])
    note = job.note("kill")
    assert job.wait() == -signal.SIGKILL, f"{note}: {job.stderr()}"
    assert job.restart() == 0, f"{note}: {job.stderr()}"
    starts, _ = read_log(job.out)
    assert starts[1] is not None and starts[1] <= kill_at, f"{note}: starts {starts}"
    check_resumed(reference, job.out, note)


def test_sigterm_saves_at_the_step_boundary_and_resumes_there(jobs, reference):
    job = jobs["term"]
    term_at = int(job.args["term"][1])
    note = job.note("term")
    assert job.wait() == -signal.SIGTERM, f"{note}: {job.stderr()}"
    assert committed_steps(job.ckpt)[-1] == term_at, note
    assert job.restart() == 0, f"{note}: {job.stderr()}"
    assert read_log(job.out)[0][1] == term_at, note
    check_resumed(reference, job.out, note)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_whole_process_group_saves_and_exits_as_the_signal_asks(
        jobs, reference, signum):
    """Slurm preemption, scancel and docker stop signal the trainer and its two DataLoader
    workers alike. The workers leave it to the trainer, which saves at its next step
    boundary and then exits as the signal asks (SIGTERM: killed by it; SIGINT:
    KeyboardInterrupt); a restart resumes there, bit-exactly."""
    name = "group_term" if signum == signal.SIGTERM else "group_int"
    job = jobs[name]
    at = int(job.args[name][1])
    note = job.note(name)
    job.wait_for_line(f"waiting {at}")  # step `at` is under way, its batch in hand
    job.signal_group(signum)
    assert job.wait() == -signum, f"{note}: {job.stderr()}"
    assert committed_steps(job.ckpt)[-1] == at, f"{note}: {job.stderr()}"
    err = job.stderr()
    assert "DataLoader worker" not in err, f"{note}: {err}"
    # only the trainer acts on it (a forked worker used to run the trainer's handler too)
    assert err.count(f"{signal.Signals(signum).name} received") == 1, f"{note}: {err}"
    if signum == signal.SIGINT:
        assert "KeyboardInterrupt" in err, f"{note}: {err}"
    assert job.restart() == 0, f"{note}: {job.stderr()}"
    assert read_log(job.out)[0][1] == at, note
    check_resumed(reference, job.out, note)


@pytest.mark.skipif(not SHM, reason="needs a writable /dev/shm")
def test_restore_from_the_memory_tier(jobs, reference):
    job = jobs["memory"]
    slow_at = int(job.args["memory"][2])
    note = job.note("memory")
    assert job.wait() == -signal.SIGKILL, f"{note}: {job.stderr()}"
    assert committed_steps(job.ckpt)[-1] < slow_at, note  # the newest never reached disk
    assert job.restart("--memory-tier") == 0, f"{note}: {job.stderr()}"
    assert read_log(job.out)[0][1] == slow_at, note  # restored from memory
    check_resumed(reference, job.out, note)
