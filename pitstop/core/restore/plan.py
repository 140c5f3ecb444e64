"""Putting one checkpoint back into live objects: checked first, then written, then applied.

A restore runs in four phases, so that a restore refused for any reason that can be known
without the data leaves the target exactly as it was:

1. **plan** (manifest only): match every key of the target against the checkpoint (arrays by
   shape and dtype, values by kind), decode the checkpoint's values, decide which subtrees
   are rebuilt from the checkpoint (an empty container that has filled since, an adapter
   with ``replace_on_mismatch``), and refuse a target whose shape differs at the root.
2. **check** (still no data written): every array leaf that will be written says whether
   it can be (``check_restorable``: read-only, elements sharing memory), no two leaves share
   memory unless the checkpoint holds the same bytes for both (tied weights), every entry
   that must be replaced sits in a container that can take it, and every adapter whose
   object is restored checks the checkpoint's subtree (``check``: parameter groups,
   dataset length, generator kind...).
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

from pitstop.core.errors import CheckpointError, CorruptCheckpointError, IncompatibleTargetError
from pitstop.core.format.dtypes import decode_dtype
from pitstop.core.format.manifest import ArrayEntry, Manifest
from pitstop.core.tree import (
    ArraySpec,
    FlatState,
    NumpyLeaf,
    decode_value,
    encode_value,
    join,
    split,
    unflatten,
)

if TYPE_CHECKING:
    from pitstop.core.restore.read import CheckpointReader

ROOT = "<root>"


@dataclass
class RestoreReport:
    """Keys that did not match, as ``load_state_dict`` reports them."""

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    mismatched_keys: list[str] = field(default_factory=list)
    #: mismatched key -> what differs (for the error message)
    details: dict[str, str] = field(default_factory=dict)
    #: what would allow a mismatch (an option an array leaf named), once each
    hints: list[str] = field(default_factory=list)
    #: array entries of the target that the restore wrote
    written: list[str] = field(default_factory=list)


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
        self.set = set(keys)
        self._sorted: list[str] | None = None

    @property
    def keys(self) -> list[str]:
        """Every key, sorted (sorted on first use: a restore that matches needs no order)."""
        if self._sorted is None:
            self._sorted = sorted(self.set)
        return self._sorted

    def under(self, prefix: str) -> list[str]:
        """Keys equal to ``prefix`` or below it (every key for the root, ``""``)."""
        if not prefix:
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


def _kind(structure: Any) -> str:
    """What a recorded structure node is, through adapter wrappers: leaf, dict, list, tuple."""
    while isinstance(structure, dict) and "$o" in structure:
        structure = structure["$o"]
    if not isinstance(structure, dict):
        return "leaf"
    for tag, kind in (("$d", "dict"), ("$l", "list"), ("$t", "tuple")):
        if tag in structure:
            return kind
    return "leaf"


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
        #: entries an adapter lets differ (``replaceable``): key -> (node, key in its
        #: subtree); read fresh from the checkpoint and handed to its ``apply``
        self.leaf_replaced: dict[str, tuple[Any, Any]] = {}
        self.leaf_fresh: dict[str, Any] = {}
        #: numpy-scalar keys whose checkpoint string length differs (replaced anyway)
        self.resized: set[str] = set()
        #: numpy scalars read (as 0-d arrays), put back as scalars in the apply phase
        self.scalars: dict[str, np.ndarray] = {}
        #: the checkpoint's values the target takes, decoded in the plan phase
        self.decoded: dict[str, Any] = {}
        #: id(tuple) -> how to build one of its type from items ("make", "iter", "args")
        self.tuple_style: dict[int, str] = {}
        self.ck = _Keys(())
        #: the target is matched to an older checkpoint's single root value
        self.migrated = False
        #: target entries already written (for the message when corruption stops a restore)
        self.written: list[str] = []
        self._written_lock = threading.Lock()

    # ------------------------------------------------------------------ 1. plan
    def plan(self) -> None:
        m, flat = self.m, self.flat
        self._migrate_value_root()
        ck = self.ck = _Keys([*m.arrays, *m.values])
        target = _Keys([*flat.arrays, *flat.values])
        self._check_root_kind()
        self._choose_replaced(ck, target)
        replaced = list(self.replaced)

        def in_replaced(key: str) -> bool:
            return bool(replaced) and any(_is_under(key, p) for p in replaced)

        replaceable = self._replaceable()
        r = self.report
        for key in flat.values:
            if in_replaced(key) or key in ck.set or not ck.under(key):
                continue
            if key in replaceable:
                self._replace_leaf(key, replaceable[key])
                continue
            live = self._live(key)
            if isinstance(live, (Mapping, list, tuple)) and not live:
                # an empty container that has filled since (a buffer, an optimizer's state
                # before its first step): rebuilt whole from the checkpoint
                self.rebuilt[key] = None  # read in the data phase
            else:
                self._mismatch(key, "a value in the target, a subtree with arrays in the "
                                    "checkpoint")
        covered = {k for p in self.rebuilt for k in ck.under(p)}
        for p in replaced:
            covered.update(ck.under(p))
        for key in self.bad:
            covered.update(ck.under(key))

        dtypes: dict[str, Any] = {}  # each dtype descriptor decoded once
        for key, leaf in flat.arrays.items():
            if replaced and in_replaced(key):
                continue
            e = m.arrays.get(key)
            if e is None:
                if key in m.values and key in replaceable:
                    self._replace_leaf(key, replaceable[key])
                elif key in m.values:
                    self._mismatch(key, "an array in the target, a value in the checkpoint")
                else:
                    r.missing_keys.append(key)
                    self.bad.add(key)
                continue
            descr = e.dtype
            dtype = dtypes.get(descr) if type(descr) is str else None
            if dtype is None:
                dtype = decode_dtype(descr)
                if type(descr) is str:
                    dtypes[descr] = dtype
            accept = leaf.accept_saved
            hint = None if accept is None else accept(dtype, m.layouts.get(key))
            if (key in flat.scalars and dtype != leaf.dtype and dtype.kind == leaf.dtype.kind
                    and dtype.kind in "US" and not e.shape):
                self.resized.add(key)  # np.str_ / np.bytes_ of another length: replaced anyway
            elif tuple(e.shape) != tuple(leaf.shape) or dtype != leaf.dtype:
                if key in replaceable:
                    self._replace_leaf(key, replaceable[key])
                else:
                    self._mismatch(key, f"checkpoint {dtype}{list(e.shape)}, "
                                        f"target {leaf.dtype}{list(leaf.shape)}")
                    if hint and hint not in r.hints:
                        r.hints.append(hint)
        for key in flat.values:
            if in_replaced(key) or key in self.rebuilt or key in self.bad:
                continue
            if key in m.arrays and key not in m.values:
                if key in replaceable:
                    self._replace_leaf(key, replaceable[key])
                    continue
                self._mismatch(key, "a value in the target, an array in the checkpoint")
            elif key not in m.values:
                r.missing_keys.append(key)
                self.bad.add(key)
        r.unexpected_keys = sorted(k for k in ck.set if k not in target.set and k not in covered)
        self._decode_values()
        if self.strict and (r.missing_keys or r.unexpected_keys or r.mismatched_keys):
            why = self._adapters_explain([*r.missing_keys, *r.unexpected_keys,
                                          *r.mismatched_keys])
            head, _, rest = describe_mismatch(self.where, r, target, ck).partition("\n")
            raise IncompatibleTargetError(
                "\n  ".join([head, *why]) + "\n" + rest, missing=r.missing_keys,
                unexpected=r.unexpected_keys, mismatched=r.mismatched_keys)

    def _adapters_explain(self, keys: list[str]) -> list[str]:
        """What the adapters of the objects whose keys differ say about it (``check``): an
        adapter knows why (an optimizer not built yet), the key lists only show that."""
        out = []
        for path, node in self.flat.adapters:
            if not self.ck.under(path) or not any(_is_under(k, path) for k in keys):
                continue
            try:
                node.adapter.check(node.obj, self.subtree(path, _spec))
            except Exception as e:  # noqa: BLE001 - an adapter's refusal, whatever it raised
                out.append(f"{_q(_root_key(path))} ({type(node.obj).__name__}): {e}")
        return out

    def _replaceable(self) -> dict[str, tuple[Any, Any]]:
        """Entries adapters let differ from the checkpoint (e.g. a module's extra state, an
        observer's buffers that its own load_state_dict resizes): full key -> (node, key)."""
        out: dict[str, tuple[Any, Any]] = {}
        for path, node in self.flat.adapters:
            tree = node.tree
            if not isinstance(tree, MutableMapping):
                continue
            for k in node.adapter.replaceable(node.obj):
                if k in tree:
                    out[join(path, k)] = (node, k)
        return out

    def _replace_leaf(self, key: str, where: tuple[Any, Any]) -> None:
        self.leaf_replaced[key] = where
        self.bad.add(key)  # not streamed in place: read fresh, handed to the adapter

    def _live(self, key: str) -> Any:
        parent = self.flat.parents.get(key)
        return self.flat.root if parent is None else parent[0][parent[1]]

    def _mismatch(self, key: str, what: str) -> None:
        if key not in self.report.details:
            self.report.mismatched_keys.append(key)
        self.report.details[key] = what
        self.bad.add(key)

    def _migrate_value_root(self) -> None:
        """Checkpoints written before the root container was always walked keep a state of
        plain values as one value at ``<root>``: match a target of plain values to it whole."""
        m, flat = self.m, self.flat
        if (m.structure == 0 and ROOT in m.values and ROOT not in flat.values
                and not flat.arrays and not flat.adapters
                and isinstance(flat.root, (MutableMapping, list))):
            flat.values = {ROOT: flat.root}
            flat.parents = {}
            self.migrated = True

    def _check_root_kind(self) -> None:
        """A checkpoint of a dict restores into a dict: a root of another kind (an array
        into a dict, a list into a tuple) is refused before anything else."""
        m, flat = self.m, self.flat
        if m.structure is None or flat.structure is None or self.migrated:
            return
        theirs, mine = _kind(m.structure), _kind(flat.structure)
        if theirs == mine or {theirs, mine} == {"list", "tuple"}:
            return
        raise IncompatibleTargetError(
            f"cannot restore {self.where} into this state (nothing was changed): the "
            f"checkpoint's state is a {theirs}, the target is a {mine} "
            f"({type(flat.root).__name__}). Restore into the kind of object that was saved, "
            "or use load() to get a new one.", mismatched=[ROOT])

    def _choose_replaced(self, ck: _Keys, target: _Keys) -> None:
        """Adapters that restore like ``load_state_dict`` (replace) and whose subtree in the
        checkpoint differs from the captured one: their object gets the checkpoint's."""
        m, flat = self.m, self.flat
        for path, node in flat.adapters:
            if not node.adapter.replace_on_mismatch:
                continue
            if any(_is_under(path, p) for p in self.replaced):
                continue
            mine, theirs = target.under(path), ck.under(path)
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

    def _decode_values(self) -> None:
        """Every checkpoint value the target takes, decoded now: a malformed one is
        corruption, found before anything is written."""
        for key in self.flat.values:
            if key in self.m.values and key not in self.bad:
                try:
                    self.decoded[key] = decode_value(self.m.values[key])
                except Exception as e:  # noqa: BLE001 - whatever a malformed value raises
                    raise CorruptCheckpointError(
                        f"{self.where}: value {key!r} in manifest.json is malformed "
                        f"({type(e).__name__}: {e})", checkpoint=self.where,
                        key=key, file="manifest.json") from None

    # ------------------------------------------------------------------ 2. check
    def check(self) -> None:
        """Every precondition a live object states, before a byte is written to one."""
        flat, m = self.flat, self.m
        problems: list[str] = []
        refused: list[str] = []

        def refuse(key: str, text: str) -> None:
            if self.strict:
                problems.append(f"{_q(key)}: {text}")
                refused.append(key)
            else:
                self._mismatch(key, text)

        replaced = list(self.replaced)
        writes: list[str] = []
        for key, leaf in flat.arrays.items():
            if key in self.bad or key not in m.arrays or key in flat.scalars \
                    or (replaced and any(_is_under(key, p) for p in replaced)):
                continue
            writes.append(key)
            check = getattr(leaf, "check_restorable", None)
            if check is None:
                continue
            try:
                check()
            except CheckpointError as e:
                refuse(key, str(e))
        for a, b, why in self._shared_memory(writes):
            refuse(b, f"shares memory with {_q(a)}, {why}")
        for key, text in self._unreplaceable():
            refuse(key, text)
        for key, text in self._unrebuildable():
            refuse(key, text)
        for path, node in flat.adapters:
            other = self._other_type(path, node)
            if other is not None:
                refuse(_root_key(path), other)
                continue
            if any(_is_under(path, p) for p in self.skipped_adapters):
                continue
            if not self.ck.under(path):
                continue
            key = _root_key(path)
            try:
                node.adapter.check(node.obj, self.subtree(path, _spec))
            except Exception as e:  # noqa: BLE001 - an adapter's refusal, whatever it raised
                if self.strict:
                    problems.append(f"{_q(key)} ({type(node.obj).__name__}): {e}")
                    refused.append(key)
                else:
                    self.skipped_adapters.add(path)
                    self._mismatch(key, str(e))
        if problems:
            raise IncompatibleTargetError(
                f"cannot restore {self.where} into this state (nothing was changed):\n  "
                + "\n  ".join(problems), mismatched=refused)

    def _other_type(self, path: str, node: Any) -> str | None:
        """Why the object at ``path`` is not of the type the checkpoint recorded there (an
        adapter's ``type_tag``: a pytree node rebuilt from the target must be the saved one)."""
        live = node.adapter.type_tag(node.obj)
        if not live:
            return None
        saved = self.m.structure
        for comp in split(path):
            saved = _child(saved, comp)
        saved = saved.get("$type") if isinstance(saved, dict) else None
        if not isinstance(saved, str) or saved == live:
            return None
        return (f"the checkpoint holds a {saved} here, the target is a {live}; restore into "
                f"a {saved} (or load() the checkpoint without a target to get plain arrays)")

    def _shared_memory(self, keys: list[str]) -> list[tuple[str, str, str]]:
        """Pairs of leaves to be written whose memory overlaps. Allowed only where both are
        the same view and the checkpoint holds the same bytes for both (tied weights)."""
        arrays = self.flat.arrays
        owners: set[int] = set()
        for key in keys:  # the common case, cheaply: numpy arrays that own their memory
            a = getattr(arrays[key], "array", None)
            if type(arrays[key]) is not NumpyLeaf or a is None or a.base is not None or \
                    id(a) in owners:
                break
            owners.add(id(a))
        else:
            return []
        spans = []
        for key in keys:
            span = getattr(arrays[key], "memory_span", None)
            where = span() if span is not None else None
            if where is not None:
                spans.append((*where, key))
        spans.sort(key=lambda s: (s[0], s[1]))
        out: list[tuple[str, str, str]] = []
        open_: list[tuple[Any, int, int, Any, str]] = []
        for space, lo, hi, view, key in spans:
            open_ = [s for s in open_ if s[0] == space and s[2] > lo]
            for _space, _lo, _hi, other_view, other in open_:
                ea, eb = self.m.arrays[other], self.m.arrays[key]
                if other_view == view and (ea.hash, ea.codec, ea.dtype, ea.shape) == \
                        (eb.hash, eb.codec, eb.dtype, eb.shape):
                    continue  # tied: the same memory gets the same bytes twice
                out.append((other, key, "and the checkpoint holds different values for them"
                            if other_view == view else "partly (overlapping views)"))
            open_.append((space, lo, hi, view, key))
        return out

    def _unreplaceable(self) -> list[tuple[str, str]]:
        """Entries that change but sit where nothing can be put: a read-only mapping, a
        tuple type that cannot be rebuilt, or an immutable root."""
        flat, out = self.flat, []
        for key, (container, k) in [*flat.parents.items(), *flat.scalars.items()]:
            if key in self.bad or container is None:
                continue
            if key in flat.values and key not in self.rebuilt:
                if key not in self.decoded:
                    continue
                problem = _merge_problem(container[k], self.decoded[key])
                if problem is not None:
                    out.append((key, problem))
                    continue
                if not _changes(container[k], self.decoded[key]):
                    continue
            elif key in flat.scalars and not self._scalar_changes(key, container[k]):
                continue
            why = self._cannot_take(container, set())
            if why is not None:
                out.append((key, why))
        if ROOT in flat.values and ROOT not in flat.parents and ROOT not in self.bad and \
                ROOT in self.decoded and _changes(flat.root, self.decoded[ROOT]) and \
                not isinstance(flat.root, (MutableMapping, list, bytearray)):
            out.append((ROOT, f"the state itself is a {type(flat.root).__name__}, which "
                              "cannot change in place; pass it inside a dict or a list, or "
                              "use load()"))
        if ROOT in flat.scalars and flat.scalars[ROOT][0] is None and ROOT not in self.bad:
            out.append((ROOT, "the state itself is a numpy scalar, which cannot change in "
                              "place; pass it inside a dict or a list, or use load()"))
        return out

    def _unrebuildable(self) -> list[tuple[str, str]]:
        """Immutable objects an adapter rebuilds (JAX arrays, pytree nodes) whose new object
        has nowhere to go: the state's root, or a container that cannot change."""
        out = []
        for path, node in self.flat.adapters:
            if not node.adapter.rebuilds or not self.ck.under(path) \
                    or _root_key(path) in self.bad:
                continue
            if node.parent is None:
                if not self.flat.detached:
                    out.append((ROOT, f"the state itself is a {type(node.obj).__name__}, which "
                                      "cannot change in place; pass it inside a dict (e.g. "
                                      "{'state': state}), or use load(target=state) to get a new "
                                      "one"))
                continue
            why = self._cannot_take(node.parent, set())
            if why is not None:
                out.append((_root_key(path), why))
        return out

    def _cannot_take(self, container: Any, seen: set[int]) -> str | None:
        """Why a new entry cannot be put into ``container`` (None when it can)."""
        if isinstance(container, tuple):
            info = self.flat.tuples.get(id(container))
            if info is None or id(container) in seen:
                return "it sits in a tuple pitstop cannot rebuild"
            seen.add(id(container))
            style = _tuple_style(container)
            if style is None:
                return (f"it sits in a {type(container).__name__}, a tuple type that cannot be "
                        "rebuilt from its items; use a namedtuple, a tuple or a list")
            self.tuple_style[id(container)] = style
            _path, parent, _key = info
            if parent is None:
                if self.flat.detached:
                    return None  # load(target=...): the new root is returned
                return (f"it sits in the state's root {type(container).__name__}, which "
                        "cannot change in place; pass the state inside a dict or a list, or "
                        "use load()")
            return self._cannot_take(parent, seen)
        if isinstance(container, (MutableMapping, list)):
            return None
        return (f"it sits in a {type(container).__name__}, which cannot be changed in place; "
                "use a dict or a list")

    def _scalar_changes(self, key: str, live: Any) -> bool:
        """Whether a numpy scalar changes: read now (a tiny fresh read, nothing written)
        only where it matters, i.e. where it could not be put back."""
        container = self.flat.scalars[key][0]
        if self._cannot_take(container, set()) is None:
            return True  # it can be put back: no need to know
        try:
            new = self.reader.read_array(key, self.m.arrays[key])
        except CheckpointError:
            return True
        return bool(np.asarray(live).tobytes() != new.tobytes()) or new.dtype != np.asarray(
            live).dtype

    # ------------------------------------------------------------------ 3. data
    def read(self) -> None:
        """Fresh arrays first (nothing live is touched if they are corrupt), then stream the
        rest into the live buffers."""
        flat, m, reader = self.flat, self.m, self.reader
        # (the data files were checked before the plan: CheckpointReader.restore_into)
        for p in self.rebuilt:
            self.rebuilt[p] = self.subtree(p, reader.read_array)
        for p in self.replaced:
            self.replaced[p] = self.subtree(p, reader.read_array)
        for key in self.leaf_replaced:
            self.leaf_fresh[key] = self.subtree(key, reader.read_array)
        skip = self._skip()
        for key in flat.scalars:
            if key not in m.arrays or key in skip:
                continue
            if key in self.resized:
                self.scalars[key] = reader.read_array(key, m.arrays[key])
            else:
                leaf = flat.arrays[key]
                self.scalars[key] = reader.read_array(
                    key, m.arrays[key], leaf.array)  # type: ignore[attr-defined]
        todo = [(k, leaf, m.arrays[k]) for k, leaf in flat.arrays.items()
                if k in m.arrays and k not in skip and k not in flat.scalars]
        todo.sort(key=lambda t: t[2].start)

        def restore_one(item: tuple[str, Any, ArrayEntry]) -> None:
            key, leaf, entry = item
            if leaf.restore_from is not None:
                leaf.restore_from(reader.region_reader(key, entry))
                if not leaf.deferred:
                    with self._written_lock:
                        self.written.append(key)
                return
            view = leaf.host_view()
            try:
                if view is not None:
                    reader.read_array(key, entry, view)
                else:
                    value = reader.read_array(key, entry)
                    with self._written_lock:
                        self.written.append(key)
                    leaf.assign(value)
                    return
            except CheckpointError:  # corrupt bytes, or a read that failed (an I/O error)
                with self._written_lock:
                    self.written.append(key)  # partly written
                raise
            with self._written_lock:
                self.written.append(key)

        def wrote(key: str) -> None:
            with self._written_lock:
                self.written.append(key)

        def restore(item: Any) -> None:
            if type(item[0]) is list:
                reader.read_plain_run(item[0], wrote)
            else:
                restore_one(item)

        try:
            reader.per_file(_batched(todo, reader), restore)
        except CheckpointError as e:
            written = sorted(self.written)
            e.overwritten = written  # type: ignore[attr-defined]
            if written:
                n = len(written)
                some = _some([_q(k) for k in written], 10)
                e.args = (f"{e.args[0]}. The restore had already overwritten {n} entr"
                          f"{'y' if n == 1 else 'ies'} of the target: {some}"
                          + ("" if isinstance(e, CorruptCheckpointError) else
                             "; restore again (it overwrites them) before training"),)
            raise
        self.report.written = sorted(self.written)

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
            return self.decoded[key] if key in self.decoded else _decode(m, key, self.where)
        if key in m.arrays:
            return leaf(key, m.arrays[key])
        node = m.structure
        for comp in split(prefix):
            node = _child(node, comp)
            if node is None:
                break
        leaves: dict[str, Any] = {}
        for k in self.ck.under(prefix):
            if k in m.arrays:
                leaves[k] = leaf(k, m.arrays[k])
            elif k in m.values:
                leaves[k] = _decode(m, k, self.where)
        if node is None:
            return leaves
        try:
            return unflatten(node, leaves, prefix)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise CorruptCheckpointError(
                f"{self.where}: the structure of {prefix or ROOT!r} in manifest.json does not "
                f"match its entries ({type(e).__name__}: {e})", checkpoint=self.where,
                key=prefix or ROOT, file="manifest.json") from None

    # ------------------------------------------------------------------ 4. apply
    def apply(self) -> None:
        flat = self.flat
        skip = self._skip()
        pending: dict[int, dict[Any, Any]] = {}

        def put(container: Any, key: Any, new: Any) -> None:
            if isinstance(container, tuple):
                pending.setdefault(id(container), {})[key] = new
            else:
                container[key] = new

        aside = [*self.replaced, *self.skipped_adapters]
        applied: list[str] = []
        try:
            for key in flat.values:
                if key in skip or (aside and any(_is_under(key, p) for p in aside)):
                    continue
                if key in self.rebuilt:
                    new = self.rebuilt[key]
                elif key in self.decoded:
                    new = self.decoded[key]
                else:
                    continue
                parent = flat.parents.get(key)
                old = flat.root if parent is None else parent[0][parent[1]]
                merged = merge(old, new)
                if merged is not old:
                    assert parent is not None, "the check phase refuses an immutable root"
                    put(parent[0], parent[1], merged)
                applied.append(key)
            for key, (container, k) in flat.scalars.items():
                if key not in self.scalars or container is None:
                    continue
                new_scalar = self.scalars[key][()]
                if not _same_scalar(container[k], new_scalar):
                    put(container, k, new_scalar)
                applied.append(key)
        except Exception as e:  # noqa: BLE001 - reported with what was already restored
            raise self._partly(f"putting the values back failed ({type(e).__name__}: {e})",
                               applied, []) from e
        for key, (node, k) in self.leaf_replaced.items():
            node.tree[k] = self.leaf_fresh[key]
        # tuples that changed are rebuilt and adapters applied innermost first (a longer key
        # path is deeper; at the same path a tuple is the adapter's own subtree): each
        # rebuilt tuple, and each new object of an adapter that ``rebuilds``, goes into its
        # parent, which may make that parent change in turn
        adapters = sorted(flat.adapters, key=lambda pn: -len(pn[0]))  # stable: inner first
        done: list[str] = []
        i = 0
        while pending or i < len(adapters):
            tid = max(pending, key=lambda t: len(flat.tuples[t][0])) if pending else None
            if tid is not None and (i == len(adapters)
                                    or len(flat.tuples[tid][0]) >= len(adapters[i][0])):
                changes = pending.pop(tid)
                _path, parent, key = flat.tuples[tid]
                old = parent[key] if parent is not None else flat.root
                items = [changes.get(j, x) for j, x in enumerate(old)]
                try:
                    new = _rebuild_tuple(old, items, self.tuple_style.get(tid))
                except Exception as e:  # noqa: BLE001 - reported with what was restored
                    raise self._partly(f"putting the values back failed ({type(e).__name__}: "
                                       f"{e})", applied, done) from e
                if parent is None:
                    assert flat.detached, "the check phase refuses an immutable root tuple"
                    flat.root = new
                else:
                    put(parent, key, new)
                continue
            path, node = adapters[i]
            i += 1
            if path in self.skipped_adapters or any(
                    _is_under(path, p) and path != p for p in self.replaced):
                continue
            tree = self.replaced[path] if path in self.replaced else node.tree
            try:
                result = node.adapter.apply(node.obj, tree)
            except Exception as e:  # noqa: BLE001 - reported with what was already restored
                key = _root_key(path)
                raise self._partly(
                    f"putting back {_q(key)} ({type(node.obj).__name__}) failed: "
                    f"{type(e).__name__}: {e}", applied, done) from e
            if node.adapter.rebuilds and result is not None \
                    and result is not node.obj:
                if node.parent is None:
                    assert flat.detached, "the check phase refuses an immutable root object"
                    flat.root = result
                else:
                    put(node.parent, node.key, result)
            done.append(_root_key(path))

    def _partly(self, what: str, values: list[str], objects: list[str]) -> CheckpointError:
        """The error for a failure after data was written: it says what was restored."""
        written = sorted(self.written)
        parts = [f"{len(written)} array(s)"]
        if values:
            parts.append(f"{len(values)} value(s)")
        if objects:
            parts.append("the objects " + _some([_q(o) for o in objects], 10))
        err = CheckpointError(
            f"cannot restore {self.where}: {what}. The target was partly restored already "
            f"({', '.join(parts)}); restore again into a state that matches, or rebuild it.")
        err.overwritten = written  # type: ignore[attr-defined]
        return err


def _batched(todo: list[tuple[str, Any, ArrayEntry]], reader: CheckpointReader) -> list[Any]:
    """``todo`` (sorted by where each entry starts) with the small arrays stored plain
    (uncompressed, unencrypted, whole) that go straight into a live buffer gathered in
    runs of one data file, ``([(key, entry, view), ...], first entry)``: read by
    :meth:`CheckpointReader.read_plain_run` a window at a time (100,000 small tensors cost
    a few large reads and a short loop step each); the rest stay one item each."""
    from pitstop.core.restore.read import RUN_MAX, RUN_MIN, SMALL
    if len(todo) < RUN_MIN or reader._cipher is not None:
        return todo
    out: list[Any] = []
    # (by origin, ref and file: an incremental checkpoint's own data-000.bin and the one of
    # the older checkpoint it references share a name, not their bytes)
    runs: dict[tuple[str, str], list[tuple[str, ArrayEntry, np.ndarray]]] = {}
    plain = []
    for item in todo:
        key, leaf, entry = item
        if entry.codec == "none" and entry.shards is None and entry.length <= SMALL and \
                leaf.restore_from is None:
            view = leaf.host_view()
            if view is not None and view.nbytes == entry.length:
                plain.append((item, view))
                runs.setdefault(entry.origin, []).append((key, entry, view))
                continue
        out.append(item)
    for item, _view in plain:
        if len(runs[item[2].origin]) < RUN_MIN:
            out.append(item)  # a few in this file: one by one, as before
    for run in runs.values():
        if len(run) >= RUN_MIN:
            out.extend((run[a:a + RUN_MAX], run[a][1]) for a in range(0, len(run), RUN_MAX))
    out.sort(key=lambda t: t[-1].start)
    return out


def _spec(key: str, entry: ArrayEntry) -> ArraySpec:
    return ArraySpec(tuple(entry.shape), decode_dtype(entry.dtype))


def _decode(m: Manifest, key: str, where: str) -> Any:
    try:
        return decode_value(m.values[key])
    except Exception as e:  # noqa: BLE001 - whatever a malformed value raises
        raise CorruptCheckpointError(
            f"{where}: value {key!r} in manifest.json is malformed ({type(e).__name__}: {e})",
            checkpoint=where, key=key, file="manifest.json") from None


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
_PLAIN = (bool, int, float, str, bytes, type(None))


def merge(live: Any, new: Any) -> Any:
    """Put the restored value ``new`` where ``live`` is: mutable containers are updated in
    place and keep their type (dict, OrderedDict, defaultdict, list, bytearray), nested ones
    too, so aliases the program holds stay the restored objects; a defaultdict's new entries
    are made by its factory; tuples (namedtuples too) are rebuilt as their own type; an
    equal plain value stays the object it is. Returns what the parent must hold: ``live``
    itself when nothing had to be replaced."""
    if isinstance(live, MutableMapping) and isinstance(new, Mapping):
        factory = getattr(live, "default_factory", None)
        items = []
        for k, v in new.items():
            if type(k) is str and k not in live and k.isdigit() and int(k) in live:
                # a checkpoint that lost its int keys (imported from DCP, whose keys are
                # all strings) goes back under the keys the live dict has
                k = int(k)
            if k in live:
                items.append((k, merge(live[k], v)))
            elif factory is not None and isinstance(v, (Mapping, list)):
                items.append((k, merge(factory(), v)))
            else:
                items.append((k, v))
        live.clear()
        for k, v in items:  # item by item: Counter.update would add counts
            live[k] = v
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
        return _rebuild_tuple(live, items, _tuple_style(live))
    if type(live) is type(new) and isinstance(live, _PLAIN) and not _changes(live, new):
        return live
    return new


def _merge_problem(live: Any, new: Any) -> str | None:
    """Why :func:`merge` could not put ``new`` where ``live`` is (a tuple type that cannot
    be rebuilt from its items, deep inside a value), or None; checked before any write."""
    if isinstance(live, MutableMapping) and isinstance(new, Mapping):
        for k, v in new.items():
            if k in live:
                why = _merge_problem(live[k], v)
                if why is not None:
                    return why
        return None
    if isinstance(live, list) and isinstance(new, (list, tuple)):
        for x, v in zip(live, new, strict=False):
            why = _merge_problem(x, v)
            if why is not None:
                return why
        return None
    if isinstance(live, tuple) and isinstance(new, (tuple, list)) and len(live) == len(new):
        for x, v in zip(live, new, strict=True):
            why = _merge_problem(x, v)
            if why is not None:
                return why
        if _changes(live, new) and _tuple_style(live) is None:
            return (f"it holds a {type(live).__name__}, a tuple type that cannot be rebuilt "
                    "from its items; use a namedtuple, a tuple or a list")
    return None


def _changes(live: Any, new: Any) -> bool:
    """True when putting ``new`` where ``live`` is would change something."""
    if isinstance(live, (MutableMapping, list, bytearray)) and \
            isinstance(new, (Mapping, list, tuple, bytes, bytearray)):
        return False  # merged in place: the container itself stays
    if isinstance(live, tuple) and isinstance(new, (tuple, list)):
        return len(live) != len(new) or any(
            _changes(a, b) for a, b in zip(live, new, strict=True))
    if type(live) is not type(new):
        return True
    try:
        return bool(encode_value(live) != encode_value(new))
    except CheckpointError:
        return True


def _same_scalar(live: Any, new: Any) -> bool:
    return type(live) is type(new) and np.asarray(live).tobytes() == np.asarray(new).tobytes()


def _tuple_style(like: tuple[Any, ...]) -> str | None:
    """How a tuple of ``like``'s type is built from items, found by rebuilding ``like``
    itself (no data needed): None when no known way gives an equal tuple."""
    cls = type(like)
    if cls is tuple:
        return "iter"
    if callable(getattr(cls, "_make", None)):
        return "make"
    for style in ("iter", "args"):
        try:
            again = cls(list(like)) if style == "iter" else cls(*like)
        except Exception:  # noqa: BLE001 - any constructor that does not fit
            continue
        if type(again) is cls and tuple(again) == tuple(like):
            return style
    return None


def _rebuild_tuple(like: tuple[Any, ...], items: list[Any], style: str | None
                   ) -> tuple[Any, ...]:
    """A tuple of ``like``'s own type (namedtuples included) holding ``items``."""
    cls = type(like)
    if cls is tuple:
        return tuple(items)
    if style == "make":
        return cls._make(items)  # type: ignore[attr-defined,no-any-return]
    if style == "args":
        return cls(*items)
    if style == "iter":
        return cls(items)
    raise CheckpointError(f"a {cls.__name__} cannot be rebuilt from its items")


# ---------------------------------------------------------------------- messages
def describe_mismatch(where: str, r: RestoreReport, target: _Keys, ck: _Keys) -> str:
    """The IncompatibleTargetError message: one line per kind of difference, a subtree that
    differs as a whole named once."""
    lines = [f"cannot restore {where} into this state (nothing was changed):"]
    if r.missing_keys:
        lines.append("  missing in the checkpoint: "
                     + _summarize(r.missing_keys, target, ck, r.details))
    if r.unexpected_keys:
        lines.append("  in the checkpoint but not in the target: "
                     + _summarize(r.unexpected_keys, ck, target, r.details))
    if r.mismatched_keys:
        lines.append("  mismatched: " + _summarize(r.mismatched_keys, target, None, r.details))
    lines.extend(f"  {h[0].upper()}{h[1:]}." for h in r.hints)
    lines.append("Pass strict=False to restore what matches, or restore into the state that "
                 "was saved.")
    return "\n".join(lines)


def _summarize(keys: list[str], universe: _Keys, other: _Keys | None,
               details: dict[str, str]) -> str:
    """``keys`` with every subtree of ``universe`` that is wholly in ``keys`` (and, when
    ``other`` is given, absent from it) named once."""
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
            if len(below) > 1 and all(k in chosen for k in below) and \
                    (other is None or not other.under(prefix)):
                named.add(prefix)
                kinds = {details.get(k) for k in below} - {None}
                same = f", {kinds.pop()}" if len(kinds) == 1 else ""
                out.append(f"{_q(prefix)} (whole subtree, {len(below)} entries{same})")
                break
        else:
            detail = details.get(key)
            out.append(f"{_q(key)} ({detail})" if detail else _q(key))
    return _some(out)


def _q(key: str, limit: int = 120) -> str:
    """A key path as it appears in messages: quoted (a key holding a newline cannot forge a
    line) and cut when very long."""
    text = repr(key)
    return text if len(text) <= limit else text[: limit - 4] + "...'"


def _some(items: list[str], n: int = 20) -> str:
    return ", ".join(items[:n]) + (f" (+{len(items) - n} more)" if len(items) > n else "")


__all__ = ["RestorePlan", "RestoreReport", "RestoredStep", "merge", "describe_mismatch"]
