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
  trains on).

What it knows of the checkpoints comes from the checkpoint directory, read-only (never
locked, never written): ``--dir`` (also given to the job as ``PITSTOP_DIR``), or the one a
CheckpointManager in the job reports through the file named by ``PITSTOP_SUPERVISOR``
(:mod:`pitstop.core.runtime.supervised`), along with the step it restored.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from pitstop.core.runtime import supervised
from pitstop.core.storage import is_url

DEFAULT_MAX_RESTARTS = 3
DEFAULT_BACKOFF = 1.0
DEFAULT_MAX_BACKOFF = 60.0
DEFAULT_CRASH_LOOP = 3
DEFAULT_GRACE = 30.0
#: exit statuses that are never restarted by default: a usage error, a command that cannot
#: be executed, a command not found (what restarting cannot mend)
DEFAULT_NO_RESTART = "2,126,127"
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

DESCRIPTION = """\
Start COMMAND in its own process group and restart it when it dies abnormally (a
non-zero exit status, or a signal such as the OOM killer's SIGKILL or a segfault; not
SIGTERM, SIGINT, SIGHUP or SIGPIPE sent to it directly: a job stopped on purpose), after a
back-off, until it exits 0. A job that calls CheckpointManager.restore() resumes from its
newest committed checkpoint at each restart; pitstop run says which step.

The checkpoint directory (to report steps and to see progress) is --dir, also given to
the job as PITSTOP_DIR, or the one a CheckpointManager in the job opens (reported to the
supervisor through the file PITSTOP_SUPERVISOR names). PITSTOP_RESTART is 0 in the first
run, 1 in the first restart, ...

SIGTERM, SIGINT, SIGHUP and SIGQUIT are forwarded to the job's first process, and to the
rest of its processes once that has exited (--forward group: to all at once); pitstop
saves and exits on SIGTERM and SIGINT, and the job is not restarted; a second one, or
--grace seconds, SIGKILLs it. SIGUSR1/SIGUSR2 go to the job's first process only (pitstop
saves on SIGUSR1 and trains on) and supervision goes on. Ctrl+Z stops the job too.

Exit status: the job's (128+N for signal N): 0 when it finished; that of its last run when
the supervisor gave up (--max-restarts, crash loop, a status of --no-restart-on) or was
stopped by a signal; 126/127 when COMMAND cannot be executed / is not found; 2 for bad
arguments. Messages go to stderr, each starting with "pitstop run:".
"""

EPILOG = """\
example:
  pitstop run --dir runs/exp1 --max-restarts 5 -- python train.py --lr 3e-4
"""


