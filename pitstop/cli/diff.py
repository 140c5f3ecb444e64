"""``pitstop diff A B``: which arrays and values differ between two checkpoints, by how much.

Arrays are matched by key path and compared one pair at a time, hash-verified as a restore
reads them: memory holds at most one array of each side at once, and only a chunk of each
for large plain arrays (:data:`STREAM_MIN`). Two arrays whose stored bytes have the same hash (same hash algorithm, same codec,
same dtype and shape) are equal without a byte being read: a checkpoint compared with itself,
or an incremental one with the checkpoint it references, costs only the manifests.

Equality: by default exact, bit for bit, except that a NaN equals a NaN (whatever its
payload). With ``--atol``/``--rtol``, elements ``a`` (of A, the reference) and ``b`` are equal
when ``|b - a| <= atol + rtol * |a|`` (numpy's ``isclose`` with A as the reference), or both
are NaN, or both are the same infinity. Exit status: 0 equal, 1 they differ, 2 anything else
(a missing, unreadable or corrupt checkpoint, a missing key): 1 only ever means "differ".
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pitstop.core.format.dtypes import ML_DTYPES, decode_dtype
from pitstop.core.format.hashing import new_hasher
from pitstop.core.format.schema import ArrayEntry, Manifest
from pitstop.core.restore.read import CheckpointReader
from pitstop.core.restore.stream import nbytes_of
from pitstop.core.tree import encode_value

DIFFER = 1
#: elements compared per step of a large array (bounds the temporaries to a few of these)
CHUNK = 1 << 20
#: arrays of at least this many bytes, stored whole and plain (uncompressed, unencrypted) on
#: both sides, are read and compared chunk by chunk (their hashes checked at the end)
#: instead of whole: memory is then a chunk of each side, whatever the array's size
STREAM_MIN = 64 << 20

EPILOG = """\
Equality: exact (bit for bit; a NaN equals any NaN) unless --atol/--rtol are given:
then |b - a| <= atol + rtol * |a|, with A the reference. Max rel is |b - a| / |a|.
Exit status: 0 identical, 1 they differ, 2 any error (missing or corrupt checkpoint).
More: pitstop diff runs/a runs/b (newest of each); pitstop diff runs/a/step_0000000100
runs/b --step-b 100 --atol 1e-6.

example:
  pitstop diff runs/a --step 100 --step 200
"""


def add_parser(sub: Any) -> None:
    """Register ``pitstop diff`` on the subcommands of ``build_parser``."""
    s = sub.add_parser(
        "diff", help="which arrays and values differ between two checkpoints, and by how much",
        description="Compare two checkpoints array by array (max abs and relative "
        "difference, differing elements) and value by value. A and B are each a run "
        "directory (newest checkpoint, or --step) or a checkpoint's own path; with one run "
        "directory, --step twice compares two of its steps (no --step: its two newest).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("a", metavar="A")
    s.add_argument("b", metavar="B", nargs="?", help="default: A again (give two --step)")
    s.add_argument("--step", type=int, action="append", default=[], metavar="N",
                   help="once: the step of both; twice: of A, then of B")
    s.add_argument("--step-a", type=int, metavar="N", help="the step of A")
    s.add_argument("--step-b", type=int, metavar="N", help="the step of B")
    s.add_argument("--atol", type=float, default=None, metavar="X",
                   help="absolute tolerance (default: exact)")
    s.add_argument("--rtol", type=float, default=None, metavar="X",
                   help="relative tolerance, of |a| (default: exact)")
    s.add_argument("--json", action="store_true", help="print the result as one JSON object")
    s.set_defaults(func=cmd_diff)


# ====================================================================== comparing arrays
@dataclass
class ArrayDiff:
    """How two arrays of the same dtype and shape differ (``differ == 0``: they do not)."""

    size: int = 0
    differ: int = 0
    #: over the differing elements whose values are both finite (None: no such element,
    #: or a dtype without arithmetic: strings, structured)
    max_abs: float | None = None
    max_rel: float | None = None
    #: differing elements where one side is NaN or infinite and the other is not the same
    nonfinite: int = 0


def _floatish(dt: np.dtype) -> bool:
    return dt.kind in "fc" or ML_DTYPES.is_float(dt)


def _bits(x: np.ndarray) -> np.ndarray:
    """A flat array whose elements compare equal exactly when ``x``'s bits are equal."""
    size = x.dtype.itemsize
    flat = x.reshape(-1)
    if size in (1, 2, 4, 8) and not x.dtype.hasobject:
        return flat.view(f"u{size}")
    return flat.view(np.uint8).reshape(flat.size, size) if flat.size else flat.view(np.uint8)


