"""``pitstop inspect DIR [--step N]``: one checkpoint's manifest, validated and its files
checked before anything is printed: who wrote it (frameworks and versions), its arrays,
values and metrics; ``--json`` the raw manifest."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pitstop.cli.common import (
    CORRUPT,
    OK,
    CliError,
    _checked,
    _example,
    _failure,
    _gone,
    _lease,
    _locate,
    _metric_text,
    _pick_live,
    _reader,
    _shown,
    _time,
    _url_options,
    human_size,
)
from pitstop.core.directory.text import brief as _short
from pitstop.core.format.schema import Manifest
from pitstop.core.restore.read import nbytes_of
from pitstop.core.storage.local import MANIFEST


def add_parser(sub: Any) -> None:
    s = sub.add_parser(
        "inspect", help="show one checkpoint's manifest (newest by default)",
        description="Show one checkpoint: who wrote it (pitstop, frameworks and their "
        "versions, host, pid), its arrays, values and metrics.",
        **_example("pitstop inspect runs/exp1 --step 300"))
    s.add_argument("dir", metavar="DIR")
    _url_options(s)
    s.add_argument("--step", type=int, help="the step to show (default: the newest)")
    s.add_argument("--rank", type=int, metavar="N",
                   help="of a checkpoint several ranks saved: show rank N's view (default 0)")
    s.add_argument(
        "--json",
        action="store_true",
        help="print the raw manifest.json (after validating it; a corrupt one "
        "prints nothing and exits 1)",
    )
    s.set_defaults(func=cmd_inspect)


def cmd_inspect(args: argparse.Namespace) -> int:
    found = _read(args)
    if found is None:
        return OK  # (--json: the manifest is printed)
    m, where = found
    rank = args.rank
    if rank is not None and not 0 <= rank < m.world:
        raise CliError(f"{where}: --rank {rank}: the checkpoint was saved by "
                       f"{m.world} rank{'s' * (m.world != 1)} (0 to {m.world - 1})")
    out = sys.stdout
    w = m.writer
    print(f"step {m.step}: {where}", file=out)
    if m.world > 1:
        mine = m.rank_specific()
        shown = ", ".join(_shown(k) for k in mine[:12]) + (" ..." if len(mine) > 12 else "")
        print(f"  saved by {m.world} ranks; below: rank {rank or 0}'s view"
              + ("" if rank else " (--rank N for another's)")
              + (f"; each rank saved its own {shown}" if mine else
                 "; every rank saved the same entries"), file=out)
        m = m.view(rank or 0)
    print(f"  format {m.format_version}, saved {_time(m.created_unix)}", file=out)
    print(f"  written by: {_written_by(w)}", file=out)
    print(
        f"  {len(m.arrays)} arrays, {human_size(m.nbytes)} in {len(m.files)} file(s) of "
        f"{human_size(sum(m.files.values()))}, hash {m.hash_algorithm}, "
        f"all finite: {'unchecked' if m.all_finite is None else m.all_finite}",
        file=out,
    )
    if m.refs:
        print(f"  incremental: unchanged arrays are read from "
              f"{', '.join(_shown(h) for h in m.refs)} (referenced, not written again)",
              file=out)
    if m.encryption is not None:
        print(f"  encrypted: {m.encryption.get('algorithm')}, key id "
              f"{m.encryption.get('key_id')}", file=out)
    print(f"  metrics: {_metric_text(m.metrics)}", file=out)
    if m.user_metadata:
        print(f"  user_metadata: {_short(m.user_metadata)}", file=out)
    if m.arrays:
        _arrays(m)
    if m.values:
        print("values:", file=out)
        width = max(len(k) for k in m.values)
        for key, v in m.values.items():
            print(f"  {key.ljust(width)}  {_short(v)}", file=out)
    return OK


def _read(args: argparse.Namespace) -> tuple[Manifest, str] | None:
    """The checkpoint asked for, validated and its files checked (the newest again when a
    live trainer's retention deletes it meanwhile), with its path; None when ``--json``
    printed its manifest."""
    storage, want = _locate(args.dir, args.step, args.storage_option, "inspect")
    for attempt in range(10):
        step, naming = _pick_live(storage, want, "inspect")
        name = naming.name(step)
        where = storage.path_of(name)
        retry = want is None and attempt < 9
        with _lease(storage, name):
            if retry and _gone(storage, name):
                continue  # deleted by a live trainer's retention before the lease: look again
            try:
                # the manifest validated and its files checked (a stat each) before any
                # print: inspect never describes a checkpoint that cannot be read
                m = _checked(_reader(storage, name, naming), where)
            except CliError as err:
                if retry and _gone(storage, name):
                    continue
                if err.code != CORRUPT:
                    raise
                raise CliError(
                    f"{err}; `pitstop verify {storage.location} --all` checks the "
                    "others, and a restore moves a corrupt checkpoint aside and falls "
                    "back to the previous valid one",
                    CORRUPT,
                ) from None
            if args.json:
                try:
                    text = storage.read_bytes(name, MANIFEST).decode("utf-8")
                except UnicodeDecodeError as err:
                    raise CliError(
                        f"{where}: manifest.json is not UTF-8 text (byte {err.start}); "
                        "pitstop writes UTF-8 only, so it was changed after the commit",
                        CORRUPT,
                    ) from None
                except Exception as err:  # noqa: BLE001 - replaced since it was validated
                    code, why = _failure(err, where)
                    raise CliError(why, code) from None
                print(text.rstrip("\n"))
                return None
        break
    return m, where


def _arrays(m: Manifest) -> None:
    """The table of arrays: key, dtype, shape, bytes, where its bytes are."""
    out = sys.stdout
    print("arrays:", file=out)
    rows = [("KEY", "DTYPE", "SHAPE", "BYTES", "WHERE")]
    for key, e in m.arrays.items():
        dtype = e.dtype if isinstance(e.dtype, str) else _short(e.dtype, 40)
        if e.shards is not None:
            at = f"{len(e.shards)} shards, " + ", ".join(
                sorted({p.file if p.ref is None else f"{p.ref}/{p.file}" for p in e.shards}))
        else:
            at = ("" if e.ref is None else f"{_shown(e.ref)}/") + f"{e.file}@{e.offset}" + (
                "" if e.codec == "none" else f" ({e.codec}, {human_size(e.length)})"
            )
        rows.append(
            (
                _shown(key),
                _shown(dtype),
                "[" + ", ".join(map(str, e.shape)) + "]",
                human_size(nbytes_of(e)),
                at,
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


def _written_by(writer: dict[str, Any]) -> str:
    """``torch 2.13.0, numpy 2.1.0 (pitstop 0.1.0 on node7, pid 23471)``: the frameworks
    whose adapters captured the state, then pitstop, the host and the pid."""
    who = (f"pitstop {_shown(writer.get('pitstop', '?'))} on "
           f"{_shown(writer.get('host', '?'))}, pid {_shown(writer.get('pid', '?'))}")
    fw = writer.get("frameworks")
    if not isinstance(fw, dict) or not fw:
        return f"{who} (frameworks not recorded: an older pitstop)"
    backend = fw.get("keras.backend")
    parts = []
    for name, version in fw.items():
        if name == "keras.backend":
            continue
        text = f"{_shown(name)} {_shown(version)}"
        if name == "keras" and backend is not None:
            text += f" ({_shown(backend)} backend)"
        parts.append(text)
    if not parts:  # (a backend alone names no framework)
        return f"{who} (frameworks not recorded)"
    return f"{', '.join(parts)} ({who})"
