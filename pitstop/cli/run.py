"""``pitstop run``: a supervisor that restarts a training job until it finishes.

It starts the command in its own session and process group (stdin/stdout/stderr inherited)
and waits for it:

- exit 0: done, the supervisor exits 0;
- died abnormally (a non-zero status, a signal the supervisor did not send: the OOM
  killer's SIGKILL, a segfault; but not SIGTERM, SIGINT, SIGHUP or SIGPIPE, which stop a
  job on purpose, as systemd's ``Restart=on-failure`` counts them): restarted after a
  back-off that doubles after each failure (capped) and starts again from ``--backoff``
  after a run that committed a new checkpoint, at most ``--max-restarts`` times;
  ``--crash-loop`` failures in a row without a new committed step stop it early;
- SIGTERM / SIGINT / SIGHUP / SIGQUIT to the supervisor: forwarded (SIGHUP, a terminal that
  hung up, as SIGTERM, on which pitstop saves) to the job's first
  process, and to the rest of its process group (DataLoader workers, children) once that
  has exited (``--forward group``: to all at once), so pitstop's handler in the job saves
  before it exits; never restarted after that; ``--grace`` seconds later (or at a second
  such signal) the group is SIGKILLed. SIGUSR1 / SIGUSR2 are forwarded to the
  job's first process only, and the supervision goes on (pitstop saves on SIGUSR1 and
  trains on). With ``--requeue`` (Slurm), a SIGUSR1 then requeues the job once its save
  is committed (:mod:`pitstop.cli.run_slurm`), and a requeued job is left to Slurm: never
  restarted by the supervisor.

``--preemption``, ``--preemption-exit`` and ``--grace-seconds`` reach the job as
``PITSTOP_PREEMPTION``, ``PITSTOP_PREEMPTION_EXIT`` and ``PITSTOP_GRACE_SECONDS``: the
CheckpointManager in the job watches for the notices, not the supervisor.

What it knows of the checkpoints comes from the checkpoint directory, read-only (never
locked, never written): ``--dir`` (also given to the job as ``PITSTOP_DIR``), or the one a
CheckpointManager in the job reports through the file named by ``PITSTOP_SUPERVISOR``
(:mod:`pitstop.core.runtime.supervised`), along with the step it restored.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from pitstop.cli.run_job import (
    Events,
    _death_signal,
    _group_alive,
    describe,
    exit_status,
    group_members,
    seconds,
    signal_name,
)
from pitstop.cli.run_slurm import Requeue
from pitstop.core.runtime import supervised
from pitstop.core.storage import is_url

#: without a known checkpoint directory, a run this long counts as having made progress
PROGRESS_SECONDS = 600.0
#: how long the processes of a job whose leader exited may take to exit on their own
LEFTOVER_WAIT = 1.0
#: how often the supervisor looks at the job, its signals and its reports while it runs
POLL = 0.05
#: how long the supervisor waits for a read of the checkpoint directory, which only informs
#: it: a stalled object store must not hold up the job's start (then: "not known")
READ_TIMEOUT = 10.0

#: received by the supervisor: forwarded to the job's group, and the job is not restarted
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
#: a job that died of one of these, sent by someone else (Slurm and Kubernetes signal every
#: process, ``kill PID``), was stopped on purpose: not restarted (systemd's rule too)
CLEAN_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE)
#: received by the supervisor: forwarded, and the supervision goes on
PASS_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


# ====================================================================== helpers
def say(message: str) -> None:
    """One line of the supervisor's on stderr, in one write: the job shares the stream, and
    ``print`` writes the text and its newline apart (the job's line then lands between)."""
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"pitstop run: {message}\n")
        sys.stderr.flush()


#: what :func:`newest_step` answers for a directory it cannot read
UNKNOWN = -1


def newest_step(directory: str | None) -> int | None:
    """The newest committed step of ``directory``: None where it has none (or does not exist
    yet), UNKNOWN where it cannot be read (no directory known, an object store without
    credentials here). Read as ``pitstop ls`` reads it: no lock taken, nothing written."""
    if directory is None:
        return UNKNOWN
    try:
        from pitstop.cli.common import _open, _scan

        if not is_url(directory) and not os.path.lexists(directory):
            return None  # the job has not made it yet
        steps = _scan(_open(directory)).steps
        return steps[-1] if steps else None
    except Exception:  # noqa: BLE001 - an unreadable directory only means "not known"
        return UNKNOWN