def add_parser(sub: Any) -> None:
    """Register ``pitstop run`` with the ``pitstop`` command's subparsers."""
    s = sub.add_parser(
        "run",
        help="run a training command and restart it when it dies (back-off, crash-loop "
        "detection, signals forwarded so it saves)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="pitstop run [options] -- COMMAND [ARG ...]",
    )
    s.add_argument(
        "--dir",
        metavar="DIR",
        default=os.environ.get("PITSTOP_DIR") or None,
        help="the job's checkpoint directory (or URL), read-only, to report steps and see "
        "progress; given to the job as PITSTOP_DIR (default: $PITSTOP_DIR, else the "
        "directory a CheckpointManager in the job opens)",
    )
    s.add_argument(
        "--max-restarts",
        type=int,
        default=DEFAULT_MAX_RESTARTS,
        metavar="N",
        help=f"restart the job at most N times in all (default {DEFAULT_MAX_RESTARTS}; "
        "-1: no limit, only the crash-loop rule stops it)",
    )
    s.add_argument(
        "--backoff",
        type=float,
        default=DEFAULT_BACKOFF,
        metavar="S",
        help=f"seconds to wait before the first restart (default {DEFAULT_BACKOFF:g}); "
        "doubled after each failure, back to S after a run that committed a new checkpoint",
    )
    s.add_argument(
        "--max-backoff",
        type=float,
        default=DEFAULT_MAX_BACKOFF,
        metavar="S",
        help=f"the longest wait between restarts (default {DEFAULT_MAX_BACKOFF:g})",
    )
    s.add_argument(
        "--crash-loop",
        type=int,
        default=DEFAULT_CRASH_LOOP,
        metavar="N",
        help=f"stop after N failures in a row without a new committed checkpoint (default "
        f"{DEFAULT_CRASH_LOOP}; 0: never); without a known directory, a run of "
        f"{PROGRESS_SECONDS / 60:g} minutes or more counts as progress",
    )
    s.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_GRACE,
        metavar="S",
        help=f"after forwarding SIGTERM/SIGINT/SIGHUP/SIGQUIT, wait S seconds (default "
        f"{DEFAULT_GRACE:g}; inf: as long as it takes) for the job to save and exit, then "
        "SIGKILL it",
    )
    s.add_argument(
        "--forward",
        choices=("first", "group"),
        default="first",
        help="where SIGTERM/SIGINT/SIGHUP/SIGQUIT go: first (default): the job's first "
        "process, then the rest of its process group once that has exited; group: every "
        "process of the job at once, as Ctrl+C at a terminal (torch's DataLoader workers "
        "die of SIGTERM, and the training then fails before it saves)",
    )
    s.add_argument(
        "--no-restart-on",
        default=DEFAULT_NO_RESTART,
        metavar="STATUS,...",
        help=f"exit statuses that are not restarted (default {DEFAULT_NO_RESTART}: a usage "
        "error, cannot execute, command not found; '' restarts them too)",
    )
    s.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="COMMAND",
        help="the command to run, after --",
    )
    s.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    """``pitstop run``: supervise ``args.command``; returns the exit status."""
    from pitstop.cli.common import CliError

    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise CliError("run: no command given; put it after --, e.g. "
                       "pitstop run -- python train.py")
    if command[0].startswith("-") and args.command[:1] != ["--"]:
        raise CliError(f"run: unknown option {command[0]}; put the command after --, e.g. "
                       "pitstop run --max-restarts 5 -- python train.py")
    if args.max_restarts < -1:
        raise CliError(f"run: --max-restarts {args.max_restarts}: give 0 or more (-1: no limit)")
    if args.crash_loop < 0:
        raise CliError(f"run: --crash-loop {args.crash_loop}: give 1 or more (0: never stop "
                       "for a crash loop)")
    for flag, value in (("--backoff", args.backoff), ("--max-backoff", args.max_backoff),
                        ("--grace", args.grace)):
        if math.isnan(value) or value < 0:
            raise CliError(f"run: {flag} {value:g}: give a number of seconds, 0 or more")
    if math.isinf(args.backoff) or math.isinf(args.max_backoff):
        raise CliError("run: --backoff and --max-backoff must be finite")
    try:
        no_restart = {int(x) for x in args.no_restart_on.replace(" ", "").split(",") if x}
    except ValueError:
        raise CliError(f"run: --no-restart-on {args.no_restart_on!r}: give exit statuses "
                       "separated by commas, e.g. 2,126,127") from None
    return Supervisor(
        command,
        # absolute: the job may change its working directory before it opens it
        directory=args.dir if args.dir is None or is_url(args.dir) else os.path.abspath(args.dir),
        max_restarts=args.max_restarts,
        backoff=args.backoff,
        max_backoff=max(args.max_backoff, args.backoff),
        crash_loop=args.crash_loop,
        grace=args.grace,
        no_restart=no_restart,
        forward=args.forward,
    ).run()


# ====================================================================== helpers
def say(message: str) -> None:
    """One line of the supervisor's on stderr."""
    with contextlib.suppress(OSError, ValueError):
        print(f"pitstop run: {message}", file=sys.stderr, flush=True)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe(returncode: int, *, killed: bool = False) -> str:
    """``status 1`` / ``signal SIGKILL``: how a run ended, as Popen's returncode says
    (``killed``: the supervisor sent the SIGKILL)."""
    if returncode < 0:
        name = signal_name(-returncode)
        hint = " (kill -9, a scheduler, or the out-of-memory killer: see dmesg)" \
            if -returncode == signal.SIGKILL and not killed else ""
        return f"signal {name}{hint}"
    return f"status {returncode}"


def exit_status(returncode: int) -> int:
    """The shell's exit status of a run: 128+N for signal N."""
    return 128 - returncode if returncode < 0 else returncode


def seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"


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


def group_members(pgid: int) -> list[int] | None:
    """The live (not zombie) processes of process group ``pgid`` (Linux: from /proc), or
    None where /proc cannot tell."""
    members: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue  # gone meanwhile
        fields = raw[raw.rfind(b")") + 2:].split()
        if len(fields) > 2 and fields[0] != b"Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def _group_alive(pgid: int) -> bool:
    members = group_members(pgid)
    if members is not None:
        return bool(members)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _death_signal() -> Callable[[], None] | None:
    """A preexec function that has the kernel send SIGTERM to the job when the supervisor
    dies (PR_SET_PDEATHSIG: Linux), so a SIGKILLed supervisor leaves no job running on;
    None where that is not available."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def setup() -> None:
        prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the supervisor died before prctl: no signal will come
            os.kill(os.getpid(), signal.SIGTERM)

    return setup


class Events:
    """The JSON lines CheckpointManagers in the job append (:mod:`pitstop.core.runtime.supervised`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        out = []
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                out.append(event)
        return out


# ====================================================================== the supervisor
class Supervisor:
    """Runs ``command`` until it finishes, restarting it as the options say."""

    def __init__(self, command: list[str], *, directory: str | None, max_restarts: int,
                 backoff: float, max_backoff: float, crash_loop: int, grace: float,
                 no_restart: set[int], forward: str = "first") -> None:
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
                say(f"{how}; {newest}; someone stopped it on purpose (not through pitstop "
                    "run): not restarting it")
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
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pgid, signum)  # the leader's pid is the group's id
                say(f"{name} forwarded to the job's first process ({pgid})")
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
