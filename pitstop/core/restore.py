"""Putting one checkpoint back into live objects: checked first, then written, then applied.

A restore runs in four phases, so that a restore refused for any reason that can be known
without the data leaves the target exactly as it was:

1. **plan** (manifest only): match every key of the target against the checkpoint (arrays by
   shape and dtype, values by kind), decide which subtrees are rebuilt from the checkpoint
   (an empty optimizer state, an adapter with ``replace_on_mismatch``), and refuse a target
   whose root cannot be changed in place.
2. **check** (still no data): every array leaf that will be written says whether it can be
   (``check_restorable``: read-only, overlapping memory) and every adapter whose object is
   restored checks the checkpoint's subtree (``check``: parameter groups, dataset length...).
3. **data**: fresh arrays (rebuilt subtrees, numpy scalars) are read first, then every other
   array streams straight into its live buffer, each verified against its hash. Corruption
   found here raises :class:`CorruptCheckpointError` listing what was already overwritten.
4. **apply**: values are merged into the live containers in place (same dict, list,
   OrderedDict, defaultdict; tuples and namedtuples rebuilt as their own type and put back
   into their parent), numpy scalars replaced, and adapters' ``apply`` called innermost first.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .dtypes import decode_dtype
from .errors import CheckpointError, CorruptCheckpointError, IncompatibleTargetError
from .manifest import ArrayEntry, Manifest
from .tree import ArraySpec, FlatState, decode_value, split, unflatten

if TYPE_CHECKING:
    from .reader import CheckpointReader

ROOT = "<root>"


@dataclass
class RestoreReport:
    """Keys that did not match, as ``load_state_dict`` reports them."""

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    mismatched_keys: list[str] = field(default_factory=list)
    #: mismatched key -> what differs (for the error message)
    details: dict[str, str] = field(default_factory=dict)


class RestoredStep(int):
    """The restored step (an int), carrying what did not match under ``strict=False``."""

    missing_keys: list[str]
    unexpected_keys: list[str]
    mismatched_keys: list[str]

    def __new__(cls, step: int, report: RestoreReport | None = None) -> RestoredStep:
        obj = super().__new__(cls, step)
        report = report or RestoreReport()
        obj.missing_keys = report.missing_keys
        obj.unexpected_keys = report.unexpected_keys
        obj.mismatched_keys = report.mismatched_keys
        return obj


# ---------------------------------------------------------------------- key paths
class _Keys:
    """A sorted set of key paths answering "which keys lie under this prefix" by bisection."""

    def __init__(self, keys: Iterable[str]) -> None:
        self.keys = sorted(set(keys))
        self.set = set(self.keys)

    def under(self, prefix: str) -> list[str]:
        """Keys equal to ``prefix`` or below it (every key for the root, ``""``)."""
        if not prefix or prefix == ROOT:
            return list(self.keys)
        lo = bisect.bisect_left(self.keys, prefix + "/")
        hi = bisect.bisect_left(self.keys, prefix + "0")  # "0" follows "/" in code points
        out = self.keys[lo:hi]
        if prefix in self.set:
            out.append(prefix)
        return out


def _is_under(key: str, prefix: str) -> bool:
    return not prefix or key == prefix or key.startswith(prefix + "/")


def _root_key(path: str) -> str:
    return path or ROOT


# ---------------------------------------------------------------------- the plan
class RestorePlan:
    """One checkpoint (``reader``) matched against one target (``flat``); see the module."""

    def __init__(self, reader: CheckpointReader, flat: FlatState, strict: bool) -> None:
        self.reader = reader
        self.m: Manifest = reader.manifest
        self.flat = flat
        self.strict = strict
        self.where = reader.where
        self.report = RestoreReport()
        #: keys (target side) that are not written: mismatched, or skipped with strict=False
        self.bad: set[str] = set()
        #: prefixes whose whole subtree comes fresh from the checkpoint (value -> subtree)
        self.rebuilt: dict[str, Any] = {}
        #: adapter paths whose object gets the checkpoint's subtree instead (replace_on_mismatch)
        self.replaced: dict[str, Any] = {}
        #: adapter paths left out entirely (strict=False and the adapter refused)
        self.skipped_adapters: set[str] = set()
        #: numpy-scalar keys whose checkpoint string length differs (replaced anyway)
        self.resized: set[str] = set()
        #: numpy scalars read (as 0-d arrays), put back as scalars in the apply phase
        self.scalars: dict[str, np.ndarray] = {}
        self.ck = _Keys(())
        #: target entries already written (for the message when corruption stops a restore)
        self.written: list[str] = []
        self._written_lock = threading.Lock()

    # ------------------------------------------------------------------ 1. plan
    def plan(self) -> None:
        m, flat = self.m, self.flat
        ck = self.ck = _Keys([*m.arrays, *m.values])
        target = _Keys([*flat.arrays, *flat.values])
        self._choose_replaced(ck, target)
        replaced = list(self.replaced)

        def in_replaced(key: str) -> bool:
            return bool(replaced) and any(_is_under(key, p) for p in replaced)

        # a target value whose path prefixes checkpoint entries (e.g. an optimizer's empty
        # state before its first step) is rebuilt whole from the checkpoint
        for key in flat.values:
            if key not in ck.set and not in_replaced(key) and ck.under(key):
                self.rebuilt[key] = None  # read in the data phase
        covered = {k for p in self.rebuilt for k in ck.under(p)}
        for p in replaced:
            covered.update(ck.under(p))

        r = self.report
        for key, leaf in flat.arrays.items():
            if in_replaced(key):
                continue
            e = m.arrays.get(key)
            if e is None:
                if key in m.values:
                    self._mismatch(key, "array in the target, value in the checkpoint")
                else:
                    r.missing_keys.append(key)
                    self.bad.add(key)
                continue
            dtype = decode_dtype(e.dtype)
            if (key in flat.scalars and dtype != leaf.dtype and dtype.kind == leaf.dtype.kind
                    and dtype.kind in "US" and not e.shape):
                self.resized.add(key)  # np.str_ / np.bytes_ of another length: replaced anyway
            elif tuple(e.shape) != tuple(leaf.shape) or dtype != leaf.dtype:
                self._mismatch(key, f"checkpoint {dtype}{list(e.shape)}, "
                                    f"target {leaf.dtype}{list(leaf.shape)}")
        for key in flat.values:
            if in_replaced(key) or key in self.rebuilt:
                continue
            if key in m.arrays and key not in m.values:
                self._mismatch(key, "value in the target, array in the checkpoint")
            elif key not in m.values:
                r.missing_keys.append(key)
                self.bad.add(key)
        r.unexpected_keys = sorted(k for k in ck.keys if k not in target.set and k not in covered)
        self._check_root()
        if self.strict and (r.missing_keys or r.unexpected_keys or r.mismatched_keys):
            raise IncompatibleTargetError(
                describe_mismatch(self.where, r, target, ck), missing=r.missing_keys,
                unexpected=r.unexpected_keys, mismatched=r.mismatched_keys)

    def _mismatch(self, key: str, what: str) -> None:
        self.report.mismatched_keys.append(key)
        self.report.details[key] = what
        self.bad.add(key)

    def _choose_replaced(self, ck: _Keys, target: _Keys) -> None:
        """Adapters that restore like ``load_state_dict`` (replace) and whose subtree in the
        checkpoint differs from the captured one: their object gets the checkpoint's."""
        m, flat = self.m, self.flat
        for path, node in flat.adapters:
            if not getattr(node.adapter, "replace_on_mismatch", False):
                continue
            if any(_is_under(path, p) for p in self.replaced):
                continue
            mine = target.under(path) if path else target.keys
            theirs = ck.under(path) if path else ck.keys
            if not theirs:
                continue  # nothing of it in the checkpoint: reported as missing
            same = set(mine) == set(theirs)
            if same:
                for k in mine:
                    leaf = flat.arrays.get(k)
                    e = m.arrays.get(k)
                    if (leaf is None) != (e is None) or (leaf is not None and e is not None and (
                            tuple(e.shape) != tuple(leaf.shape)
                            or decode_dtype(e.dtype) != leaf.dtype)):
                        same = False
                        break
            if not same:
                self.replaced[path] = None  # read in the data phase

    def _check_root(self) -> None:
        """A value or numpy scalar that only an immutable root could hold cannot be put back:
        refuse before writing anything (a value equal to the checkpoint's is fine)."""
        flat, m = self.flat, self.m
        root = flat.root
        what = None
        if ROOT in flat.values and ROOT not in flat.parents:
            if not isinstance(root, (MutableMapping, list, bytearray)) and ROOT in m.values \
                    and not _same(root, decode_value(m.values[ROOT])):
                what = f"a {type(root).__name__} (immutable) whose value changes"
        elif ROOT in flat.scalars and ROOT not in self.bad:
            what = "a numpy scalar (immutable)"
        else:
            for key, (container, _k) in [*flat.parents.items(), *flat.scalars.items()]:
                if key in self.bad or not self._chained_to_root(container):
                    continue
                if key in flat.scalars or (key in m.values and not _same(
                        container[_k], decode_value(m.values[key]))):
                    what = f"a {type(root).__name__} (immutable) and its entry {key!r} changes"
                    break
        if what is not None:
            raise IncompatibleTargetError(
                f"cannot restore {self.where} into this state: the state is {what}, so it "
                "cannot be restored in place. Pass a dict or a list (e.g. {'state': state}), "
                "or use load() to get a new object.")

    def _chained_to_root(self, container: Any) -> bool:
        """True when ``container`` is a tuple whose ancestors are tuples up to the root."""
        tuples = self.flat.tuples
        while isinstance(container, tuple):
            info = tuples.get(id(container))
            if info is None:
                return False
            _path, parent, _key = info
            if parent is None:
                return True
            container = parent
        return False

    # ------------------------------------------------------------------ 2. check
    def check(self) -> None:
        """Every precondition a live object states, before a byte is written to one."""
        flat, m = self.flat, self.m
        problems: list[str] = []
        refused: list[str] = []
        replaced = list(self.replaced)
        for key, leaf in flat.arrays.items():
            if key in self.bad or key not in m.arrays or key in flat.scalars \
                    or (replaced and any(_is_under(key, p) for p in replaced)):
                continue
            check = getattr(leaf, "check_restorable", None)
            if check is None:
                continue
            try:
                check()
            except CheckpointError as e:
                if self.strict:
                    problems.append(f"{key}: {e}")
                    refused.append(key)
                else:
                    self._mismatch(key, str(e))
        for path, node in flat.adapters:
            check = getattr(node.adapter, "check", None)
            if check is None or any(_is_under(path, p) for p in self.skipped_adapters):
                continue
            key = _root_key(path)
            if not self._present(path):
                continue
            try:
                check(node.obj, self.subtree(path, _spec))
            except Exception as e:  # noqa: BLE001 - an adapter's refusal, whatever it raised
                text = f"{key} ({type(node.obj).__name__}): {e}"
                if self.strict:
                    problems.append(text)
                    refused.append(key)
                else:
                    self.skipped_adapters.add(path)
                    self._mismatch(key, str(e))
        if problems:
            raise IncompatibleTargetError(
                f"cannot restore {self.where} into this state (nothing was changed):\n  "
                + "\n  ".join(problems), mismatched=refused)

    def _present(self, path: str) -> bool:
        return bool(self.ck.under(path)) if path else bool(self.ck.keys)

    # ------------------------------------------------------------------ 3. data
    def read(self) -> None:
        """Fresh arrays first (nothing live is touched if they are corrupt), then stream the
        rest into the live buffers."""
        flat, m, reader = self.flat, self.m, self.reader
        reader.check_files()
        for p in self.rebuilt:
            self.rebuilt[p] = self.subtree(p, reader.read_array)
        for p in self.replaced:
            self.replaced[p] = self.subtree(p, reader.read_array)
        scalars = [k for k in flat.scalars if k in m.arrays and k not in self._skip()]
        for key in scalars:
            if key in self.resized:
                self.scalars[key] = reader.read_array(key, m.arrays[key])
            else:
                leaf = flat.arrays[key]
                self.scalars[key] = reader.read_array(
                    key, m.arrays[key], leaf.array)  # type: ignore[attr-defined]
        skip = self._skip()
        todo = [(k, leaf, m.arrays[k]) for k, leaf in flat.arrays.items()
                if k in m.arrays and k not in skip and k not in flat.scalars]
        todo.sort(key=lambda t: (t[2].file, t[2].offset))

        def restore_one(item: tuple[str, Any, ArrayEntry]) -> None:
            key, leaf, entry = item
            view = leaf.host_view()
            try:
                if view is not None:
                    reader.read_array(key, entry, view)
                else:
                    leaf.assign(reader.read_array(key, entry))
            finally:
                with self._written_lock:
                    self.written.append(key)

        try:
            reader.per_file(todo, restore_one)
        except CorruptCheckpointError as e:
            e.overwritten = sorted(self.written)
            if self.written:
                n = len(e.overwritten)
                some = ", ".join(e.overwritten[:10]) + (f" (+{n - 10} more)" if n > 10 else "")
                e.args = (f"{e.args[0]}. The restore had already overwritten {n} entr"
                          f"{'y' if n == 1 else 'ies'} of the target: {some}",)
            raise

    def _skip(self) -> set[str]:
        skip = set(self.bad)
        for p in (*self.replaced, *self.skipped_adapters):
            skip.update(k for k in self.flat.arrays if _is_under(k, p))
        return skip

    def subtree(self, prefix: str, leaf: Callable[[str, ArrayEntry], Any]) -> Any:
        """The checkpoint's subtree at ``prefix``, arrays made by ``leaf(key, entry)``."""
        m = self.m
        key = _root_key(prefix)
        if key in m.values:
            return decode_value(m.values[key])
        if key in m.arrays:
            return leaf(key, m.arrays[key])
        node = m.structure
        for comp in split(prefix):
            node = _child(node, comp)
            if node is None:
                break
        leaves: dict[str, Any] = {}
        for k, e in m.arrays.items():
            if _is_under(k, prefix):
                leaves[k] = leaf(k, e)
        for k, v in m.values.items():
            if _is_under(k, prefix):
                leaves[k] = decode_value(v)
        if node is None:
            return leaves
        return unflatten(node, leaves, prefix)

    # ------------------------------------------------------------------ 4. apply
    def apply(self) -> None:
        flat, m = self.flat, self.m
        skip = self._skip()
        pending: dict[int, dict[Any, Any]] = {}

        def put(container: Any, key: Any, new: Any) -> None:
            if isinstance(container, tuple):
                pending.setdefault(id(container), {})[key] = new
            else:
                container[key] = new

        aside = [*self.replaced, *self.skipped_adapters]
        for key in flat.values:
            if key in skip:
                continue
            if aside and any(_is_under(key, p) for p in aside):
                continue
            if key in self.rebuilt:
                new = self.rebuilt[key]
            elif key in m.values:
                new = decode_value(m.values[key])
            else:
                continue
            parent = flat.parents.get(key)
            old = flat.root if parent is None else parent[0][parent[1]]
            merged = merge(old, new)
            if merged is not old:
                if parent is None:
                    raise AssertionError("the plan refuses a root that cannot change in place")
                put(parent[0], parent[1], merged)
        for key, (container, k) in flat.scalars.items():
            if key not in self.scalars or container is None:
                continue
            put(container, k, self.scalars[key][()])
        # rebuild the tuples that changed, innermost first, each put back into its parent
        while pending:
            tid = max(pending, key=lambda t: len(flat.tuples[t][0]))
            changes = pending.pop(tid)
            path, parent, key = flat.tuples[tid]
            old = parent[key] if parent is not None else flat.root
            new = _rebuild_tuple(old, [changes.get(i, x) for i, x in enumerate(old)])
            if parent is None:
                raise AssertionError("the plan refuses a root tuple whose content changes")
            put(parent, key, new)
        done: list[str] = []
        for path, node in flat.adapters:
            if path in self.skipped_adapters or any(
                    _is_under(path, p) and path != p for p in self.replaced):
                continue
            tree = self.replaced[path] if path in self.replaced else node.tree
            try:
                node.adapter.apply(node.obj, tree)
            except Exception as e:  # noqa: BLE001 - reported with where it happened
                key = _root_key(path)
                raise IncompatibleTargetError(
                    f"cannot restore {self.where}: putting back {key} "
                    f"({type(node.obj).__name__}) failed: {type(e).__name__}: {e}. Its arrays "
                    f"and {len(done)} other object(s) were already restored"
                    f"{': ' + ', '.join(done[:10]) if done else ''}; restore again into a "
                    "matching state, or rebuild the objects.", mismatched=[key]) from e
            done.append(_root_key(path))