def _same_dir(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except (OSError, ValueError):
        return False


# ====================================================================== the supervisor
class Supervisor:
    """Runs ``command`` until it finishes, restarting it as the options say."""

    def __init__(self, command: list[str], *, directory: str | None, max_restarts: int,
                 backoff: float, max_backoff: float, crash_loop: int, grace: float,
                 no_restart: set[int], forward: str = "first",
                 job_env: dict[str, str] | None = None, requeue: Requeue | None = None) -> None:
        self.command = command
        self.given_dir = directory
        #: the directory steps are read from: --dir, or the one the job reports
        self.directory = directory
        self.max_restarts = max_restarts
        self.initial_backoff = backoff
        self.max_backoff = max_backoff
        self.crash_loop = crash_loop
        self.grace = grace
        self.no_restart = no_restart
        self.forward = forward
        #: set in the job's environment (the preemption options)
        self.job_env = dict(job_env or {})
        #: ``--requeue``: the Slurm job's requeue after a SIGUSR1
        self.requeue = requeue
        #: signals received, not yet acted on (the handler only notes them)
        self.received: list[int] = []
        #: the stop signal forwarded to the job: it is not restarted
        self.stopping: int | None = None
        #: the stop signal went to the whole group (not only to the job's first process)
        self.forwarded_rest = False
        self.stop_deadline = math.inf
        self.killed = False
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        #: the newest committed step before the current run (None: none or not known)
        self.before: int | None = None
        self.reported_restore = False
        #: the current run's newest restore through a read-only manager (see _read_events)
        self.read_only_restore: dict[str, Any] | None = None
        #: a manager in the current run found the directory locked by another writer
        self.locked_out = False
        self.noted_other_dir = False
        #: a directory the job opened that is not --dir; whether it opened --dir too
        self.other_dir: str | None = None
        self.opened_given = False
        self.events: Events | None = None
        #: a read of the directory that did not answer within READ_TIMEOUT (still running)
        self.stalled_read: threading.Thread | None = None

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        previous = {}
        for signum in (*STOP_SIGNALS, *PASS_SIGNALS, signal.SIGTSTP):
            with contextlib.suppress(OSError, ValueError):
                if signal.getsignal(signum) is signal.SIG_IGN:
                    continue  # ignored where it was started (nohup, `&`): so for the job too
                previous[signum] = signal.signal(signum, self._on_signal)
        private = tempfile.mkdtemp(prefix="pitstop-run-")
        try:
            events = os.path.join(private, "events.jsonl")
            with open(events, "wb"):
                pass
            self.events = Events(events)
            return self._supervise(events)
        finally:
            shutil.rmtree(private, ignore_errors=True)
            for signum, handler in previous.items():
                with contextlib.suppress(OSError, ValueError, TypeError):
                    signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.received.append(signum)

    def _supervise(self, events: str) -> int:
        failures = 0  # in a row, without a new committed step
        backoff = self.initial_backoff
        while True:
            self.before = self._newest(self.directory)
            self.reported_restore = False
            self.read_only_restore = None
            self.locked_out = False
            started = time.monotonic()
            try:
                self.proc = self._start(events)
            except OSError as e:
                return self._cannot_start(e)
            returncode = self._wait(self.proc)
            elapsed = time.monotonic() - started
            # a stop signal that came with the job's end (Slurm signals every process) still
            # means: do not restart; it goes on to what is left of the job's group
            self._act_on_signals(self.proc.pid)
            self._read_events()
            self._note_other_dir()
            self._clean_up_group(self.proc.pid)
            if self.requeue is not None:
                self.requeue.exited(describe(returncode, killed=self.killed))
                if self.requeue.requeued and self.stopping is None and returncode != 0:
                    say(f"job exited with {describe(returncode, killed=self.killed)}; Slurm "
                        f"job {self.requeue.job_id} is requeued: not restarting it (Slurm "
                        "starts it again)")
                    return exit_status(returncode)
            if self.stopping is not None:
                say(f"job exited with {describe(returncode, killed=self.killed)} after "
                    f"{signal_name(self.stopping)}; not restarting it")
                return exit_status(returncode)
            if returncode == 0:
                if self.restarts:
                    say(f"job finished (exit status 0) after {self.restarts} "
                        f"restart{'s' if self.restarts > 1 else ''}")
                return 0
            status = exit_status(returncode)
            after = self._newest(self.directory)
            newest = self._newest_text(after)
            how = f"job exited with {describe(returncode)} after {seconds(elapsed)}"
            if -returncode in CLEAN_SIGNALS:
                who = ("the job's own exit after a preemption notice (--preemption-exit), or "
                       "someone stopped it" if self.job_env.get("PITSTOP_PREEMPTION_EXIT")
                       else "someone stopped it on purpose (not through pitstop run)")
                say(f"{how}; {newest}; {who}: not restarting it")
                return status
            if returncode > 0 and returncode in self.no_restart:
                why = {2: "a usage error", 126: "cannot execute",
                       127: "command not found"}.get(returncode, "")
                say(f"{how}; {newest}; status {returncode}{' (' + why + ')' if why else ''} "
                    "is one of --no-restart-on: not restarting it")
                return status
            if self.locked_out:  # the new steps there are another writer's
                progress = False
            elif UNKNOWN not in (self.before, after):
                progress = after is not None and (self.before is None or after > self.before)
            else:  # no directory known, or it cannot be read here
                progress = elapsed >= PROGRESS_SECONDS
            failures = 0 if progress else failures + 1
            if self.crash_loop and failures >= self.crash_loop:
                since = ("without a new checkpoint" if UNKNOWN not in (self.before, after) else
                         f"each within {PROGRESS_SECONDS / 60:g} minutes of its start "
                         "(no readable checkpoint directory known)")
                say(f"crash loop: {failures} failure{'' if failures == 1 else 's'} in a row "
                    f"{since}; last exit: {describe(returncode)}; {newest}; look at the job's "
                    "output above")
                return status
            if 0 <= self.max_restarts <= self.restarts:
                say(f"{how}; {newest}; giving up after {self.restarts} "
                    f"restart{'' if self.restarts == 1 else 's'} (--max-restarts "
                    f"{self.max_restarts})")
                return status
            if progress:
                backoff = self.initial_backoff
            delay, backoff = backoff, min(backoff * 2, self.max_backoff)
            self.restarts += 1
            limit = "" if self.max_restarts < 0 else f" of {self.max_restarts}"
            say(f"{how}; {newest}; restarting in {delay:.1f} s (restart "
                f"{self.restarts}{limit})")
            stop = self._sleep(delay)
            if stop is not None:
                say(f"{signal_name(stop)} received while waiting to restart the job; "
                    "not restarting it")
                return 128 + stop

    def _newest(self, directory: str | None) -> int | None:
        """:func:`newest_step`, given up on after READ_TIMEOUT seconds (UNKNOWN), and not
        asked again while a read that stalled is still under way."""
        if directory is None:
            return UNKNOWN
        if self.stalled_read is not None:
            if self.stalled_read.is_alive():
                return UNKNOWN
            self.stalled_read = None
        got: list[int | None] = []
        reader = threading.Thread(target=lambda: got.append(newest_step(directory)),
                                  name="pitstop-run-read", daemon=True)
        reader.start()
        reader.join(READ_TIMEOUT)
        if reader.is_alive():
            self.stalled_read = reader
            return UNKNOWN
        return got[0] if got else UNKNOWN

    def _newest_text(self, step: int | None) -> str:
        if self.directory is None:
            return "newest checkpoint: not known (no --dir, none reported by the job)"
        if step == UNKNOWN:
            why = f": no answer within {READ_TIMEOUT:g} s" if self.stalled_read else ""
            return f"newest checkpoint: not known ({self.directory} cannot be read here{why})"
        return f"newest checkpoint: step {step}" if step is not None else \
            "no committed checkpoint yet"

    def _start(self, events: str) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        env[supervised.ENV] = events
        env["PITSTOP_RESTART"] = str(self.restarts)
        if self.given_dir is not None:
            env["PITSTOP_DIR"] = self.given_dir
        env.update(self.job_env)
        return subprocess.Popen(self.command, env=env, start_new_session=True,
                                preexec_fn=_death_signal())

    def _cannot_start(self, e: OSError) -> int:
        status = 127 if isinstance(e, FileNotFoundError) else 126
        reason = "no such file or command (check the name and PATH)" if status == 127 else \
            (e.strerror or str(e))
        say(f"cannot start {self.command[0]}: {reason}")
        return status

    # ------------------------------------------------------------------ while it runs
    def _wait(self, proc: subprocess.Popen[bytes]) -> int:
        while True:
            try:
                return proc.wait(timeout=POLL)
            except subprocess.TimeoutExpired:
                pass
            self._act_on_signals(proc.pid)
            if self.stopping is not None and not self.killed and \
                    time.monotonic() >= self.stop_deadline:
                self._kill(proc.pid, f"the job did not exit within --grace {self.grace:g} s "
                           f"of {signal_name(self.stopping)}")
            self._read_events()
            if self.requeue is not None:
                self.requeue.poll(lambda: self._newest(self.directory), UNKNOWN)

    def _act_on_signals(self, pgid: int | None) -> None:
        while self.received:
            signum = self.received.pop(0)
            name = signal_name(signum)
            if signum == signal.SIGTSTP:
                self._suspend(pgid)
            elif pgid is None:
                if signum in PASS_SIGNALS:
                    say(f"{name} ignored: no job is running (waiting to restart it)")
            elif signum in PASS_SIGNALS:
                # to the job's first process only: its other processes (DataLoader workers)
                # have no use for a "checkpoint now" and die of SIGUSR1's default action
                if self.proc is None or self.proc.returncode is not None:
                    say(f"{name} ignored: the job has exited")
                    continue  # (its pid may be another process's now)
                # the newest step before the job can save on it: the requeue waits for a newer
                before = self._newest(self.directory) \
                    if signum == signal.SIGUSR1 and self.requeue is not None else None
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pgid, signum)  # the leader's pid is the group's id
                say(f"{name} forwarded to the job's first process ({pgid})")
                if signum == signal.SIGUSR1 and self.requeue is not None:
                    self.requeue.asked(before)
            elif self.stopping is None:
                if signum == signal.SIGHUP:
                    # the terminal hung up (an SSH session dropped): the job has no terminal
                    # of its own and pitstop saves on SIGTERM, so it gets SIGTERM
                    signum, name = signal.SIGTERM, "SIGHUP (the terminal hung up), as SIGTERM,"
                self.stopping = signum
                self.stop_deadline = time.monotonic() + self.grace
                wait = ("" if math.isinf(self.grace) else f"up to {self.grace:g} s ") + \
                    "for it to save and exit (again to kill it)"
                leader_alive = self.proc is not None and self.proc.returncode is None
                if self.forward == "group" or not leader_alive:
                    self._forward(pgid, signum)
                    self.forwarded_rest = True
                    say(f"{name} forwarded to the job's processes; waiting {wait}")
                else:
                    # the first process saves and stops its own workers; they get the signal
                    # once it has exited (torch's DataLoader workers die of SIGTERM, and the
                    # main process then fails before its save)
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pgid, signum)
                    say(f"{name} forwarded to the job ({pgid}; its other processes once it "
                        f"has exited); waiting {wait}")
            elif not self.killed:
                self._kill(pgid, f"{name} received again")

    def _forward(self, pgid: int, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signum)

    def _kill(self, pgid: int, why: str) -> None:
        self.killed = True
        say(f"{why}: killing it (SIGKILL to all its processes)")
        self._forward(pgid, signal.SIGKILL)

    def _suspend(self, pgid: int | None) -> None:
        """Ctrl+Z: stop the job's group (SIGSTOP: its group has no terminal, SIGTSTP would
        be discarded), then the supervisor itself; ``fg`` continues both."""
        if pgid is not None:
            self._forward(pgid, signal.SIGSTOP)
        say("stopped, and the job with it (fg continues both)")
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        try:
            os.kill(os.getpid(), signal.SIGTSTP)
        finally:
            signal.signal(signal.SIGTSTP, self._on_signal)
        if pgid is not None:
            self._forward(pgid, signal.SIGCONT)

    def _sleep(self, delay: float) -> int | None:
        """Wait ``delay`` seconds before a restart; a stop signal ends the wait (returned)."""
        end = time.monotonic() + delay
        while True:
            for signum in list(self.received):
                if signum in STOP_SIGNALS:
                    self.received.clear()
                    return signum
            self._act_on_signals(None)
            left = end - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(POLL, left))

    def _clean_up_group(self, pgid: int) -> None:
        """The job's leader is gone: its other processes (workers, children) get what is
        left of the grace period after a stop signal, then SIGKILL; they would hold the
        directory's lock and the accelerator in a restart."""
        # after a stop signal, the rest of --grace to save and exit; else a moment to finish
        # exiting (workers the leader was just stopping)
        deadline = self.stop_deadline if self.stopping is not None else \
            time.monotonic() + LEFTOVER_WAIT
        if self.stopping is not None and not self.forwarded_rest and not self.killed and \
                _group_alive(pgid):
            self.forwarded_rest = True
            self._forward(pgid, self.stopping)  # now to the rest (the first one has exited)
        while not self.killed and _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(POLL)
            self._act_on_signals(pgid)
        members = group_members(pgid)
        if members == [] or not _group_alive(pgid):
            return
        shown = f" ({', '.join(map(str, members[:5]))}{', ...' if len(members) > 5 else ''})" \
            if members else ""
        say(f"the job's leader exited; killing its remaining processes{shown}")
        self._forward(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(POLL)

    # ------------------------------------------------------------------ the job's reports
    def _read_events(self) -> None:
        if self.events is None:
            return
        for event in self.events.read():
            if event.get("rank", 0) != 0:
                continue
            where = event.get("dir")
            if event.get("read_only"):
                # a read-only restore is the job's resume when the job then writes to that
                # directory: tf.train's ``Checkpoint.restore(latest_checkpoint(d))`` before
                # its CheckpointManager(d) reads through a reader of its own
                if event.get("event") == "restore" and isinstance(where, str):
                    self.read_only_restore = event
                continue
            if event.get("event") == "open" and isinstance(where, str):
                self._opened(where)
                held = self.read_only_restore
                if held is not None and isinstance(held.get("dir"), str) and \
                        _same_dir(held["dir"], where):
                    self._restored(held)
            elif event.get("event") == "locked_out" and isinstance(where, str) and \
                    (self.directory is None or _same_dir(where, self.directory)):
                self.locked_out = True
            elif event.get("event") == "restore":
                self._restored(event)

    def _restored(self, event: dict[str, Any]) -> None:
        """The job restored a step (or found none): said once a run, for the run's directory
        only (not another manager's, an EMA copy's)."""
        where = event.get("dir")
        if self.reported_restore or self.directory is None or not isinstance(where, str) \
                or not _same_dir(where, self.directory):
            return
        self.reported_restore = True
        step = event.get("step")
        if isinstance(step, int) and self.before != UNKNOWN:
            # the run goes on from there: a step after it is progress, also one
            # below the newest seen before the run (found corrupt, moved aside)
            self.before = step
        if self.restarts:
            say(f"restart {self.restarts} resumed from step {step}" if step is not None
                else f"restart {self.restarts} started from scratch (nothing to "
                "resume from)")
        elif step is not None:
            say(f"job resumed from step {step}")

    def _opened(self, where: str) -> None:
        if self.directory is None:
            self.directory = where
            self.before = self._newest(where)
        elif _same_dir(where, self.directory):
            self.opened_given = True
        elif self.given_dir is not None and self.other_dir is None:
            self.other_dir = where  # said once the run ended, if it never opened --dir

    def _note_other_dir(self) -> None:
        if self.other_dir is not None and not self.opened_given and not self.noted_other_dir:
            self.noted_other_dir = True
            say(f"the job writes its checkpoints to {self.other_dir}, not --dir "
                f"{self.directory}; reporting on --dir")
