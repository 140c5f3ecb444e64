"""``pitstop gc DIR``: remove what pitstop itself left behind (interrupted saves and
deletions, this directory's stale memory-tier files: which those are is core's,
:func:`pitstop.core.save.tier_files.stale_files`), and nothing else."""

from __future__ import annotations

import argparse
import errno
import hashlib
import os
import shutil
import stat
import sys
from typing import Any

from pitstop.cli.common import (
    ERROR,
    OK,
    CliError,
    Listing,
    _example,
    _kind,
    _no_meta,
    _one_line,
    _open,
    _scan,
    _single_checkpoint_hint,
    _url_options,
    _why,
)
from pitstop.core.directory.records import read_record
from pitstop.core.errors import DirectoryLockedError
from pitstop.core.save import memtier
from pitstop.core.save.tier_files import stale_files
from pitstop.core.storage import FsspecStorage, Storage
from pitstop.core.storage.local import META_DIR

GC_DESCRIPTION = """\
Remove what pitstop itself left behind, and nothing else:

  * leftovers of interrupted saves and deletions in DIR: directories named
    .tmp-<name>-<8 hex>, and files named .pitstop/<file>.tmp-<8 hex>;
  * this directory's memory-tier files in /dev/shm (or --memory-tier ROOT):
    pitstop-<directory id>-<8 hex>-<slot>.buf, .json and .json.tmp - except a
    snapshot of a step newer than the newest committed step, which the next
    CheckpointManager on DIR recovers; --drop-recoverable removes that one too.

Only <name>s of the directory's naming count (.pitstop/directory.json; by default
step_<10 digits>, or e.g. ckpt-<step> for step_prefix="ckpt-", step_digits=0).
gc never deletes a committed checkpoint (<name>), a quarantined one
(<name>.corrupt-<time>-<4 hex>: it failed verification), an abandoned one
(<name>.abandoned-<time>-<4 hex>: newer steps of a run that was rolled back
to an older step), nor anything whose name pitstop did not make (step_5, your own
files): delete those by hand. It runs only while no writer holds DIR.
"""


def add_parser(sub: Any) -> None:
    s = sub.add_parser(
        "gc",
        help="remove leftovers of interrupted saves and stale memory-tier "
        "files (never a checkpoint, nor anything pitstop did not name)",
        description=GC_DESCRIPTION,
        **_example("pitstop gc --dry-run runs/exp1", "pitstop gc runs/exp1"),
    )
    s.add_argument("dir", metavar="DIR")
    _url_options(s)
    s.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    s.add_argument(
        "--memory-tier", metavar="ROOT", help="where the memory tier lives (default: /dev/shm)"
    )
    s.add_argument(
        "--drop-recoverable",
        action="store_true",
        help="also remove a memory-tier snapshot newer than the newest committed step",
    )
    s.set_defaults(func=cmd_gc)


def _write_error(loc: str, e: OSError) -> str:
    if e.errno == errno.EROFS:
        return (
            f"{loc}: on a read-only file system, so gc can remove nothing there; remount "
            "it read-write (or run gc where it is mounted writable); "
            f"`pitstop gc --dry-run {loc}` lists what gc would remove"
        )
    if e.errno in (errno.EACCES, errno.EPERM):
        return (
            f"{loc}: permission denied ({e.filename}); run gc as the user that owns the "
            f"checkpoints; `pitstop gc --dry-run {loc}` lists what gc would remove"
        )
    return (
        f"{e.filename or loc}: cannot take the directory's writer lock ({e.strerror}); "
        f"{META_DIR}/lock must be a regular file: move whatever is there away and run "
        "gc again"
    )


