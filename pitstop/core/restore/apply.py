"""Phase 4 of a restore: the values put back. Values are merged into the live containers in
place (same dict, list, OrderedDict, defaultdict; tuples and namedtuples rebuilt as their
own type and put back into their parent), numpy scalars replaced, and adapters' ``apply``
called innermost first."""

from __future__ import annotations

from typing import Any

from pitstop.core.errors import CheckpointError
from pitstop.core.restore.keys import _is_under, _root_key
from pitstop.core.restore.merge import _rebuild_tuple, _same_scalar, merge
from pitstop.core.restore.plan import RestorePlan
from pitstop.core.restore.report import _q, _some


def apply(plan: RestorePlan) -> None:
    """Phase 4: values merged in, scalars replaced, tuples rebuilt, adapters applied (see the
    module); a failure here says what was already restored."""
    flat = plan.flat
    skip = plan.skip()
    pending: dict[int, dict[Any, Any]] = {}

    def put(container: Any, key: Any, new: Any) -> None:
        if isinstance(container, tuple):
            pending.setdefault(id(container), {})[key] = new
        else:
            container[key] = new

    aside = [*plan.replaced, *plan.skipped_adapters]
    applied: list[str] = []
    try:
        for key in flat.values:
            if key in skip or (aside and any(_is_under(key, p) for p in aside)):
                continue
            if key in plan.rebuilt:
                new = plan.rebuilt[key]
            elif key in plan.decoded:
                new = plan.decoded[key]
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
            if key not in plan.scalars or container is None:
                continue
            new_scalar = plan.scalars[key][()]
            if not _same_scalar(container[k], new_scalar):
                put(container, k, new_scalar)
            applied.append(key)
    except Exception as e:  # noqa: BLE001 - reported with what was already restored
        raise _partly(plan, f"putting the values back failed ({type(e).__name__}: {e})",
                      applied, []) from e
    for key, (node, k) in plan.leaf_replaced.items():
        node.tree[k] = plan.leaf_fresh[key]
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
                new = _rebuild_tuple(old, items, plan.tuple_style.get(tid))
            except Exception as e:  # noqa: BLE001 - reported with what was restored
                raise _partly(plan, f"putting the values back failed ({type(e).__name__}: "
                              f"{e})", applied, done) from e
            if parent is None:
                assert flat.detached, "the check phase refuses an immutable root tuple"
                flat.root = new
            else:
                put(parent, key, new)
            continue
        path, node = adapters[i]
        i += 1
        if path in plan.skipped_adapters or any(
                _is_under(path, p) and path != p for p in plan.replaced):
            continue
        tree = plan.replaced[path] if path in plan.replaced else node.tree
        try:
            result = node.adapter.apply(node.obj, tree)
        except Exception as e:  # noqa: BLE001 - reported with what was already restored
            key = _root_key(path)
            raise _partly(
                plan,
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


def _partly(plan: RestorePlan, what: str, values: list[str], objects: list[str]) -> CheckpointError:
    """The error for a failure after data was written: it says what was restored."""
    written = sorted(plan.written)
    parts = [f"{len(written)} array(s)"]
    if values:
        parts.append(f"{len(values)} value(s)")
    if objects:
        parts.append("the objects " + _some([_q(o) for o in objects], 10))
    err = CheckpointError(
        f"cannot restore {plan.where}: {what}. The target was partly restored already "
        f"({', '.join(parts)}); restore again into a state that matches, or rebuild it.")
    err.overwritten = written  # type: ignore[attr-defined]
    return err
