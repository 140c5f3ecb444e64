"""Phase 2 of a restore, still before any byte is written: every refusal the live objects
can state. Each array leaf to be written says whether it can be (``check_restorable``), no
two share memory unless the checkpoint holds the same bytes for both (tied weights), every
entry that must be replaced sits in a container that can take it, and every adapter whose
object is restored checks the checkpoint's subtree (``check``)."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import numpy as np

from pitstop.core.errors import CheckpointError, IncompatibleTargetError
from pitstop.core.restore.keys import ROOT, _child, _is_under, _root_key
from pitstop.core.restore.merge import _changes, _merge_problem, _tuple_style
from pitstop.core.restore.plan import RestorePlan, _spec
from pitstop.core.restore.report import _q
from pitstop.core.tree import NumpyLeaf, split


def check(plan: RestorePlan) -> None:
    """Phase 2: every precondition a live object states, before a byte is written to one."""
    flat, m = plan.flat, plan.m
    problems: list[str] = []
    refused: list[str] = []

    def refuse(key: str, text: str) -> None:
        if plan.strict:
            problems.append(f"{_q(key)}: {text}")
            refused.append(key)
        else:
            plan.mismatch(key, text)

    replaced = list(plan.replaced)
    writes: list[str] = []
    for key, leaf in flat.arrays.items():
        if key in plan.bad or key not in m.arrays or key in flat.scalars \
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
    for a, b, why in _shared_memory(plan, writes):
        refuse(b, f"shares memory with {_q(a)}, {why}")
    for key, text in _unreplaceable(plan):
        refuse(key, text)
    for key, text in _unrebuildable(plan):
        refuse(key, text)
    for path, node in flat.adapters:
        other = _other_type(plan, path, node)
        if other is not None:
            refuse(_root_key(path), other)
            continue
        if any(_is_under(path, p) for p in plan.skipped_adapters):
            continue
        if not plan.ck.under(path):
            continue
        key = _root_key(path)
        try:
            node.adapter.check(node.obj, plan.subtree(path, _spec))
        except Exception as e:  # noqa: BLE001 - an adapter's refusal, whatever it raised
            if plan.strict:
                problems.append(f"{_q(key)} ({type(node.obj).__name__}): {e}")
                refused.append(key)
            else:
                plan.skipped_adapters.add(path)
                plan.mismatch(key, str(e))
    if problems:
        raise IncompatibleTargetError(
            f"cannot restore {plan.where} into this state (nothing was changed):\n  "
            + "\n  ".join(problems), mismatched=refused)


def _other_type(plan: RestorePlan, path: str, node: Any) -> str | None:
    """Why the object at ``path`` is not of the type the checkpoint recorded there (an
    adapter's ``type_tag``: a pytree node rebuilt from the target must be the saved one)."""
    live = node.adapter.type_tag(node.obj)
    if not live:
        return None
    saved = plan.m.structure
    for comp in split(path):
        saved = _child(saved, comp)
    saved = saved.get("$type") if isinstance(saved, dict) else None
    if not isinstance(saved, str) or saved == live:
        return None
    return (f"the checkpoint holds a {saved} here, the target is a {live}; restore into "
            f"a {saved} (or load() the checkpoint without a target to get plain arrays)")


def _shared_memory(plan: RestorePlan, keys: list[str]) -> list[tuple[str, str, str]]:
    """Pairs of leaves to be written whose memory overlaps. Allowed only where both are
    the same view and the checkpoint holds the same bytes for both (tied weights)."""
    arrays = plan.flat.arrays
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
            ea, eb = plan.m.arrays[other], plan.m.arrays[key]
            if other_view == view and (ea.hash, ea.codec, ea.dtype, ea.shape) == \
                    (eb.hash, eb.codec, eb.dtype, eb.shape):
                continue  # tied: the same memory gets the same bytes twice
            out.append((other, key, "and the checkpoint holds different values for them"
                        if other_view == view else "partly (overlapping views)"))
        open_.append((space, lo, hi, view, key))
    return out


def _unreplaceable(plan: RestorePlan) -> list[tuple[str, str]]:
    """Entries that change but sit where nothing can be put: a read-only mapping, a
    tuple type that cannot be rebuilt, or an immutable root."""
    flat, out = plan.flat, []
    for key, (container, k) in [*flat.parents.items(), *flat.scalars.items()]:
        if key in plan.bad or container is None:
            continue
        if key in flat.values and key not in plan.rebuilt:
            if key not in plan.decoded:
                continue
            problem = _merge_problem(container[k], plan.decoded[key])
            if problem is not None:
                out.append((key, problem))
                continue
            if not _changes(container[k], plan.decoded[key]):
                continue
        elif key in flat.scalars and not _scalar_changes(plan, key, container[k]):
            continue
        why = _cannot_take(plan, container, set())
        if why is not None:
            out.append((key, why))
    if ROOT in flat.values and ROOT not in flat.parents and ROOT not in plan.bad and \
            ROOT in plan.decoded and _changes(flat.root, plan.decoded[ROOT]) and \
            not isinstance(flat.root, (MutableMapping, list, bytearray)):
        out.append((ROOT, f"the state itself is a {type(flat.root).__name__}, which "
                          "cannot change in place; pass it inside a dict or a list, or "
                          "use load()"))
    if ROOT in flat.scalars and flat.scalars[ROOT][0] is None and ROOT not in plan.bad:
        out.append((ROOT, "the state itself is a numpy scalar, which cannot change in "
                          "place; pass it inside a dict or a list, or use load()"))
    return out


def _unrebuildable(plan: RestorePlan) -> list[tuple[str, str]]:
    """Immutable objects an adapter rebuilds (JAX arrays, pytree nodes) whose new object
    has nowhere to go: the state's root, or a container that cannot change."""
    out = []
    for path, node in plan.flat.adapters:
        if not node.adapter.rebuilds or not plan.ck.under(path) \
                or _root_key(path) in plan.bad:
            continue
        if node.parent is None:
            if not plan.flat.detached:
                out.append((ROOT, f"the state itself is a {type(node.obj).__name__}, which "
                                  "cannot change in place; pass it inside a dict (e.g. "
                                  "{'state': state}), or use load(target=state) to get a new "
                                  "one"))
            continue
        why = _cannot_take(plan, node.parent, set())
        if why is not None:
            out.append((_root_key(path), why))
    return out


def _cannot_take(plan: RestorePlan, container: Any, seen: set[int]) -> str | None:
    """Why a new entry cannot be put into ``container`` (None when it can)."""
    if isinstance(container, tuple):
        info = plan.flat.tuples.get(id(container))
        if info is None or id(container) in seen:
            return "it sits in a tuple pitstop cannot rebuild"
        seen.add(id(container))
        style = _tuple_style(container)
        if style is None:
            return (f"it sits in a {type(container).__name__}, a tuple type that cannot be "
                    "rebuilt from its items; use a namedtuple, a tuple or a list")
        plan.tuple_style[id(container)] = style
        _path, parent, _key = info
        if parent is None:
            if plan.flat.detached:
                return None  # load(target=...): the new root is returned
            return (f"it sits in the state's root {type(container).__name__}, which "
                    "cannot change in place; pass the state inside a dict or a list, or "
                    "use load()")
        return _cannot_take(plan, parent, seen)
    if isinstance(container, (MutableMapping, list)):
        return None
    return (f"it sits in a {type(container).__name__}, which cannot be changed in place; "
            "use a dict or a list")


def _scalar_changes(plan: RestorePlan, key: str, live: Any) -> bool:
    """Whether a numpy scalar changes: read now (a tiny fresh read, nothing written)
    only where it matters, i.e. where it could not be put back."""
    container = plan.flat.scalars[key][0]
    if _cannot_take(plan, container, set()) is None:
        return True  # it can be put back: no need to know
    try:
        new = plan.reader.read_array(key, plan.m.arrays[key])
    except CheckpointError:
        return True
    return bool(np.asarray(live).tobytes() != new.tobytes()) or new.dtype != np.asarray(
        live).dtype