def _spec(key: str, entry: ArrayEntry) -> ArraySpec:
    return ArraySpec(tuple(entry.shape), decode_dtype(entry.dtype))


def _child(node: Any, comp: str) -> Any:
    """The structure node of one path component below ``node`` (None if absent)."""
    while isinstance(node, dict) and "$o" in node:
        node = node["$o"]
    if not isinstance(node, dict):
        return None
    if "$d" in node:
        for k, sub in node["$d"]:
            if str(k) == comp:
                return sub
        return None
    seq = node.get("$l", node.get("$t"))
    if seq is not None and comp.isdigit() and int(comp) < len(seq):
        return seq[int(comp)]
    return None


# ---------------------------------------------------------------------- merging values
def merge(live: Any, new: Any) -> Any:
    """Put the restored value ``new`` where ``live`` is: mutable containers are updated in
    place and keep their type (dict, OrderedDict, defaultdict, list, bytearray), nested ones
    too, so aliases the program holds stay the restored objects; tuples (namedtuples too) are
    rebuilt as their own type. Returns the object to keep in the parent: ``live`` itself
    when it was updated in place."""
    if isinstance(live, MutableMapping) and isinstance(new, Mapping):
        items = [(k, merge(live[k], v) if k in live else v) for k, v in new.items()]
        live.clear()
        live.update(items)
        return live
    if isinstance(live, list) and isinstance(new, (list, tuple)):
        live[:] = [merge(live[i], v) if i < len(live) else v for i, v in enumerate(new)]
        return live
    if isinstance(live, bytearray) and isinstance(new, (bytes, bytearray)):
        live[:] = new
        return live
    if isinstance(live, tuple) and isinstance(new, (tuple, list)) and len(live) == len(new):
        items = [merge(x, v) for x, v in zip(live, new, strict=True)]
        if all(a is b for a, b in zip(items, live, strict=True)):
            return live
        return _rebuild_tuple(live, items)
    return new


