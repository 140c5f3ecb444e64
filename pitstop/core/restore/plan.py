"""Phase 1 of a restore, on the manifest alone: what the restore will do.

:class:`RestorePlan` holds the decisions; :func:`match` takes them: every key of the target
matched against the checkpoint (arrays by shape and dtype, values by kind), the
checkpoint's values decoded, which subtrees are rebuilt from the checkpoint (an empty
container that has filled since, an adapter with ``replace_on_mismatch``), and a target
whose shape differs at the root refused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import numpy as np

from pitstop.core.errors import CorruptCheckpointError, IncompatibleTargetError
from pitstop.core.format.dtypes import decode_dtype
from pitstop.core.format.schema import ArrayEntry, Manifest
from pitstop.core.restore.keys import ROOT, _child, _is_under, _Keys, _kind, _root_key
from pitstop.core.restore.report import RestoreReport, _q, describe_mismatch
from pitstop.core.restore.stream import ArrayReader
from pitstop.core.tree import ArraySpec, FlatState, decode_value, join, split, unflatten


class RestorePlan:
    """One checkpoint (``reader``) matched against one target (``flat``); see the module."""

    def __init__(self, reader: ArrayReader, flat: FlatState, strict: bool) -> None:
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
        self.written_lock = threading.Lock()

    def mismatch(self, key: str, what: str) -> None:
        """Report ``key`` as mismatched (``what`` differs); it is not written."""
        if key not in self.report.details:
            self.report.mismatched_keys.append(key)
        self.report.details[key] = what
        self.bad.add(key)

    def skip(self) -> set[str]:
        """Target keys not streamed in place: mismatched, replaced whole, or of a skipped
        adapter."""
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


def match(plan: RestorePlan) -> None:
    """Phase 1: match the target against the checkpoint (see the module); a strict plan
    with keys that differ raises :class:`IncompatibleTargetError`."""
    m, flat = plan.m, plan.flat
    _migrate_value_root(plan)
    ck = plan.ck = _Keys([*m.arrays, *m.values])
    target = _Keys([*flat.arrays, *flat.values])
    _check_root_kind(plan)
    _choose_replaced(plan, ck, target)
    replaced = list(plan.replaced)

    def in_replaced(key: str) -> bool:
        return bool(replaced) and any(_is_under(key, p) for p in replaced)

    replaceable = _replaceable(plan)
    r = plan.report
    for key in flat.values:
        if in_replaced(key) or key in ck.set or not ck.under(key):
            continue
        if key in replaceable:
            _replace_leaf(plan, key, replaceable[key])
            continue
        live = _live(plan, key)
        if isinstance(live, (Mapping, list, tuple)) and not live:
            # an empty container that has filled since (a buffer, an optimizer's state
            # before its first step): rebuilt whole from the checkpoint
            plan.rebuilt[key] = None  # read in the data phase
        else:
            plan.mismatch(key, "a value in the target, a subtree with arrays in the "
                               "checkpoint")
    covered = {k for p in plan.rebuilt for k in ck.under(p)}
    for p in replaced:
        covered.update(ck.under(p))
    for key in plan.bad:
        covered.update(ck.under(key))

    dtypes: dict[str, Any] = {}  # each dtype descriptor decoded once
    for key, leaf in flat.arrays.items():
        if replaced and in_replaced(key):
            continue
        e = m.arrays.get(key)
        if e is None:
            if key in m.values and key in replaceable:
                _replace_leaf(plan, key, replaceable[key])
            elif key in m.values:
                plan.mismatch(key, "an array in the target, a value in the checkpoint")
            else:
                r.missing_keys.append(key)
                plan.bad.add(key)
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
            plan.resized.add(key)  # np.str_ / np.bytes_ of another length: replaced anyway
        elif tuple(e.shape) != tuple(leaf.shape) or dtype != leaf.dtype:
            if key in replaceable:
                _replace_leaf(plan, key, replaceable[key])
            else:
                plan.mismatch(key, f"checkpoint {dtype}{list(e.shape)}, "
                                   f"target {leaf.dtype}{list(leaf.shape)}")
                if hint and hint not in r.hints:
                    r.hints.append(hint)
    for key in flat.values:
        if in_replaced(key) or key in plan.rebuilt or key in plan.bad:
            continue
        if key in m.arrays and key not in m.values:
            if key in replaceable:
                _replace_leaf(plan, key, replaceable[key])
                continue
            plan.mismatch(key, "a value in the target, an array in the checkpoint")
        elif key not in m.values:
            r.missing_keys.append(key)
            plan.bad.add(key)
    r.unexpected_keys = sorted(k for k in ck.set if k not in target.set and k not in covered)
    _decode_values(plan)
    if plan.strict and (r.missing_keys or r.unexpected_keys or r.mismatched_keys):
        why = _adapters_explain(plan, [*r.missing_keys, *r.unexpected_keys,
                                       *r.mismatched_keys])
        head, _, rest = describe_mismatch(plan.where, r, target, ck).partition("\n")
        raise IncompatibleTargetError(
            "\n  ".join([head, *why]) + "\n" + rest, missing=r.missing_keys,
            unexpected=r.unexpected_keys, mismatched=r.mismatched_keys)


def _adapters_explain(plan: RestorePlan, keys: list[str]) -> list[str]:
    """What the adapters of the objects whose keys differ say about it (``check``): an
    adapter knows why (an optimizer not built yet), the key lists only show that."""
    out = []
    for path, node in plan.flat.adapters:
        if not plan.ck.under(path) or not any(_is_under(k, path) for k in keys):
            continue
        try:
            node.adapter.check(node.obj, plan.subtree(path, _spec))
        except Exception as e:  # noqa: BLE001 - an adapter's refusal, whatever it raised
            out.append(f"{_q(_root_key(path))} ({type(node.obj).__name__}): {e}")
    return out


def _replaceable(plan: RestorePlan) -> dict[str, tuple[Any, Any]]:
    """Entries adapters let differ from the checkpoint (e.g. a module's extra state, an
    observer's buffers that its own load_state_dict resizes): full key -> (node, key)."""
    out: dict[str, tuple[Any, Any]] = {}
    for path, node in plan.flat.adapters:
        tree = node.tree
        if not isinstance(tree, MutableMapping):
            continue
        for k in node.adapter.replaceable(node.obj):
            if k in tree:
                out[join(path, k)] = (node, k)
    return out


def _replace_leaf(plan: RestorePlan, key: str, where: tuple[Any, Any]) -> None:
    plan.leaf_replaced[key] = where
    plan.bad.add(key)  # not streamed in place: read fresh, handed to the adapter


def _live(plan: RestorePlan, key: str) -> Any:
    parent = plan.flat.parents.get(key)
    return plan.flat.root if parent is None else parent[0][parent[1]]


def _migrate_value_root(plan: RestorePlan) -> None:
    """Checkpoints written before the root container was always walked keep a state of
    plain values as one value at ``<root>``: match a target of plain values to it whole."""
    m, flat = plan.m, plan.flat
    if (m.structure == 0 and ROOT in m.values and ROOT not in flat.values
            and not flat.arrays and not flat.adapters
            and isinstance(flat.root, (MutableMapping, list))):
        flat.values = {ROOT: flat.root}
        flat.parents = {}
        plan.migrated = True


def _check_root_kind(plan: RestorePlan) -> None:
    """A checkpoint of a dict restores into a dict: a root of another kind (an array
    into a dict, a list into a tuple) is refused before anything else."""
    m, flat = plan.m, plan.flat
    if m.structure is None or flat.structure is None or plan.migrated:
        return
    theirs, mine = _kind(m.structure), _kind(flat.structure)
    if theirs == mine or {theirs, mine} == {"list", "tuple"}:
        return
    raise IncompatibleTargetError(
        f"cannot restore {plan.where} into this state (nothing was changed): the "
        f"checkpoint's state is a {theirs}, the target is a {mine} "
        f"({type(flat.root).__name__}). Restore into the kind of object that was saved, "
        "or use load() to get a new one.", mismatched=[ROOT])


def _choose_replaced(plan: RestorePlan, ck: _Keys, target: _Keys) -> None:
    """Adapters that restore like ``load_state_dict`` (replace) and whose subtree in the
    checkpoint differs from the captured one: their object gets the checkpoint's."""
    m, flat = plan.m, plan.flat
    for path, node in flat.adapters:
        if not node.adapter.replace_on_mismatch:
            continue
        if any(_is_under(path, p) for p in plan.replaced):
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
            plan.replaced[path] = None  # read in the data phase


def _decode_values(plan: RestorePlan) -> None:
    """Every checkpoint value the target takes, decoded now: a malformed one is
    corruption, found before anything is written."""
    for key in plan.flat.values:
        if key in plan.m.values and key not in plan.bad:
            try:
                plan.decoded[key] = decode_value(plan.m.values[key])
            except Exception as e:  # noqa: BLE001 - whatever a malformed value raises
                raise CorruptCheckpointError(
                    f"{plan.where}: value {key!r} in manifest.json is malformed "
                    f"({type(e).__name__}: {e})", checkpoint=plan.where,
                    key=key, file="manifest.json") from None


def _spec(key: str, entry: ArrayEntry) -> ArraySpec:
    return ArraySpec(tuple(entry.shape), decode_dtype(entry.dtype))


def _decode(m: Manifest, key: str, where: str) -> Any:
    try:
        return decode_value(m.values[key])
    except Exception as e:  # noqa: BLE001 - whatever a malformed value raises
        raise CorruptCheckpointError(
            f"{where}: value {key!r} in manifest.json is malformed ({type(e).__name__}: {e})",
            checkpoint=where, key=key, file="manifest.json") from None