def _unequal_bits(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per element of two flat arrays: whether their bits differ."""
    ne = _bits(a) != _bits(b)
    return ne.any(axis=1) if ne.ndim == 2 else ne


def _as_number(x: np.ndarray) -> np.ndarray:
    """The values as float64 / complex128 (for differences)."""
    if x.dtype.kind == "c":
        return x.astype(np.complex128)
    if x.dtype.kind == "b":
        return x.astype(np.int8).astype(np.float64)
    return x.astype(np.float64)


def compare_arrays(a: np.ndarray, b: np.ndarray, atol: float | None,
                   rtol: float | None) -> ArrayDiff:
    """Compare two arrays of one dtype and shape, :data:`CHUNK` elements at a time."""
    out = ArrayDiff(size=int(a.size))
    fa, fb = a.reshape(-1), b.reshape(-1)
    dt = a.dtype
    numeric = (dt.kind in "biufc" or ML_DTYPES.is_float(dt)) and dt.fields is None
    floaty = _floatish(dt)
    tolerant = atol is not None or rtol is not None
    at, rt = atol or 0.0, rtol or 0.0
    for lo in range(0, fa.size, CHUNK):
        ca, cb = fa[lo:lo + CHUNK], fb[lo:lo + CHUNK]
        if not numeric:  # strings, dates, structured, ml_dtypes ints: count elements only
            out.differ += int(_unequal_bits(ca, cb).sum())
            continue
        if not tolerant:
            ne = _unequal_bits(ca, cb)
            if not ne.any():
                continue
            na, nb = _as_number(ca[ne]), _as_number(cb[ne])
            if floaty:
                both_nan = np.isnan(na) & np.isnan(nb)
                na, nb = na[~both_nan], nb[~both_nan]
        else:
            na, nb = _as_number(ca), _as_number(cb)
            close = np.zeros(na.shape, bool)
            with np.errstate(invalid="ignore", over="ignore"):
                close |= np.abs(nb - na) <= at + rt * np.abs(na)
            if floaty:
                close |= np.isnan(na) & np.isnan(nb)
                close |= np.isinf(na) & (na == nb)
            na, nb = na[~close], nb[~close]
        out.differ += int(na.size)
        if not na.size or not numeric:
            continue
        finite = np.isfinite(na) & np.isfinite(nb)
        out.nonfinite += int(na.size - finite.sum())
        na, nb = na[finite], nb[finite]
        if not na.size:
            continue
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            d = np.abs(nb - na)
            r = np.where(d == 0, 0.0, d / np.abs(na))
        m = float(d.max())
        out.max_abs = m if out.max_abs is None else max(out.max_abs, m)
        mr = float(r.max())
        out.max_rel = mr if out.max_rel is None else max(out.max_rel, mr)
    return out


def _same_stored(ma: Manifest, ea: ArrayEntry, mb: Manifest, eb: ArrayEntry) -> bool:
    """Whether the two entries hold the same stored bytes, by their recorded hashes (same
    algorithm and codec): then the arrays are equal without reading them."""
    if ma.hash_algorithm != mb.hash_algorithm or len(ea.parts) != len(eb.parts):
        return False
    if ma.encryption is not None or mb.encryption is not None:
        return False  # (random nonces: equal plaintexts never have equal stored bytes)
    return all(pa.hash and pa.hash == pb.hash and pa.codec == pb.codec
               and pa.length == pb.length and pa.index == pb.index
               for pa, pb in zip(ea.parts, eb.parts, strict=True))


# ====================================================================== the command
@dataclass
class Side:
    """One checkpoint being compared."""

    label: str
    where: str
    reader: CheckpointReader
    stack: Any = None

    @property
    def manifest(self) -> Manifest:
        return self.reader.manifest


@dataclass
class Result:
    #: (key, its type)
    only_a: list[tuple[str, str]] = field(default_factory=list)
    only_b: list[tuple[str, str]] = field(default_factory=list)
    #: (ranks of A, ranks of B) when they differ (None: the same)
    world: tuple[int, int] | None = None
    changed_type: list[tuple[str, str, str]] = field(default_factory=list)
    arrays: list[tuple[str, str, ArrayDiff]] = field(default_factory=list)
    same_arrays: int = 0
    same_by_hash: int = 0
    values: list[tuple[str, str, str]] = field(default_factory=list)
    same_values: int = 0

    @property
    def differs(self) -> bool:
        return bool(self.only_a or self.only_b or self.changed_type or self.arrays
                    or self.values or self.world)


def _clipped(text: str, at: int, width: int = 64) -> str:
    """A value as the text output shows it, around ``at`` (where the two sides first
    differ): an RNG state is some 20 KB of numbers, which would fill the terminal and hide
    the difference; ``--json`` has every value whole."""
    if len(text) <= width:
        return text
    start = max(0, min(at - width // 3, len(text) - width))
    return (("..." if start else "") + text[start:start + width]
            + ("..." if start + width < len(text) else "") + f" ({len(text):,} chars)")


def _type_text(e: ArrayEntry) -> str:
    dt = decode_dtype(e.dtype)
    name = e.dtype if isinstance(e.dtype, str) and e.dtype[:1] not in "<>|=" else dt.name
    return f"{name} [{', '.join(map(str, e.shape))}]"


def _value_text(v: Any) -> str:
    return json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _steps(args: argparse.Namespace) -> tuple[int | None, int | None]:
    from pitstop.cli.common import CliError
    one = args.b is None
    if len(args.step) > 2:
        raise CliError("--step is given at most twice (the step of A, then of B)")
    if args.step and (args.step_a is not None or args.step_b is not None):
        raise CliError("give either --step (once or twice) or --step-a/--step-b, not both")
    if len(args.step) == 2:
        return args.step[0], args.step[1]
    if len(args.step) == 1:
        if one:
            raise CliError(
                f"one checkpoint to compare with itself: give a second --step (pitstop diff "
                f"{args.a} --step {args.step[0]} --step M) or a second checkpoint B")
        return args.step[0], args.step[0]
    return args.step_a, args.step_b


def _open_side(path: str, step: int | None, label: str, newest: int = 0) -> Side:
    """The checkpoint ``path`` names (``newest``: 1 for the one before the newest)."""
    import contextlib

    from pitstop.cli.common import CliError, _checked, _lease, _locate, _pick_live, _reader, _scan
    storage, want = _locate(path, step, None, "diff")
    if newest and want is not None:
        raise CliError(f"{path} is one checkpoint (step {want}): give B, the checkpoint to "
                       "compare it with")
    if want is None and newest:
        steps = _scan(storage).steps
        if len(steps) < 2:
            raise CliError(f"{storage.location}: has {len(steps)} checkpoint(s); to compare "
                           "its two newest it needs two (or give B)")
        want = steps[-1 - newest]
    picked, naming = _pick_live(storage, want, "diff")
    name = naming.name(picked)
    where = storage.path_of(name)
    stack = contextlib.ExitStack()
    stack.enter_context(_lease(storage, name))
    try:
        reader = _reader(storage, name, naming)
        _checked(reader, where)
    except CliError as e:
        stack.close()
        raise CliError(f"{label}: {e}") from None
    return Side(label, where, reader, stack)


def diff(a: Side, b: Side, atol: float | None, rtol: float | None) -> Result:
    """Compare two open checkpoints (arrays read one pair at a time). A checkpoint several
    ranks wrote holds each rank's own state (its RNG stream, its sampler's position): the
    keys that differ between ranks on either side are compared for every rank, as
    ``"key (rank r)"``."""
    ma, mb = a.manifest, b.manifest
    res = Result()
    _compare(a, b, ma, mb, atol, rtol, res, None, "")
    if ma.world != mb.world:
        res.world = (ma.world, mb.world)
        return res
    mine = set(ma.rank_specific()) | set(mb.rank_specific())
    for r in range(1, ma.world if mine else 1):
        _compare(a, b, ma.view(r), mb.view(r), atol, rtol, res, mine, f" (rank {r})")
    return res


def _compare(a: Side, b: Side, ma: Manifest, mb: Manifest, atol: float | None,
             rtol: float | None, res: Result, only: set[str] | None, tag: str) -> None:
    """Add to ``res`` how views ``ma`` and ``mb`` differ (only the keys ``only``, when
    given; each key reported with ``tag`` after it)."""
    def wanted(k: str) -> bool:
        return only is None or k in only

    only_a = [k for k in ma.arrays if k not in mb.arrays and wanted(k)]
    only_b = [k for k in mb.arrays if k not in ma.arrays and wanted(k)]
    for key, ea in ma.arrays.items():
        eb = mb.arrays.get(key)
        if eb is None or not wanted(key):
            continue
        ta, tb = _type_text(ea), _type_text(eb)
        if decode_dtype(ea.dtype) != decode_dtype(eb.dtype) or list(ea.shape) != list(eb.shape):
            res.changed_type.append((key + tag, ta, tb))
            continue
        if _same_stored(ma, ea, mb, eb):
            res.same_arrays += 1
            res.same_by_hash += 1
            continue
        if _streamable(a, ea) and _streamable(b, eb) and nbytes_of(ea) >= STREAM_MIN:
            d = _compare_streamed(a, b, key, ea, eb, atol, rtol)
        else:
            xa = _read(a, key, ea)
            xb = _read(b, key, eb)
            d = compare_arrays(xa, xb, atol, rtol)
            del xa, xb
        if d.differ:
            res.arrays.append((key + tag, ta, d))
        else:
            res.same_arrays += 1
    va, vb = ma.values, mb.values
    for key in list(va) + [k for k in vb if k not in va]:
        if not wanted(key):
            continue
        if key in ma.arrays or key in mb.arrays:
            # a value on one side, an array on the other
            res.changed_type.append((key + tag, _type_text(ma.arrays[key]) if key in
                                     ma.arrays else "value", _type_text(mb.arrays[key])
                                     if key in mb.arrays else "value"))
            only_a = [k for k in only_a if k != key]
            only_b = [k for k in only_b if k != key]
            continue
        ta = _value_text(va[key]) if key in va else "(absent)"
        tb = _value_text(vb[key]) if key in vb else "(absent)"
        if ta == tb:
            res.same_values += 1
        else:
            res.values.append((key + tag, ta, tb))
    res.only_a += [(k + tag, _type_text(ma.arrays[k])) for k in only_a]
    res.only_b += [(k + tag, _type_text(mb.arrays[k])) for k in only_b]


def _streamable(side: Side, entry: ArrayEntry) -> bool:
    """Stored whole and plain: its bytes are the array's, readable piece by piece."""
    return (entry.shards is None and entry.codec == "none"
            and side.manifest.encryption is None)