def _rebuild_tuple(like: tuple[Any, ...], items: list[Any]) -> tuple[Any, ...]:
    """A tuple of ``like``'s own type (namedtuples included) holding ``items``."""
    cls = type(like)
    if cls is tuple:
        return tuple(items)
    make = getattr(cls, "_make", None)
    if make is not None:
        return make(items)  # type: ignore[no-any-return]
    try:
        return cls(items)  # type: ignore[no-any-return]
    except TypeError:
        return tuple(items)


def _same(a: Any, b: Any) -> bool:
    """True when a live value equals a restored one (NaN equals NaN)."""
    from .tree import encode_value
    try:
        return bool(encode_value(a) == encode_value(b))
    except CheckpointError:
        return False


# ---------------------------------------------------------------------- messages
def describe_mismatch(where: str, r: RestoreReport, target: _Keys, ck: _Keys) -> str:
    """The IncompatibleTargetError message: one line per kind of difference, a subtree that
    differs as a whole named once."""
    lines = [f"cannot restore {where} into this state (nothing was changed):"]
    if r.missing_keys:
        lines.append("  missing in the checkpoint: " + _summarize(r.missing_keys, target))
    if r.unexpected_keys:
        lines.append("  in the checkpoint but not in the target: "
                     + _summarize(r.unexpected_keys, ck))
    if r.mismatched_keys:
        lines.append("  mismatched: " + _some(
            [f"{k} ({r.details[k]})" if k in r.details else k for k in r.mismatched_keys]))
    lines.append("Pass strict=False to restore what matches, or restore into the state that "
                 "was saved.")
    return "\n".join(lines)


def _summarize(keys: list[str], universe: _Keys) -> str:
    """``keys`` with every subtree of ``universe`` that is wholly in ``keys`` named once."""
    chosen = set(keys)
    out: list[str] = []
    named: set[str] = set()
    for key in sorted(chosen):
        parts = key.split("/")
        for i in range(1, len(parts)):
            prefix = "/".join(parts[:i])
            if prefix in named:
                break
            below = universe.under(prefix)
            if len(below) > 1 and all(k in chosen for k in below):
                named.add(prefix)
                out.append(f"{prefix} (whole subtree, {len(below)} entries)")
                break
        else:
            out.append(key)
    return _some(out)


def _some(items: list[str], n: int = 20) -> str:
    return ", ".join(items[:n]) + (f" (+{len(items) - n} more)" if len(items) > n else "")


__all__ = ["RestorePlan", "RestoreReport", "RestoredStep", "merge", "describe_mismatch"]
