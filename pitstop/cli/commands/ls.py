"""``pitstop ls DIR``: every checkpoint of a directory with its time, size, metrics and
status: whether the next retention pass keeps it and why (core's explanation,
:func:`pitstop.core.directory.retention.explain_retention`), incomplete, moved aside,
unreadable; and what in the directory is not pitstop's."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from pitstop.cli.common import (
    OK,
    CliError,
    Listing,
    _as_checkpoint,
    _encryption,
    _example,
    _gone,
    _looks_like,
    _metric_text,
    _no_meta,
    _one_line,
    _open,
    _reader,
    _scan,
    _shown,
    _time,
    _url_options,
    human_size,
)
from pitstop.core.directory.catalog import parse_index
from pitstop.core.directory.names import Naming
from pitstop.core.directory.records import SHOWN_NOTICES, DirectoryRecord, read_record
from pitstop.core.directory.retention import (
    RecordedRetention,
    aside_refs,
    explain_retention,
    recorded_retention,
)
from pitstop.core.policy import CheckpointInfo
from pitstop.core.storage import Storage
from pitstop.core.storage.local import META_DIR

#: one row of the table: (step or None, order, mark, saved, size, arrays, status, metrics, kind)
Row = tuple[Any, int, str, str, str, str, str, str, str]

#: what each kind of row in ``pitstop ls`` is, said once under the table when one shows
_LS_NOTES = {
    "incomplete": "incomplete: left by an interrupted save or deletion (a writer may still "
    "be using it); `pitstop gc {loc}` removes it when none is",
    "corrupt": "corrupt: moved aside after failing verification; pitstop never restores or "
    "deletes it: delete it by hand when done",
    "abandoned": "abandoned: a newer checkpoint of a run that was rolled back to an older "
    "step, moved aside at its first new save; pitstop never restores or deletes it: delete "
    "it by hand when no longer needed",
    "unreadable": "unreadable: its manifest cannot be read, so it is never restored; "
    "`pitstop verify {loc} --step N` says why",
    "not a checkpoint": "not a checkpoint: named like one, but no committed manifest; left "
    "alone",
}


def add_parser(sub: Any) -> None:
    s = sub.add_parser(
        "ls",
        help="list checkpoints: committed ones (step, time, size, metrics, whether "
        "retention keeps them), incomplete, corrupt and abandoned ones",
        description="List a checkpoint directory: every committed checkpoint with its "
        "time, size and metrics, and whether the next retention pass keeps it (and why); "
        "incomplete saves, checkpoints moved aside (corrupt, abandoned) and unreadable "
        "ones; entries that are not pitstop's. Given a checkpoint's own path, its row only.",
        **_example("pitstop ls runs/exp1", "pitstop ls runs/exp1/step_0000000300"),
    )
    s.add_argument("dir", metavar="DIR")
    _url_options(s)
    s.set_defaults(func=cmd_ls)


def cmd_ls(args: argparse.Namespace) -> int:
    _encryption()  # a malformed key is said once, not on every row as "unreadable"
    storage = _open(args.dir, args.storage_option)
    listing = _scan(storage)
    only: int | None = None
    if not listing.steps and not listing.has_meta:
        one = _as_checkpoint(listing)
        if one is not None:  # a checkpoint's own path: its row, in its run directory
            storage, only = one
            listing = _scan(storage)
    steps = listing.steps
    naming = listing.naming
    loc = storage.location
    out = sys.stdout
    if only is None:
        print(f"{loc}: {len(steps)} checkpoint{'s' * (len(steps) != 1)}", file=out)
    else:
        print(f"{storage.path_of(naming.name(only))}: the checkpoint of step {only} "
              f"(`pitstop ls {loc}` lists all {len(steps)})", file=out)
    record = read_record(storage)
    ret = recorded_retention(record.retention) if listing.has_meta else None
    if ret is not None and (steps or ret.policies is not None):
        print(ret.summary, file=out)
    ident, _ = record.tier_id()
    infos, committed, unreadable = _read_all(storage, steps, naming, ident)
    rows = _rows(storage, listing, ret, infos, committed, unreadable, only)
    newest = max(infos) if infos else None
    _table(rows, newest)
    for kind in dict.fromkeys(r[8] for r in rows if r[8]):
        print(_LS_NOTES[kind].format(loc=loc), file=out)
    skipped = read_record(storage).skipped_line() if listing.has_meta and only is None \
        else None
    if skipped is not None:
        print(skipped, file=out)
    if listing.has_meta:
        _preemption_lines(record, set(infos), only)
    #: incremental checkpoints: holder step -> the steps that reference its data
    users: dict[int, list[int]] = {}
    for s, info in sorted(infos.items()):
        for held in info.refs or ():
            users.setdefault(held, []).append(s)
    for held, by in sorted(users.items()):
        if only in (None, held):
            print(f"step {held} holds data referenced by step {', '.join(map(str, by))} "
                  "(incremental: arrays unchanged since it are stored there once; kept while "
                  "a kept checkpoint references it)", file=out)
    if only is None:
        _not_checkpoints(storage, listing)
    return OK


def _preemption_lines(record: DirectoryRecord, steps: set[int], only: int | None) -> None:
    """The saves made on preemption notices (newest last): the notice, the step, when it
    was durable and the margin before the deadline; for one checkpoint, its own only."""
    saves = [p for p in record.preemption_saves() if only in (None, p.step)]
    earlier = len(saves) - SHOWN_NOTICES
    if earlier > 0:
        print(f"({earlier} earlier save{'s' * (earlier != 1)} on preemption notices recorded)",
              file=sys.stdout)
    for p in saves[-SHOWN_NOTICES:]:
        gone = "" if p.step in steps or p.durable_unix is None else \
            " (no longer in the directory)"
        print(p.line() + gone, file=sys.stdout)


def _read_all(storage: Storage, steps: list[int], naming: Naming, ident: str | None
              ) -> tuple[dict[int, Any], dict[int, tuple[str, str, str, str]], dict[int, str]]:
    """Each committed checkpoint's manifest, read: (what retention knows of each, the
    columns of the readable ones, why each unreadable one is)."""
    protected = _protected(storage, ident)
    infos: dict[int, Any] = {}
    committed: dict[int, tuple[str, str, str, str]] = {}
    unreadable: dict[int, str] = {}
    for s in steps:
        try:
            m = _reader(storage, naming.name(s), naming).manifest
        except CliError as e:
            if _gone(storage, naming.name(s)):
                continue  # deleted by a live trainer's retention while listing
            unreadable[s] = _one_line(e)
            infos[s] = CheckpointInfo(s, {}, ours=False)
            continue
        refs = tuple(sorted(r for r in (naming.parse(h) for h in m.refs) if r is not None))
        infos[s] = CheckpointInfo(s, m.metrics, ours=bool(ident) and m.directory_id == ident,
                                  all_finite=m.all_finite, protected=s in protected, refs=refs)
        committed[s] = (_time(m.created_unix), human_size(sum(m.files.values())),
                        str(len(m.arrays)), _metric_text(m.metrics))
    return infos, committed, unreadable


def _rows(storage: Storage, listing: Listing, ret: RecordedRetention | None,
          infos: dict[int, Any], committed: dict[int, tuple[str, str, str, str]],
          unreadable: dict[int, str], only: int | None) -> list[Row]:
    """The table's rows, in order: the checkpoints (with what retention does with each),
    then (the whole directory listed) leftovers, checkpoints moved aside, look-alikes."""
    naming = listing.naming
    rows: list[Row] = []
    decided = explain_retention(ret, infos, _aside_refs(storage, listing), naming) \
        if ret is not None else {}
    newest = max(infos) if infos else None
    for s in infos:
        mark = "*" if s == newest else ""
        if s in unreadable:
            rows.append((s, 0, mark, "-", "-", "-", f"unreadable: {unreadable[s]}", "",
                         "unreadable"))
            continue
        saved, size, arrays, metrics = committed[s]
        rows.append((s, 0, mark, saved, size, arrays, decided.get(s, "committed"), metrics,
                     ""))
    if only is None:
        for step, status in _leftover_rows(listing):
            rows.append((step, 1, "", "-", "-", "-", status, "", "incomplete"))
        for name, step, why in listing.aside:
            rows.append((step, 2, "", "-", "-", "-", f"{why}: moved aside ({_shown(name)})", "",
                         why))
        for name, what in listing.odd:
            rows.append((naming.parse(name), 3, "", "-", "-", "-",
                         f"not a checkpoint: {_shown(name)}: {what}", "", "not a checkpoint"))
    else:
        rows = [r for r in rows if r[0] == only]
    rows.sort(key=lambda r: (r[0] is None, r[0] or 0, r[1]))
    return rows


def _table(rows: list[Row], newest: int | None) -> None:
    out = sys.stdout
    if rows:
        table = [("", "STEP", "SAVED", "SIZE", "ARRAYS", "STATUS", "METRICS")] + [
            (r[2], "-" if r[0] is None else str(r[0]), *r[3:8]) for r in rows]
        widths = [max(len(r[i]) for r in table) for i in range(6)]
        for r in table:
            cells = [r[0].ljust(1)] + [
                r[i].rjust(widths[i]) if i in (1, 3, 4) else r[i].ljust(widths[i])
                for i in range(1, 6)] + [r[6]]
            print("  ".join(cells).rstrip(), file=out)
        if newest is not None and any(r[2] for r in rows):
            print("(* newest)", file=out)


def _not_checkpoints(storage: Storage, listing: Listing) -> None:
    """The lines under the table on what in the directory is no pitstop checkpoint."""
    out = sys.stdout
    naming = listing.naming
    for entry in listing.nested:
        print(f"run directory {entry}/ inside it: `pitstop ls {storage.path_of(entry)}` "
              "lists its checkpoints", file=out)
    native, foreign = _tf_native(listing.foreign)
    if native:
        print(f"tf.train checkpoints: {', '.join(native)} (their .index and .data-* files"
              f"{', and its checkpoint state file' if 'checkpoint' in listing.foreign else ''}"
              "): pitstop's commands leave them alone; a pitstop.adapters.tf.CheckpointManager "
              "of their name restores from them and deletes old ones as tf.train's "
              "max_to_keep does", file=out)
    if foreign:
        hint = (
            f"; this directory names a checkpoint {naming.describe()}"
            if any(_looks_like(naming, f) for f in foreign)
            else ""
        )
        print(f"not pitstop's: {', '.join(foreign)} (left alone{hint})", file=out)
    if not listing.has_meta:
        print(
            f"{_no_meta(listing)}: not a pitstop checkpoint directory (or its {META_DIR}/ "
            "was removed)",
            file=out,
        )


def _protected(storage: Storage, ident: str | None) -> set[int]:
    """The steps the directory's index marks protected (not merely held by a reference)."""
    if not ident:
        return set()
    try:
        raw = storage.read_meta("index.json")
        known = parse_index(raw, ident) if raw is not None else {}
    except Exception:  # noqa: BLE001 - a cache: a doubtful one protects nothing
        return set()
    return {s for s, info in known.items() if info.protected}