def _merge(total: ArrayDiff, part: ArrayDiff) -> None:
    total.size += part.size
    total.differ += part.differ
    total.nonfinite += part.nonfinite
    for name in ("max_abs", "max_rel"):
        mine, theirs = getattr(total, name), getattr(part, name)
        if theirs is not None:
            setattr(total, name, theirs if mine is None else max(mine, theirs))


def _compare_streamed(a: Side, b: Side, key: str, ea: ArrayEntry, eb: ArrayEntry,
                      atol: float | None, rtol: float | None) -> ArrayDiff:
    """:func:`compare_arrays` of two plain arrays read :data:`CHUNK` elements at a time
    from both checkpoints, each side's hash checked once its last chunk is read (a
    mismatch is an error: nothing is reported of a checkpoint whose bytes changed)."""
    from pitstop.cli.common import CliError, _failure
    dt = decode_dtype(ea.dtype)
    n = math.prod(ea.shape)
    total = ArrayDiff()
    sides = [(a, ea, new_hasher(a.manifest.hash_algorithm), np.empty(min(n, CHUNK), dt)),
             (b, eb, new_hasher(b.manifest.hash_algorithm), np.empty(min(n, CHUNK), dt))]
    for lo in range(0, n, CHUNK):
        got = []
        for side, entry, h, buf in sides:
            part = buf[:min(CHUNK, n - lo)]
            raw = part.view(np.uint8)
            try:
                read = side.reader.storage.read_into(
                    entry.ref or side.reader.name, entry.file,
                    entry.offset + lo * dt.itemsize, raw)
            except Exception as e:  # noqa: BLE001 - a vanished file, an I/O error
                _code, why = _failure(e, side.where)
                raise CliError(f"{side.label}: {why}") from None
            if read != raw.nbytes:
                raise CliError(f"{side.label}: {side.where}: array {key!r} in {entry.file}: "
                               "the data file ends early (truncated)")
            h.update(raw)
            got.append(part)
        _merge(total, compare_arrays(got[0], got[1], atol, rtol))
    for side, entry, h, _buf in sides:
        if h.hexdigest() != entry.hash:
            raise CliError(f"{side.label}: {side.where}: array {key!r} in {entry.file} at "
                           f"offset {entry.offset}: hash mismatch: expected {entry.hash}, "
                           f"found {h.hexdigest()} (the bytes on disk changed)")
    return total


