"""The ``pitstop`` command: look at, check and tidy checkpoint directories.

    pitstop ls DIR                       committed steps: time, size, metrics; the newest marked
    pitstop inspect DIR [--step N]       one checkpoint's manifest: arrays, values, metrics
    pitstop verify DIR [--step N|--all]  read every array and check its hash
    pitstop gc DIR                       remove leftovers of interrupted saves
    pitstop demo                         kill -9 a numpy training run, resume it, compare

``ls``, ``inspect`` and ``verify`` open the directory read-only (no lock, nothing written),
so they work while a trainer is writing to it. Exit status: 0 fine, 1 a checkpoint failed
verification, 2 anything else that went wrong (bad arguments, no such directory or step,
directory busy).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import time
from contextlib import nullcontext
from typing import Any

from ..core import memtier
from ..core.errors import CheckpointError, CorruptCheckpointError, DirectoryLockedError
from ..core.manager import step_name
from ..core.reader import CheckpointReader, nbytes_of
from ..core.storage import local as _local
from ..core.storage.local import MANIFEST, META_DIR, LocalStorage

OK, CORRUPT, ERROR = 0, 1, 2
_STEP = re.compile(r"^step_(\d+)$")
_QUARANTINED = re.compile(r"^step_\d+\.corrupt-")
#: what LocalStorage.cleanup_incomplete() removes: interrupted saves and deletions, and
#: interrupted writes of .pitstop/ files
_TMP_ENTRY = getattr(_local, "_TMP_ENTRY", re.compile(r"^\.tmp-.+-[0-9a-f]{8}$"))
_TMP_META = getattr(_local, "_TMP_META", re.compile(r"^.+\.tmp-[0-9a-f]{8}$"))


class CliError(Exception):
    """A user-facing error: printed as ``pitstop: <message>``, exit status 2."""


# ====================================================================== helpers
def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _time(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix)) if unix else "-"


def _metric_text(metrics: dict[str, Any]) -> str:
    parts = []
    for k, v in metrics.items():
        if isinstance(v, float):
            v = f"{v:.6g}"
        parts.append(f"{k}={v}")
    return " ".join(parts) or "-"


def _short(obj: Any, width: int = 100) -> str:
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return text if len(text) <= width else text[: width - 3] + "..."


def _open(directory: str) -> LocalStorage:
    """The directory's storage, opened without creating or writing anything."""
    if "://" in directory and not directory.startswith("file://"):
        raise CliError(f"{directory}: only local (or mounted) directories are supported")
    directory = directory.removeprefix("file://")
    if not os.path.isdir(directory):
        raise CliError(f"{directory}: no such directory")
    return LocalStorage(directory, create=False)


def _steps(storage: LocalStorage) -> list[int]:
    out = []
    for name in storage.list_checkpoints():
        m = _STEP.match(name)
        if m:
            out.append(int(m.group(1)))
    return sorted(out)


def _pick(storage: LocalStorage, step: int | None) -> int:
    steps = _steps(storage)
    if not steps:
        raise CliError(f"{storage.location}: no committed checkpoint")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise CliError(
            f"{storage.location}: no checkpoint of step {step} "
            f"(have: {', '.join(map(str, steps[-10:]))})"
        )
    return step


def _lease(storage: LocalStorage, name: str) -> Any:
    """Hold the checkpoint's read lease, so a live trainer's retention skips it meanwhile."""
    lease = getattr(storage, "read_lease", None)
    return lease(name) if lease is not None else nullcontext()


def _leftovers(location: str) -> tuple[list[str], list[str]]:
    """(``.tmp-*`` leftovers of interrupted saves, quarantined ``step_*.corrupt-*``)."""
    try:
        entries = sorted(os.listdir(location))
    except FileNotFoundError:
        return [], []
    meta = os.path.join(location, META_DIR)
    meta_entries = sorted(os.listdir(meta)) if os.path.isdir(meta) else []
    return (
        [e for e in entries if _TMP_ENTRY.match(e)]
        + [f"{META_DIR}/{e}" for e in meta_entries if _TMP_META.match(e)],
        [e for e in entries if _QUARANTINED.match(e)],
    )


