"""``pitstop run --requeue``: Slurm's requeue of a job warned with ``--signal=USR1@N``.

Slurm sends SIGUSR1 N seconds before it ends the job (``sbatch --signal=B:USR1@90``); the
supervisor forwards it and pitstop in the job saves at its next step. With ``--requeue``
the supervisor then runs ``scontrol requeue $SLURM_JOB_ID``, once the save is committed (a
step newer than the newest one at the signal in the checkpoint directory), or the job has
exited, or ``--grace`` seconds have passed since the signal (a job that never saves must
not be lost at the time limit). Slurm then ends this run (SIGTERM, on which pitstop saves
again if steps were made) and starts the same command again later, which resumes from the
directory. A failed ``scontrol`` is said with its stderr; supervision goes on.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping

#: how long ``scontrol requeue`` may take before it counts as failed
SCONTROL_TIMEOUT = 30.0
#: how often the checkpoint directory is read while a requeue waits for the save
POLL_DIR = 0.25


def requeue_problem(environ: Mapping[str, str]) -> str | None:
    """Why ``--requeue`` cannot work here (None: it can): it needs a Slurm job's id and
    ``scontrol`` on PATH."""
    if not environ.get("SLURM_JOB_ID"):
        return ("--requeue requeues a Slurm job and SLURM_JOB_ID is not set: run pitstop run "
                "inside a Slurm job (sbatch), or drop --requeue")
    if shutil.which("scontrol", path=environ.get("PATH")) is None:
        return ("--requeue runs `scontrol requeue $SLURM_JOB_ID` and scontrol is not on PATH: "
                "add Slurm's bin directory to PATH, or drop --requeue")
    return None


class Requeue:
    """One Slurm job's requeue: asked for by a SIGUSR1, done once its save is committed."""

    def __init__(self, job_id: str, grace: float, say: Callable[[str], None]) -> None:
        self.job_id = job_id
        self.grace = grace
        self.say = say
        #: monotonic time of the SIGUSR1 that asked for it (None: not asked yet)
        self.since: float | None = None
        #: the newest committed step when it was asked (None: none; -1: not known)
        self.step_before: int | None = None
        #: scontrol requeue ran (or was given up on): it is not run again
        self.done = False
        #: it succeeded: Slurm starts the job again, not pitstop run
        self.requeued = False
        self._next_read = 0.0

    @property
    def pending(self) -> bool:
        """A SIGUSR1 asked for the requeue and it has not been done yet."""
        return self.since is not None and not self.done

    def asked(self, step_before: int | None) -> None:
        """SIGUSR1 reached the job: requeue once a step newer than ``step_before`` commits."""
        if self.done or self.since is not None:
            return
        self.since = time.monotonic()
        self.step_before = step_before
        limit = " or it exits" if math.isinf(self.grace) else \
            f", it exits, or {self.grace:g} s have passed (--grace)"
        self.say(f"requeuing Slurm job {self.job_id} once the job's save is committed{limit}")

    def poll(self, newest: Callable[[], int | None], unknown: int) -> None:
        """While the job runs: requeue once the save after the signal is committed, or the
        wait has lasted ``--grace`` seconds. ``newest()`` reads the directory's newest step
        (``unknown``: it cannot be read)."""
        if not self.pending:
            return
        now = time.monotonic()
        assert self.since is not None
        if now - self.since >= self.grace:
            self.run(f"no new checkpoint within {self.grace:g} s (--grace) of SIGUSR1")
            return
        if now < self._next_read:
            return
        self._next_read = now + POLL_DIR
        step = newest()
        if step is None or step == unknown:
            return
        if self.step_before is None or (self.step_before != unknown and step > self.step_before):
            self.run(f"step {step} is committed")

    def exited(self, status: str) -> None:
        """The job exited while the requeue waited for its save: requeue it now (a job that
        finished, exit 0, is not requeued)."""
        if self.pending:
            if status == "status 0":
                self.say(f"the job finished (exit status 0): Slurm job {self.job_id} not "
                         "requeued")
                self.since = None
                return
            self.run(f"the job exited ({status})")

    def run(self, why: str) -> None:
        """``scontrol requeue JOB_ID``: said, and its failure said with its stderr."""
        command = ["scontrol", "requeue", self.job_id]
        try:
            done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, errors="replace", timeout=SCONTROL_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.say(f"`{' '.join(command)}` ({why}) did not finish within "
                     f"{SCONTROL_TIMEOUT:g} s: the job is not requeued; requeue it by hand")
            self.done = True  # not tried again: a slow controller may still requeue it
            return
        except OSError as e:
            self.say(f"cannot run `{' '.join(command)}` ({why}): {e.strerror or e}; the job "
                     "is not requeued")
            self.done = True
            return
        self.done = True
        if done.returncode != 0:
            err = " ".join(done.stderr.split())[:500] or "(nothing on stderr)"
            self.say(f"`{' '.join(command)}` ({why}) failed with status {done.returncode}: "
                     f"{err}; the job is not requeued: requeue it by hand or resubmit it")
            return
        self.requeued = True
        self.say(f"{why}: Slurm job {self.job_id} requeued (`{' '.join(command)}`); Slurm "
                 "ends this run and starts it again, and it resumes from the checkpoint "
                 "directory")
