"""``pitstop verify DIR [--step N|--all]``: read every array of a checkpoint and check its
hash (a progress bar on stderr when it is a terminal); exit 1 when one fails."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Any

from pitstop.cli.common import (
    CORRUPT,
    ERROR,
    OK,
    CliError,
    _bound,
    _encryption,
    _example,
    _failure,
    _gone,
    _lease,
    _locate,
    _no_checkpoint,
    _one_line,
    _pick_live,
    _scan,
    _shown,
    _url_options,
    human_size,
)
from pitstop.core.errors import CorruptCheckpointError
from pitstop.core.restore.read import CheckpointReader
from pitstop.core.storage import FsspecStorage


def add_parser(sub: Any) -> None:
    s = sub.add_parser(
        "verify", help="read every array and check its hash (newest by default)",
        description="Read every array of a checkpoint and check its hash; a progress bar "
        "on stderr when it is a terminal.",
        **_example("pitstop verify runs/exp1 --all"))
    s.add_argument("dir", metavar="DIR")
    _url_options(s)
    g = s.add_mutually_exclusive_group()
    g.add_argument("--step", type=int, help="verify this step")
    g.add_argument("--all", action="store_true", help="verify every committed checkpoint")
    s.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None,
        help="show a progress bar on stderr (default: only when stderr is a terminal)")
    s.set_defaults(func=cmd_verify)


def _wants_progress(asked: bool | None) -> bool:
    """--progress / --no-progress, else whether stderr is a terminal (never a pipe or a
    CI log)."""
    if asked is not None:
        return asked
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError, OSError):
        return False


@contextlib.contextmanager
def _progress_bar(show: bool, label: str) -> Iterator[Any]:
    """A progress bar of bytes read on stderr (rich), cleared when done; yields the
    ``progress(done, total)`` callback, or None without a bar (not asked, or no rich)."""
    if not show:
        yield None
        return
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )
    except ImportError:  # (the `cli` extra not installed): no bar, the check runs all the same
        yield None
        return
    console = Console(file=sys.stderr, force_terminal=True)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                   DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                   console=console, transient=True)
    task = bar.add_task(label, total=None)

    def progress(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)

    with bar:
        yield progress


def cmd_verify(args: argparse.Namespace) -> int:
    _encryption()  # a malformed key is said once, before any checkpoint is read
    storage, want = _locate(args.dir, args.step, args.storage_option, "verify")
    if args.all and want is not None:
        raise CliError(f"{args.dir} is one checkpoint (step {want}); --all verifies every "
                       f"checkpoint of a run directory: pitstop verify {storage.location} --all")
    listing = _scan(storage)
    naming = listing.naming
    if args.all:
        for _ in range(10):
            if listing.steps or not (listing.odd or listing.tmp):
                break
            # only entries caught mid-change (a live trainer's retention deleting the newest
            # one while committing the next): look again
            time.sleep(0.01)
            listing = _scan(storage)
        steps = listing.steps
        if not steps:
            raise CliError(_no_checkpoint(listing, "verify"))
    else:
        picked, naming = _pick_live(storage, want, "verify")
        steps = [picked]
    failed: list[int] = []
    unchecked: list[str] = []
    repicks = 0
    show = _wants_progress(args.progress)
    if show:  # imported before any checkpoint's time is taken
        with contextlib.suppress(ImportError):
            import rich.progress  # noqa: F401
    total = len(steps)
    while steps:
        s = steps.pop(0)
        name = naming.name(s)
        where = storage.path_of(name)
        t0 = time.perf_counter()
        with _lease(storage, name):
            if _gone(storage, name):
                # deleted by a live trainer's retention between listing and reading
                if not args.all and want is None and repicks < 9:
                    repicks += 1  # the newest one was asked for: the next newest it is
                    picked, naming = _pick_live(storage, None, "verify")
                    steps = [picked]
                    continue
                print(f"step {s}: gone (deleted while listing), skipped")
                continue
            try:
                key = _encryption()
                reader = CheckpointReader(storage, name, naming=naming, encryption=key,
                                          **_bound(storage, naming, key))
                with _progress_bar(show, f"step {s}") as bar:
                    reader.verify(progress=bar)
            except CorruptCheckpointError as e:
                if isinstance(storage, FsspecStorage) and _gone(storage, name):
                    # object stores have no read leases: a live trainer's retention may
                    # delete a checkpoint while it is read
                    print(f"step {s}: gone (deleted while verifying), skipped")
                    continue
                failed.append(s)
                at = ", ".join(
                    f"{label} {_shown(value)}"
                    for label, value in (("file", e.file), ("tensor", e.key))
                    if value
                )
                print(f"step {s}: CORRUPT{' (' + at + ')' if at else ''}: {_one_line(e)}")
                continue
            except Exception as e:  # noqa: BLE001 - one broken checkpoint never stops the rest
                code, why = _failure(e, where)
                if code == CORRUPT:  # e.g. written by a newer pitstop, or a link loop
                    failed.append(s)
                else:  # e.g. permission denied: not the checkpoint's fault
                    unchecked.append(f"step {s}: {why}")
                print(f"step {s}: UNREADABLE: {_one_line(why)}")
                continue
        m = reader.manifest
        dt = time.perf_counter() - t0
        print(
            f"step {s}: ok ({len(m.arrays)} arrays, {human_size(m.nbytes)}, "
            f"{m.hash_algorithm} verified in {dt:.2f} s)"
        )
    if failed:
        print(f"{len(failed)} of {total} checkpoint(s) failed verification")
        sys.stdout.flush()
        print(
            f"pitstop: {storage.location}: {len(failed)} of {total} checkpoint(s) failed "
            f"verification (step {', '.join(map(str, failed))}; see above); a restore moves "
            "a corrupt checkpoint aside and falls back to the previous valid one",
            file=sys.stderr,
        )
    if unchecked:
        sys.stdout.flush()
        print(
            f"pitstop: {storage.location}: could not check {len(unchecked)} checkpoint(s) "
            f"({_one_line('; '.join(unchecked))}); fix the access and run verify again",
            file=sys.stderr,
        )
    return CORRUPT if failed else ERROR if unchecked else OK