def cmd_gc(args: argparse.Namespace) -> int:
    storage = _open(args.dir, args.storage_option)
    loc = storage.location
    listing = _scan(storage)
    if not listing.has_meta:
        raise CliError(
            f"{loc}: not a pitstop checkpoint directory ({_no_meta(listing)}); gc only tidies "
            "a directory a CheckpointManager wrote" + _single_checkpoint_hint(listing, "gc")
        )
    root = _tier_root(args)
    notes: list[str] = []
    lock = None
    try:
        lock = storage.lock()  # no writer may be mid-save while we delete its temporaries
    except DirectoryLockedError as e:
        raise CliError(
            f"{_one_line(e)} gc only runs while no writer holds the directory."
        ) from None
    except OSError as e:
        if isinstance(storage, FsspecStorage):
            raise CliError(f"{loc}: cannot take the directory's writer lock "
                           f"({_one_line(_why(e))}); gc only runs while it holds it") from None
        if not (args.dry_run and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM)):
            raise CliError(_write_error(loc, e)) from None
        # a dry run removes nothing; where no writer can write, none can be mid-save either
        notes.append(
            f"note: {loc} is not writable ({e.strerror}): a real gc could remove "
            "nothing there (read-only file system, or no permission)"
        )
    removed: list[str] = []
    kept: list[str] = []
    failures: list[str] = []
    problems: list[str] = []
    try:
        listing = _scan(storage)  # again, now that no writer can be mid-save
        if isinstance(storage, FsspecStorage):
            removed += _gc_objects(storage, listing, args.dry_run, failures)
        for rel in listing.tmp if not isinstance(storage, FsspecStorage) else []:
            if args.dry_run:
                removed.append(rel)
                continue
            path = os.path.join(loc, rel)
            try:
                if rel.startswith(META_DIR + "/") or _kind(path) == stat.S_IFLNK:
                    os.unlink(path)  # (a link: never followed)
                else:
                    shutil.rmtree(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                failures.append(f"{path} ({e.strerror})")
                continue
            removed.append(rel)
        if root is not None:
            removed += _gc_memory_tier(storage, root, listing, args, kept, failures, problems)
    finally:
        if lock is not None:
            lock.release()
    verb = "would remove" if args.dry_run else "removed"
    for path in removed:
        print(f"{verb} {path}")
    for line in kept:
        print(f"kept {line}")
    print(
        f"{verb} {len(removed)} leftover(s); committed checkpoints untouched "
        f"({len(listing.steps)} in {loc})"
    )
    for note in notes:
        print(note)
    sys.stdout.flush()
    if failures:
        print(
            f"pitstop: could not remove {len(failures)} of pitstop's leftovers: "
            f"{_one_line(', '.join(failures))}; make them writable (or the file system "
            "read-write) and run gc again",
            file=sys.stderr,
        )
    for problem in problems:
        print(f"pitstop: {_one_line(problem)}", file=sys.stderr)
    return ERROR if failures or problems else OK


def _gc_objects(storage: FsspecStorage, listing: Listing, dry_run: bool,
                failures: list[str]) -> list[str]:
    """Remove an object-store directory's leftovers (markers and the objects they name)."""
    removed: list[str] = []
    for item in listing.leftovers:
        if dry_run:
            removed += item.describe()
            continue
        try:
            removed += storage.remove_leftover(item)
        except OSError as e:
            failures.append(f"{storage.location}/{item.entry} ({_one_line(_why(e))})")
    return removed


def _tier_root(args: argparse.Namespace) -> str | None:
    if args.memory_tier is None:
        return memtier.default_root()
    root = args.memory_tier
    if not os.path.isdir(root):
        what = "not a directory" if os.path.exists(root) else "no such directory"
        raise CliError(
            f"{root}: {what} (--memory-tier); give the directory the memory tier "
            "lives in (default /dev/shm)"
        )
    return root


def _gc_memory_tier(
    storage: Storage,
    root: str,
    listing: Listing,
    args: argparse.Namespace,
    kept: list[str],
    failures: list[str],
    problems: list[str],
) -> list[str]:
    """Remove this directory's memory-tier files, except a snapshot a restart would recover.

    Only regular files named exactly ``<prefix>-<slot>.buf|.json[.tmp]`` are the tier's
    (:func:`~pitstop.core.save.tier_files.stale_files` says which, and which stay)."""
    ident, problem = read_record(storage).tier_id()
    if ident is None:
        if problem is not None:
            where = hashlib.sha1(os.path.realpath(storage.location).encode()).hexdigest()[:8]
            problems.append(
                f"{os.path.join(storage.location, META_DIR, 'directory.json')}: {problem}; "
                f"memory-tier files in {root} left alone, as gc cannot tell which are this "
                f"directory's: delete {os.path.join(root, f'pitstop-*-{where}-*')} by hand "
                "once no job uses this directory"
            )
        return []
    tier = memtier.MemoryTier(root, storage.location, ident)
    newest = listing.steps[-1] if listing.steps else None
    try:
        doomed, why_kept = stale_files(tier, newest, args.drop_recoverable)
    except OSError as e:
        failures.append(f"{root} (cannot list it: {e.strerror})")
        return []
    kept.extend(why_kept)
    if args.dry_run:
        return doomed
    removed = []
    for path in doomed:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            failures.append(f"{path} ({e.strerror})")
            continue
        removed.append(path)
    return removed