def _read(side: Side, key: str, entry: ArrayEntry) -> np.ndarray:
    from pitstop.cli.common import CliError, _failure
    try:
        return side.reader.read_array(key, entry)
    except MemoryError:
        raise CliError(f"{side.where}: no memory left to read array {key!r} "
                       f"({nbytes_of(entry)} bytes)") from None
    except Exception as e:  # noqa: BLE001 - corrupt bytes, a vanished file, ...
        _code, why = _failure(e, side.where)
        raise CliError(f"{side.label}: {why}") from None


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:.6g}"


def _context(side: Side) -> str:
    from pitstop.cli.common import _metric_text
    m = side.manifest
    world = f", {m.world} ranks (each rank's own state compared)" if m.world > 1 else ""
    return (f"{side.label}: {side.where} (step {m.step}, {len(m.arrays)} arrays, "
            f"metrics: {_metric_text(m.metrics)}{world})")


def cmd_diff(args: argparse.Namespace) -> int:
    """``pitstop diff``: exit 0 identical, 1 they differ, 2 an error."""
    from pitstop.cli.common import CliError, _encryption, _one_line, _shown
    for name in ("atol", "rtol"):
        v = getattr(args, name)
        if v is not None and not (v >= 0 and math.isfinite(v)):
            raise CliError(f"--{name} {v}: give a finite tolerance >= 0")
    _encryption()  # a malformed key is said once, before any checkpoint is read
    step_a, step_b = _steps(args)
    same_path = args.b is None
    a = _open_side(args.a, step_a, "A", newest=1 if same_path and step_a is None else 0)
    try:
        b = _open_side(args.b if args.b is not None else args.a, step_b, "B")
        try:
            res = diff(a, b, args.atol, args.rtol)
        finally:
            b.stack.close()
    finally:
        a.stack.close()
    rule = "exact (bitwise; NaN equals NaN)" if args.atol is None and args.rtol is None else \
        f"|b - a| <= {args.atol or 0:g} + {args.rtol or 0:g} * |a| (NaN equals NaN)"
    if args.json:
        doc = {
            "a": {"path": a.where, "step": a.manifest.step, "metrics": encode_value(a.manifest.metrics)},
            "b": {"path": b.where, "step": b.manifest.step, "metrics": encode_value(b.manifest.metrics)},
            "equality": rule, "identical": not res.differs,
            "only_in_a": [k for k, _t in res.only_a],
            "only_in_b": [k for k, _t in res.only_b],
            "ranks": {"a": a.manifest.world, "b": b.manifest.world},
            "type_changed": [{"key": k, "a": ta, "b": tb} for k, ta, tb in res.changed_type],
            "arrays": [{"key": k, "type": t, "elements": d.size, "differ": d.differ,
                        "max_abs": _json_num(d.max_abs), "max_rel": _json_num(d.max_rel), "nonfinite": d.nonfinite}
                       for k, t, d in res.arrays],
            "values": [{"key": k, "a": json.loads(ta) if ta != "(absent)" else None,
                        "b": json.loads(tb) if tb != "(absent)" else None}
                       for k, ta, tb in res.values],
            "same_arrays": res.same_arrays, "same_by_hash": res.same_by_hash,
            "same_values": res.same_values,
        }
        print(json.dumps(doc, allow_nan=False))
        return DIFFER if res.differs else 0
    out = sys.stdout
    print(_context(a), file=out)
    print(_context(b), file=out)
    if res.world is not None:
        print(f"ranks: A was written by {res.world[0]}, B by {res.world[1]} (rank 0's views "
              "compared: per-rank state cannot match)", file=out)
    for k, t in res.only_a:
        print(f"only in A: {_shown(k)} ({t})", file=out)
    for k, t in res.only_b:
        print(f"only in B: {_shown(k)} ({t})", file=out)
    for k, ta, tb in res.changed_type:
        print(f"changed type: {_shown(k)}: {ta} -> {tb}", file=out)
    for k, t, d in res.arrays:
        frac = 100.0 * d.differ / d.size if d.size else 0.0
        line = (f"differs: {_shown(k)} ({t}): {d.differ} of {d.size} elements "
                f"({frac:.3g}%)")
        if d.max_abs is not None:
            line += f", max abs {_num(d.max_abs)}, max rel {_num(d.max_rel)}"
        if d.nonfinite:
            line += f", {d.nonfinite} NaN/inf on one side only"
        print(line, file=out)
    for k, ta, tb in res.values:
        whole = (_one_line(ta), _one_line(tb))
        at = next((i for i, (x, y) in enumerate(zip(*whole, strict=False)) if x != y),
                  min(map(len, whole)))
        shown = tuple(_clipped(w, at) for w in whole)
        note = " (--json: the whole values)" if shown != whole else ""
        print(f"value: {_shown(k)}: {shown[0]} -> {shown[1]}{note}", file=out)
    hashed = f" ({res.same_by_hash} by stored hash, not read)" if res.same_by_hash else ""
    print(f"equal: {res.same_arrays} arrays{hashed}, {res.same_values} values; "
          f"equality: {rule}", file=out)
    if res.differs:
        parts = [(len(res.arrays), "array(s) differ"), (len(res.changed_type),
                  "changed type or shape"), (len(res.only_a), "only in A"),
                 (len(res.only_b), "only in B"), (len(res.values), "value(s) differ"),
                 (1 if res.world else 0, "different number of ranks")]
        print("different: " + ", ".join(f"{n} {w}" for n, w in parts if n), file=out)
        return DIFFER
    print("identical", file=out)
    return 0


def _json_num(x: float | None) -> Any:
    """A number for JSON, which has no infinity: ``"inf"`` then."""
    return "inf" if x is not None and math.isinf(x) else x


__all__ = ["add_parser", "cmd_diff", "compare_arrays", "diff"]
