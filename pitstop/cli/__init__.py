"""The ``pitstop`` command: supervise training jobs; look at, check, compare, convert and
tidy checkpoint directories.

    pitstop run [--dir DIR] -- CMD...    run a training command, restart it when it dies
                                         (back-off, crash-loop stop), forward signals

    pitstop ls DIR                       every checkpoint: time, size, metrics, and its status
                                         (what retention keeps and why; incomplete, corrupt,
                                         abandoned, unreadable); the newest marked
    pitstop inspect DIR [--step N]       one checkpoint's manifest: who wrote it (frameworks
                                         and versions), arrays, values, metrics
    pitstop verify DIR [--step N|--all]  read every array and check its hash (a progress bar
                                         on stderr when it is a terminal)
    pitstop gc DIR                       remove leftovers of interrupted saves
    pitstop diff A B                     which arrays and values differ, and by how much
    pitstop export CKPT --to FORMAT      as .npz, .safetensors, a torch.save file or Orbax
    pitstop import SRC DEST              torch.save, DCP, TensorFlow, Orbax, safetensors, npz
    pitstop demo [--framework F]         train, kill -9, restart under `pitstop run`, compare

Every command that reads one checkpoint takes the run directory (its newest, or ``--step N``)
or the checkpoint's own path (``runs/exp1/step_0000000300``).

DIR is a local directory or an object-store URL (``s3://bucket/prefix``, ``memory://...``,
any fsspec URL): credentials and the endpoint come from the standard AWS environment and
files (``AWS_ENDPOINT_URL`` ...), and ``-o KEY=VALUE`` passes storage options (e.g.
``-o endpoint_url=http://127.0.0.1:9000``, ``-o anon=true``); see docs/storage.md.

Every subcommand's ``--help`` ends with an example, and a bad argument is one line
(``pitstop inspect: --step: invalid int value: 'x'; see `pitstop inspect --help```), exit
status 2: subcommands added with ``sub.add_parser`` get both rules from
:class:`ArgumentParser` (the test walks every subparser).

``ls``, ``inspect`` and ``verify`` open the directory read-only (no lock, nothing written),
so they work while a trainer is writing to it. Exit status: 0 fine, 1 a checkpoint failed
verification, 2 anything else that went wrong (bad arguments, no such directory or step,
directory busy or read-only). A failure is one line ``pitstop: ...`` on stderr that names
the path and what to do; the command never prints a traceback.

Each command is a module: ``ls``, ``inspect``, ``verify`` and ``gc`` in
:mod:`pitstop.cli.commands`, ``run``, ``diff``, ``demo``, ``export``/``import`` beside this one;
what they share is :mod:`pitstop.cli.common`. The rules they show (names, retention, the
memory tier's files, the directory's records) are core's, called, never restated.

Names are those of :mod:`pitstop.core.directory.names`, by the naming the directory records in
``.pitstop/directory.json``: a checkpoint is ``step_<10 digits>`` by default (``ckpt-<step>``,
``<step>``, ... where the directory was created with another ``step_prefix`` / ``step_digits``);
one moved aside is ``<name>.corrupt-<time>-<4 hex>`` or ``<name>.abandoned-<time>-<4 hex>``;
anything else (``step_5`` included) is not pitstop's, is listed as such and is never touched.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from pitstop.cli.common import (
    CORRUPT,
    ERROR,
    ArgumentParser,
    CliError,
    _one_line,
    _why,
    human_size,
)
from pitstop.core.errors import CheckpointError, CorruptCheckpointError

#: the status of a command whose reader closed the pipe (128 + SIGPIPE, as a shell reports it)
BROKEN_PIPE = 141


def _tolerant_streams() -> None:
    """Print names that are not valid text (a non-UTF-8 file name) escaped, never crash."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="pitstop",
        description="Supervise training jobs; look at, check, compare, convert and tidy pitstop\n"
        "checkpoint directories.",
        epilog="Exit status: 0 fine, 1 a checkpoint failed verification (diff: the checkpoints\n"
        "differ), 2 other errors; `pitstop run` exits with its job's status.\n\n"
        "example:\n  pitstop ls runs/exp1\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from pitstop._version import __version__

    p.add_argument("--version", action="version", version=f"pitstop {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True,
                           parser_class=ArgumentParser)

    from pitstop.cli.commands import gc, inspect, ls, verify

    for command in (ls, inspect, verify, gc):
        command.add_parser(sub)
    from pitstop.cli import demo

    demo.add_parser(sub)
    _ensure_example(sub.choices["demo"], "pitstop demo")
    from pitstop.cli import convert, diff  # pitstop diff, export, import
    from pitstop.cli import run_args as _run

    _run.add_parser(sub)
    diff.add_parser(sub)
    convert.add_parsers(sub)
    return p


def _ensure_example(parser: argparse.ArgumentParser, line: str) -> None:
    """Give a subcommand that its module left without one the closing example."""
    if "example:" not in (parser.epilog or ""):
        parser.epilog = ((parser.epilog or "").rstrip("\n") + "\n\n" if parser.epilog
                         else "") + f"example:\n  {line}\n"
        parser.formatter_class = argparse.RawDescriptionHelpFormatter


def parser_of(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The parser of the subcommand ``argv`` names (its first word that is one), else
    ``parser``: found from the words, as a subcommand may reuse the dest ``command``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for word in argv:
                if not word.startswith("-"):
                    return action.choices.get(word, parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pitstop`` console script; returns the exit status."""
    _tolerant_streams()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the subcommand's parser: `pitstop ls: unrecognized arguments: b`
        parser_of(parser, sys.argv[1:] if argv is None else argv).error(
            f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args))
    except CliError as e:
        print(f"pitstop: {_one_line(e)}", file=sys.stderr)
        return e.code
    except CorruptCheckpointError as e:
        print(f"pitstop: {_one_line(e)}", file=sys.stderr)
        return CORRUPT
    except CheckpointError as e:
        print(f"pitstop: {_one_line(e)}", file=sys.stderr)
        return ERROR
    except BrokenPipeError:  # `pitstop verify DIR | head -1`: the reader went away
        # the output, and with it the verdict, was cut short: not 0 (a failed verification
        # would read as success), but what a shell reports for a command SIGPIPE killed;
        # stdout goes to /dev/null so that the exit's flush does not fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return BROKEN_PIPE
    except KeyboardInterrupt:
        return 130
    except OSError as e:  # a path the commands above did not expect to fail
        print(f"pitstop: {_one_line(_why(e))}", file=sys.stderr)
        return ERROR
    except Exception as e:  # noqa: BLE001 - the last resort: never a traceback
        if os.environ.get("PITSTOP_DEBUG"):
            raise
        print(
            f"pitstop: internal error ({_one_line(_why(e))}); this is a bug in pitstop: "
            "please report it with the output of the same command run with PITSTOP_DEBUG=1",
            file=sys.stderr,
        )
        return ERROR


__all__ = ["main", "build_parser", "human_size"]