def _aside_refs(storage: Storage, listing: Listing) -> dict[str, tuple[str, ...]]:
    """The abandoned checkpoints and what their manifests reference (retention keeps
    those): see :meth:`pitstop.core.directory.catalog.Catalog.held_aside`."""
    return {name: aside_refs(storage, name) for name, _step, why in listing.aside
            if why == "abandoned"}


def _leftover_rows(listing: Listing) -> list[tuple[int | None, str]]:
    """(step or None, status) of each leftover of an interrupted operation."""
    naming = listing.naming
    rows: list[tuple[int | None, str]] = []
    if listing.objects is not None:
        for item in listing.leftovers:
            what = {"save": "interrupted save", "delete": "interrupted deletion",
                    "upload": "unfinished upload"}.get(
                item.op, "interrupted write")
            rows.append((naming.parse(item.name), f"incomplete: {what} ({_shown(item.entry)})"))
        return rows
    for entry in listing.tmp:
        if entry.startswith(META_DIR + "/"):
            rows.append((None, f"incomplete: interrupted write ({_shown(entry)})"))
            continue
        what = "interrupted deletion" if entry.startswith(".tmp-deleting-") else \
            "interrupted save"
        rows.append((naming.parse_tmp(entry), f"incomplete: {what} ({_shown(entry)})"))
    return rows


_TF_FILE = re.compile(r"^(.+)(\.index|\.data-\d{5}-of-\d{5})$")


def _tf_native(entries: list[str]) -> tuple[list[str], list[str]]:
    """(the tf.train checkpoints among ``entries``: the prefixes with a ``.index``, the
    other entries): their files, and tf.train's ``checkpoint`` state file beside them, are
    not listed as someone else's, since pitstop's TensorFlow manager sweeps them."""
    prefixes = {m.group(1) for e in entries if (m := _TF_FILE.match(e)) and
                m.group(2) == ".index"}
    if not prefixes:
        return [], entries
    rest = [e for e in entries if e != "checkpoint" and not (
        (m := _TF_FILE.match(e)) and m.group(1) in prefixes)]
    return sorted(prefixes, key=_natural), rest


def _natural(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