# ====================================================================== ls
def cmd_ls(args: argparse.Namespace) -> int:
    storage = _open(args.dir)
    steps = _steps(storage)
    out = sys.stdout
    print(f"{storage.location}: {len(steps)} checkpoint{'s' * (len(steps) != 1)}", file=out)
    if steps:
        rows = [("", "STEP", "SAVED", "SIZE", "ARRAYS", "METRICS")]
        for s in steps:
            mark = "*" if s == steps[-1] else ""
            try:
                m = CheckpointReader(storage, step_name(s)).manifest
            except CheckpointError as e:
                rows.append((mark, str(s), "-", "-", "-", f"unreadable: {e}"))
                continue
            size = sum(m.files.values())
            rows.append(
                (
                    mark,
                    str(s),
                    _time(m.created_unix),
                    human_size(size),
                    str(len(m.arrays)),
                    _metric_text(m.metrics),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        for r in rows:
            cells = (
                [r[0].ljust(1)]
                + [
                    r[i].rjust(widths[i]) if i in (1, 3, 4) else r[i].ljust(widths[i])
                    for i in range(1, 5)
                ]
                + [r[5]]
            )
            print("  ".join(cells).rstrip(), file=out)
        print("(* newest)", file=out)
    tmp, bad = _leftovers(storage.location)
    if tmp:
        print(
            f"{len(tmp)} leftover(s) of interrupted saves: {', '.join(tmp)} "
            "(a writer may still be using them; `pitstop gc` removes them when none is)",
            file=out,
        )
    if bad:
        print(f"quarantined (failed verification, kept for inspection): {', '.join(bad)}", file=out)
    return OK


# ====================================================================== inspect
def cmd_inspect(args: argparse.Namespace) -> int:
    storage = _open(args.dir)
    step = _pick(storage, args.step)
    name = step_name(step)
    if args.json:
        print(storage.read_bytes(name, MANIFEST).decode())
        return OK
    m = CheckpointReader(storage, name).manifest
    out = sys.stdout
    w = m.writer
    print(f"step {m.step}: {storage.path_of(name)}", file=out)
    print(
        f"  format {m.format_version}, saved {_time(m.created_unix)} by pitstop "
        f"{w.get('pitstop', '?')} on {w.get('host', '?')} (pid {w.get('pid', '?')})",
        file=out,
    )
    print(
        f"  {len(m.arrays)} arrays, {human_size(m.nbytes)} in {len(m.files)} file(s) of "
        f"{human_size(sum(m.files.values()))}, hash {m.hash_algorithm}, "
        f"all finite: {'unchecked' if m.all_finite is None else m.all_finite}",
        file=out,
    )
    print(f"  metrics: {_metric_text(m.metrics)}", file=out)
    if m.user_metadata:
        print(f"  user_metadata: {_short(m.user_metadata)}", file=out)
    if m.arrays:
        print("arrays:", file=out)
        rows = [("KEY", "DTYPE", "SHAPE", "BYTES", "WHERE")]
        for key, e in m.arrays.items():
            dtype = e.dtype if isinstance(e.dtype, str) else _short(e.dtype, 40)
            where = f"{e.file}@{e.offset}" + (
                "" if e.codec == "none" else f" ({e.codec}, {human_size(e.length)})"
            )
            rows.append(
                (
                    key,
                    dtype,
                    "[" + ", ".join(map(str, e.shape)) + "]",
                    human_size(nbytes_of(e)),
                    where,
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        for r in rows:
            print(
                "  "
                + "  ".join(
                    [
                        r[0].ljust(widths[0]),
                        r[1].ljust(widths[1]),
                        r[2].ljust(widths[2]),
                        r[3].rjust(widths[3]),
                        r[4],
                    ]
                ),
                file=out,
            )
    if m.values:
        print("values:", file=out)
        width = max(len(k) for k in m.values)
        for key, v in m.values.items():
            print(f"  {key.ljust(width)}  {_short(v)}", file=out)
    return OK


# ====================================================================== verify
def cmd_verify(args: argparse.Namespace) -> int:
    storage = _open(args.dir)
    if args.all:
        steps = _steps(storage)
        if not steps:
            raise CliError(f"{storage.location}: no committed checkpoint")
    else:
        steps = [_pick(storage, args.step)]
    failed = 0
    for s in steps:
        name = step_name(s)
        t0 = time.perf_counter()
        with _lease(storage, name):
            if not os.path.isfile(os.path.join(storage.location, name, MANIFEST)):
                # deleted by a live trainer's retention between listing and reading
                print(f"step {s}: gone (deleted while listing), skipped")
                continue
            try:
                reader = CheckpointReader(storage, name)
                reader.verify()
            except CorruptCheckpointError as e:
                failed += 1
                where = ", ".join(
                    f"{label} {value}"
                    for label, value in (("file", e.file), ("tensor", e.key))
                    if value
                )
                print(f"step {s}: CORRUPT{' (' + where + ')' if where else ''}: {e}")
                continue
            except CheckpointError as e:  # e.g. written by a newer pitstop
                failed += 1
                print(f"step {s}: UNREADABLE: {e}")
                continue
        m = reader.manifest
        dt = time.perf_counter() - t0
        print(
            f"step {s}: ok ({len(m.arrays)} arrays, {human_size(m.nbytes)}, "
            f"{m.hash_algorithm} verified in {dt:.2f} s)"
        )
    if failed:
        print(f"{failed} of {len(steps)} checkpoint(s) failed verification")
        return CORRUPT
    return OK


# ====================================================================== gc
def cmd_gc(args: argparse.Namespace) -> int:
    storage = _open(args.dir)
    if not os.path.isdir(os.path.join(storage.location, META_DIR)):
        raise CliError(
            f"{storage.location}: not a pitstop checkpoint directory (no {META_DIR}/ inside)"
        )
    try:
        lock = storage.lock()  # no writer may be mid-save while we delete its temporaries
    except DirectoryLockedError as e:
        raise CliError(f"{e} gc only runs while no writer holds the directory.") from None
    try:
        removed: list[str] = []
        kept: list[str] = []
        tmp, _ = _leftovers(storage.location)
        if args.dry_run:
            removed += tmp
        else:
            removed += storage.cleanup_incomplete()
        removed += _gc_memory_tier(storage, args, kept)
    finally:
        lock.release()
    verb = "would remove" if args.dry_run else "removed"
    for path in removed:
        print(f"{verb} {path}")
    for line in kept:
        print(f"kept {line}")
    print(
        f"{verb} {len(removed)} leftover(s); committed checkpoints untouched "
        f"({len(_steps(storage))} in {storage.location})"
    )
    return OK


def _gc_memory_tier(storage: LocalStorage, args: argparse.Namespace, kept: list[str]) -> list[str]:
    """Remove this directory's memory-tier files, except a snapshot a restart would recover."""
    root = args.memory_tier or memtier.default_root()
    raw = storage.read_meta("directory.json")
    if root is None or raw is None or not os.path.isdir(root):
        return []
    try:
        directory_id = str(json.loads(raw)["directory_id"])
    except (ValueError, KeyError, TypeError):
        return []
    tier = memtier.MemoryTier(root, storage.location, directory_id)
    steps = _steps(storage)
    newest = steps[-1] if steps else None
    keep: set[str] = set()
    if not args.drop_recoverable:
        for meta, buf_path in tier.candidates():
            try:
                why = tier.trusted(meta, newest)
            except (KeyError, TypeError, ValueError):
                continue
            if why is None and os.path.isfile(buf_path):
                meta_path = buf_path[: -len(".buf")] + ".json"
                keep |= {buf_path, meta_path}
                kept.append(
                    f"{buf_path}: snapshot of step {meta.get('step')}, newer than the "
                    "newest committed step; the next CheckpointManager on this "
                    "directory recovers it (--drop-recoverable removes it)"
                )
    doomed = sorted(p for p in glob.glob(f"{tier.prefix}-*") if p not in keep)
    if not args.dry_run:
        for path in doomed:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    return doomed


# ====================================================================== main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pitstop",
        description="Look at, check and tidy pitstop checkpoint directories.",
        epilog="Exit status: 0 fine, 1 a checkpoint failed verification, 2 other errors.",
    )
    from .._version import __version__

    p.add_argument("--version", action="version", version=f"pitstop {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    s = sub.add_parser("ls", help="list committed checkpoints (step, time, size, metrics)")
    s.add_argument("dir", metavar="DIR")
    s.set_defaults(func=cmd_ls)

    s = sub.add_parser("inspect", help="show one checkpoint's manifest (newest by default)")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("--step", type=int, help="the step to show (default: the newest)")
    s.add_argument("--json", action="store_true", help="print the raw manifest.json")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("verify", help="read every array and check its hash (newest by default)")
    s.add_argument("dir", metavar="DIR")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--step", type=int, help="verify this step")
    g.add_argument("--all", action="store_true", help="verify every committed checkpoint")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser(
        "gc",
        help="remove leftovers of interrupted saves and stale memory-tier "
        "files (never a committed checkpoint)",
    )
    s.add_argument("dir", metavar="DIR")
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

    from . import demo

    demo.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pitstop`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except CliError as e:
        print(f"pitstop: {e}", file=sys.stderr)
        return ERROR
    except CorruptCheckpointError as e:  # e.g. `inspect` of a checkpoint with a broken manifest
        print(f"pitstop: {e}", file=sys.stderr)
        return CORRUPT
    except CheckpointError as e:
        print(f"pitstop: {e}", file=sys.stderr)
        return ERROR
    except BrokenPipeError:  # `pitstop ls DIR | head`
        sys.stderr.close()
        return OK
    except KeyboardInterrupt:
        return 130


__all__ = ["main", "build_parser", "human_size"]
