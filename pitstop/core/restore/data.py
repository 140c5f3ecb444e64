"""Phase 3 of a restore: the checkpoint's bytes into the target, every array verified
against its hash. Fresh arrays (rebuilt subtrees, numpy scalars) are read first, then every
other array streams straight into its live buffer; corruption found here raises
:class:`CorruptCheckpointError` listing what was already overwritten."""

from __future__ import annotations

from typing import Any

import numpy as np

from pitstop.core.errors import CheckpointError, CorruptCheckpointError
from pitstop.core.format.schema import ArrayEntry
from pitstop.core.restore.plan import RestorePlan
from pitstop.core.restore.report import _q, _some
from pitstop.core.restore.stream import RUN_MAX, RUN_MIN, SMALL, ArrayReader


def read_data(plan: RestorePlan) -> None:
    """Phase 3: fresh arrays first (nothing live is touched if they are corrupt), then stream the
    rest into the live buffers."""
    flat, m, reader = plan.flat, plan.m, plan.reader
    # (the data files were checked before the plan: CheckpointReader.restore_into)
    for p in plan.rebuilt:
        plan.rebuilt[p] = plan.subtree(p, reader.read_array)
    for p in plan.replaced:
        plan.replaced[p] = plan.subtree(p, reader.read_array)
    for key in plan.leaf_replaced:
        plan.leaf_fresh[key] = plan.subtree(key, reader.read_array)
    skip = plan.skip()
    for key in flat.scalars:
        if key not in m.arrays or key in skip:
            continue
        if key in plan.resized:
            plan.scalars[key] = reader.read_array(key, m.arrays[key])
        else:
            leaf = flat.arrays[key]
            plan.scalars[key] = reader.read_array(
                key, m.arrays[key], leaf.array)  # type: ignore[attr-defined]
    todo = [(k, leaf, m.arrays[k]) for k, leaf in flat.arrays.items()
            if k in m.arrays and k not in skip and k not in flat.scalars]
    todo.sort(key=lambda t: t[2].start)

    def restore_one(item: tuple[str, Any, ArrayEntry]) -> None:
        key, leaf, entry = item
        if leaf.restore_from is not None:
            leaf.restore_from(reader.region_reader(key, entry))
            if not leaf.deferred:
                with plan.written_lock:
                    plan.written.append(key)
            return
        view = leaf.host_view()
        try:
            if view is not None:
                reader.read_array(key, entry, view)
            else:
                value = reader.read_array(key, entry)
                with plan.written_lock:
                    plan.written.append(key)
                leaf.assign(value)
                return
        except CheckpointError:  # corrupt bytes, or a read that failed (an I/O error)
            with plan.written_lock:
                plan.written.append(key)  # partly written
            raise
        with plan.written_lock:
            plan.written.append(key)

    def wrote(keys: list[str]) -> None:
        with plan.written_lock:
            plan.written.extend(keys)

    def restore(item: Any) -> None:
        if type(item[0]) is list:
            reader.read_plain_run(item[0], wrote)
        else:
            restore_one(item)

    try:
        reader.per_file(_batched(todo, reader), restore)
    except CheckpointError as e:
        written = sorted(plan.written)
        e.overwritten = written  # type: ignore[attr-defined]
        if written:
            n = len(written)
            some = _some([_q(k) for k in written], 10)
            e.args = (f"{e.args[0]}. The restore had already overwritten {n} entr"
                      f"{'y' if n == 1 else 'ies'} of the target: {some}"
                      + ("" if isinstance(e, CorruptCheckpointError) else
                         "; restore again (it overwrites them) before training"),)
        raise
    plan.report.written = sorted(plan.written)


def _batched(todo: list[tuple[str, Any, ArrayEntry]], reader: ArrayReader) -> list[Any]:
    """``todo`` (sorted by where each entry starts) with the small arrays stored plain
    (uncompressed, unencrypted, whole) that go straight into a live buffer gathered in
    runs of one data file, ``([(key, entry, view), ...], first entry)``: read by
    :meth:`CheckpointReader.read_plain_run` a window at a time (100,000 small tensors cost
    a few large reads and a short loop step each); the rest stay one item each."""
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
