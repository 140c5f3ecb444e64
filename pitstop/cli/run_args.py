"""``pitstop run``'s command line: its options and their defaults, checked, and handed to
the :class:`~pitstop.cli.run.Supervisor` (what a run does is said in :mod:`pitstop.cli.run`)."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

from pitstop.cli.run import PROGRESS_SECONDS, Supervisor, say
from pitstop.cli.run_slurm import Requeue, requeue_problem
from pitstop.core.storage import is_url

DEFAULT_MAX_RESTARTS = 3
DEFAULT_BACKOFF = 1.0
DEFAULT_MAX_BACKOFF = 60.0
DEFAULT_CRASH_LOOP = 3
DEFAULT_GRACE = 30.0
#: exit statuses that are never restarted by default: a usage error, a command that cannot
#: be executed, a command not found (what restarting cannot mend)
DEFAULT_NO_RESTART = "2,126,127"
#: what --preemption names: the notice sources a CheckpointManager in the job can watch
PREEMPTION_SOURCES = ("auto", "gce", "aws", "azure")

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

Preemption: --preemption SOURCES, --preemption-exit and --grace-seconds S are set in the
job's environment (PITSTOP_PREEMPTION, PITSTOP_PREEMPTION_EXIT, PITSTOP_GRACE_SECONDS): the
CheckpointManager in the job watches the cloud's notices and saves before the deadline.
Under Slurm (sbatch --signal=B:USR1@90), --requeue runs `scontrol requeue $SLURM_JOB_ID`
once the job's save on SIGUSR1 is committed (or it exited, or --grace seconds passed), and
the requeued job is left to Slurm, which starts it again; it resumes from its checkpoints.

Exit status: the job's (128+N for signal N): 0 when it finished; that of its last run when
the supervisor gave up (--max-restarts, crash loop, a status of --no-restart-on) or was
stopped by a signal; 126/127 when COMMAND cannot be executed / is not found; 2 for bad
arguments. Messages go to stderr, each starting with "pitstop run:".
"""


EPILOG = """\
example:
  pitstop run --dir runs/exp1 --max-restarts 5 -- python train.py --lr 3e-4
  pitstop run --preemption auto --grace-seconds 60 -- python train.py
  pitstop run --requeue -- python train.py     # in an sbatch --signal=B:USR1@90 script
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
        default=None,
        metavar="S",
        help=f"after forwarding SIGTERM/SIGINT/SIGHUP/SIGQUIT, wait S seconds (default "
        f"{DEFAULT_GRACE:g}, or --grace-seconds where given; inf: as long as it takes) for "
        "the job to save and exit, then SIGKILL it",
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
    _add_preemption_args(s)
    s.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="COMMAND",
        help="the command to run, after --",
    )
    s.set_defaults(func=cmd_run)


def _add_preemption_args(s: Any) -> None:
    """``pitstop run``'s options for preemption notices, Kubernetes and Slurm."""
    s.add_argument(
        "--preemption",
        metavar="SOURCES",
        help="preemption notices the job's CheckpointManager watches, to save before the "
        "machine is taken: auto (detect the cloud it runs on), or some of gce, aws, azure, "
        "separated by commas; off: none; given to the job as PITSTOP_PREEMPTION (default: "
        "$PITSTOP_PREEMPTION as it is)",
    )
    s.add_argument(
        "--preemption-exit",
        action="store_true",
        help="after the save on a preemption notice is durable, the job exits (as on "
        "SIGTERM) instead of training on until the machine is taken; given to the job as "
        "PITSTOP_PREEMPTION_EXIT=1",
    )
    s.add_argument(
        "--grace-seconds",
        type=float,
        metavar="S",
        help="the time a SIGTERM gives the job before it is killed (Kubernetes' "
        "terminationGracePeriodSeconds): the deadline its save must be durable by; given to "
        "the job as PITSTOP_GRACE_SECONDS, and --grace's default",
    )
    s.add_argument(
        "--requeue",
        action="store_true",
        help="Slurm: after SIGUSR1 (sbatch --signal=B:USR1@N) and the job's save on it, run "
        "`scontrol requeue $SLURM_JOB_ID`; the requeued job is not restarted by pitstop run "
        "(Slurm starts it again). Needs SLURM_JOB_ID and scontrol on PATH",
    )


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
    job_env = _preemption_env(args)
    grace = args.grace
    if grace is None:
        given = job_env.get("PITSTOP_GRACE_SECONDS", os.environ.get("PITSTOP_GRACE_SECONDS"))
        try:
            grace = max(float(given), 0.0) if given else DEFAULT_GRACE
        except ValueError:
            grace = DEFAULT_GRACE  # (the job's manager says what is wrong with it)
        if math.isnan(grace):
            grace = DEFAULT_GRACE
    for flag, value in (("--backoff", args.backoff), ("--max-backoff", args.max_backoff),
                        ("--grace", grace)):
        if math.isnan(value) or value < 0:
            raise CliError(f"run: {flag} {value:g}: give a number of seconds, 0 or more")
    if math.isinf(args.backoff) or math.isinf(args.max_backoff):
        raise CliError("run: --backoff and --max-backoff must be finite")
    try:
        no_restart = {int(x) for x in args.no_restart_on.replace(" ", "").split(",") if x}
    except ValueError:
        raise CliError(f"run: --no-restart-on {args.no_restart_on!r}: give exit statuses "
                       "separated by commas, e.g. 2,126,127") from None
    requeue = None
    if args.requeue:
        problem = requeue_problem(os.environ)
        if problem is not None:
            raise CliError(f"run: {problem}")
        requeue = Requeue(os.environ["SLURM_JOB_ID"], grace, say)
    return Supervisor(
        command,
        # absolute: the job may change its working directory before it opens it
        directory=args.dir if args.dir is None or is_url(args.dir) else os.path.abspath(args.dir),
        max_restarts=args.max_restarts,
        backoff=args.backoff,
        max_backoff=max(args.max_backoff, args.backoff),
        crash_loop=args.crash_loop,
        grace=grace,
        no_restart=no_restart,
        forward=args.forward,
        job_env=job_env,
        requeue=requeue,
    ).run()


def _preemption_env(args: argparse.Namespace) -> dict[str, str]:
    """What --preemption, --preemption-exit and --grace-seconds set in the job's environment,
    checked (CliError says what to give instead)."""
    from pitstop.cli.common import CliError

    env: dict[str, str] = {}
    if args.preemption is not None:
        names = [n.strip().lower() for n in args.preemption.split(",") if n.strip()]
        if names in ([], ["off"]):
            env["PITSTOP_PREEMPTION"] = "off"
        else:
            bad = [n for n in names if n not in PREEMPTION_SOURCES]
            if bad:
                raise CliError(f"run: --preemption {args.preemption!r}: not a notice source: "
                               f"{', '.join(bad)}; give auto, or some of gce, aws, azure separated "
                               "by commas (off: none)")
            env["PITSTOP_PREEMPTION"] = ",".join(dict.fromkeys(names))
    if args.preemption_exit:
        env["PITSTOP_PREEMPTION_EXIT"] = "1"
    if args.grace_seconds is not None:
        g = args.grace_seconds
        if math.isnan(g) or math.isinf(g) or g <= 0:
            raise CliError(f"run: --grace-seconds {g:g}: give the seconds a SIGTERM leaves "
                           "before the kill (Kubernetes' terminationGracePeriodSeconds, e.g. "
                           "30), more than 0")
        env["PITSTOP_GRACE_SECONDS"] = f"{g:g}"
    return env
