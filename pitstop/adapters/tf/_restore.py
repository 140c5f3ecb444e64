"""The restore walk: a saved object graph matched against live TensorFlow objects, as
``tf.train.Checkpoint`` matches it (the graph's vocabulary and the save walk: ``_graph``).

A restore walks the saved graph from the root together with the live objects, matching
children by local name, exactly as TensorFlow does: renaming a Python attribute breaks a
restore as it does in TensorFlow, and no more. Values whose object does not exist yet are
queued on its parent through TensorFlow's own deferred-restoration hook, so a layer built after
the restore gets its values when it creates its variables; a slot variable is handed to its
optimizer, which creates it holding its value or restores it when it creates it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.training.saving import saveable_object_util

from pitstop.adapters.tf._graph import (
    ATTRIBUTES,
    GRAPH,
    VARIABLE_VALUE,
    _pretty_names,
    _saved_paths,
    _slot_names,
    _valid_graph,
    children,
    is_trackable,
    saved_keys,
)
from pitstop.adapters.tf._leaf import (
    VariableLeaf,
    as_variable_value,
    base_variable,
    leaf_to_tensor,
    numpy_dtype,
)
from pitstop.core.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleTargetError,
    UnsupportedStateError,
)
from pitstop.core.tree import ArrayLeaf, ArraySpec

log = logging.getLogger("pitstop")
_uids = itertools.count(1)
_uid_lock = threading.Lock()


@dataclass
class Outcome:
    """What one restore matched, for ``tf.train``-style status assertions. It holds the live
    objects weakly (as tf.train does), so a restore with values still waiting for objects
    that are never created keeps nothing alive."""

    #: saved node id -> the live object it went to (a weak reference where one can be taken)
    matched: dict[int, Any] = field(default_factory=dict)
    #: saved node ids with values that are queued for objects not created yet
    deferred: set[int] = field(default_factory=set)
    #: (saved node id, attribute) of values whose matched object takes none (tf.train's
    #: "unused attributes")
    unused: list[tuple[int, str]] = field(default_factory=list)
    #: set by the status's expect_partial(): no warning about unrestored values
    expect_partial: bool = False

    def match(self, sid: int, obj: Any) -> None:
        try:
            self.matched[sid] = weakref.ref(obj)
        except TypeError:
            self.matched[sid] = _Strong(obj)

    def live(self) -> list[Any]:
        """The matched objects still alive."""
        return [o for o in (r() for r in self.matched.values()) if o is not None]


class _Strong:
    """The stand-in for a weak reference to an object that cannot be weakly referenced."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __call__(self) -> Any:
        return self.obj


class Restore:
    """One restore of a saved object graph into live objects (TensorFlow's matching rules).

    ``tree`` is the saved subtree: arrays as numpy (or ``ArraySpec`` for :meth:`check`), or
    as the live ``VariableLeaf`` objects the core already restored in place."""

    def __init__(self, tree: Any, where: str = "", *, report_unrestored: bool = False) -> None:
        graph = tree.get(GRAPH) if isinstance(tree, Mapping) else None
        if not _valid_graph(graph):
            raise IncompatibleTargetError(
                f"{where or 'the checkpoint'} holds no TensorFlow object graph here; restore "
                "it into the kind of object that saved it")
        self.tree, self.where = tree, where
        self.graph: list[list[Any]] = graph  # type: ignore[assignment]  # checked just above
        self.paths = _saved_paths(self.graph)
        self.keys = saved_keys(self.graph, self.paths)
        self.names = _pretty_names(self.graph, self.paths)
        #: variable node -> its slot variables, ``(optimizer node, slot name, slot node)``
        self.slot_refs: dict[int, list[tuple[int, str, int]]] = {}
        for opt_sid, node in enumerate(self.graph):
            for slot_name, var_sid, slot_sid in (node[2] if len(node) > 2 else ()):
                self.slot_refs.setdefault(var_sid, []).append((opt_sid, slot_name, slot_sid))
        with _uid_lock:
            self.restore_uid = next(_uids)
        self.outcome = Outcome()
        if report_unrestored:
            # as tf.train: once the restore is released (no value waits for an object any
            # more), say which values no object took, unless expect_partial() was called
            weakref.finalize(self, _report_unrestored, self.outcome, self.graph, self.names,
                             where)

    def pretty(self, sid: int) -> str:
        """tf.train's name for a saved object: ``(root).model.layer`` (a slot variable:
        ``(root).v's state 'm' for (root).opt``)."""
        return self.names[sid]

    # the attribute TensorFlow's deferred-restoration hook sorts by
    @property
    def checkpoint(self) -> Restore:
        return self

    def label(self, sid: int) -> str:
        comps = self.keys[sid]
        return "/".join([self.where, *comps] if self.where else comps) or (self.where or "root")

    def value(self, sid: int, attr: str) -> Any:
        node = self.tree
        try:
            for c in self.keys[sid]:
                node = node[c]
            return node[ATTRIBUTES][attr]
        except (KeyError, TypeError):
            raise CorruptCheckpointError(
                f"{self.label(sid)}: the object graph names attribute {attr!r} but the "
                "checkpoint holds no value for it") from None

    def pairs(self, live: Any, sid: int = 0, defer: bool = True) -> Iterator[tuple[Any, int]]:
        """Live objects matched to saved nodes, breadth first from ``(live, sid)``; saved
        children whose live object does not exist yet are queued as deferred (``defer``)."""
        seen = self.outcome.matched
        queue = deque([(live, sid)])
        if sid not in seen:
            self.outcome.match(sid, live)
        while queue:
            obj, s = queue.popleft()
            yield obj, s
            for slot_sid, slot in self._slots(obj, s, defer):
                self.outcome.match(slot_sid, slot)
                queue.append((slot, slot_sid))
            if not self.graph[s][0]:
                continue
            # the children the capture walked, trackable or not (a Keras layer's
            # SeedGenerator is a plain object whose state variable is its child)
            mine = children(obj)
            for name, cid in self.graph[s][0]:
                if cid in seen:
                    continue
                child = mine.get(name)
                if child is None:
                    if defer and is_trackable(obj) and self._has_values(cid):
                        self._defer(obj, name, cid)
                    continue
                self.outcome.match(cid, child)
                queue.append((child, cid))

    def _slots(self, obj: Any, sid: int, defer: bool) -> list[tuple[int, Any]]:
        """The slot variables to match once saved node ``sid`` went to ``obj``, as
        TensorFlow's restore queues them: those of an optimizer whose variable is matched
        already, or of a variable whose optimizer is. A slot the optimizer has not created
        yet is handed to it (``_create_or_restore_slot_variable``): a ``tf.compat.v1.train``
        optimizer creates it now, holding the saved value, or restores it when it creates
        it (``defer``; a dry run hands nothing)."""
        node = self.graph[sid]
        refs = [(sid, name, var, slot) for name, var, slot in (node[2] if len(node) > 2 else ())]
        refs += [(opt, name, sid, slot) for opt, name, slot in self.slot_refs.get(sid, ())]
        out: list[tuple[int, Any]] = []
        for opt_sid, slot_name, var_sid, slot_sid in refs:
            if slot_sid in self.outcome.matched or slot_sid in self.outcome.deferred:
                continue
            opt_ref, var_ref = self.outcome.matched.get(opt_sid), \
                self.outcome.matched.get(var_sid)
            opt = opt_ref() if opt_ref is not None else None
            var = var_ref() if var_ref is not None else None
            if opt is None or var is None:
                continue  # the other one comes later (or never: the slot stays unresolved)
            opt = getattr(opt, "_pitstop_root", opt)
            try:
                slot = opt.get_slot(var, slot_name) if _slot_names(opt) else None
            except (AttributeError, KeyError):
                slot = None
            if slot is not None:
                out.append((slot_sid, slot))
            elif defer and hasattr(opt, "_create_or_restore_slot_variable"):
                self.outcome.deferred.add(slot_sid)
                opt._create_or_restore_slot_variable(
                    slot_variable_position=_SlotPosition(self, slot_sid),
                    slot_name=slot_name, variable=var)
        return out

    def _has_values(self, sid: int, _seen: set[int] | None = None) -> bool:
        seen = _seen if _seen is not None else set()
        if sid in seen:
            return False
        seen.add(sid)
        node = self.graph[sid]
        return bool(node[1]) or (len(node) > 2 and bool(node[2])) or any(
            self._has_values(c, seen) for _, c in node[0])

    def _defer(self, parent: Any, name: str, sid: int) -> None:
        self.outcome.deferred.add(sid)
        parent._maybe_initialize_trackable()
        parent._deferred_dependencies.setdefault(name, []).append(_Deferred(self, sid))

    # -------------------------------------------------------------- check and apply
    def check(self, live: Any) -> None:
        """Refuse (``IncompatibleTargetError``) before anything is written when a matched
        variable's shape or dtype differs, or a matched object cannot take its values."""
        problems: list[str] = []
        for obj, sid in self.pairs(live, defer=False):
            for name, _tname, kind in self.graph[sid][1]:
                spec = self.value(sid, name)
                key = f"{self.label(sid)}/{ATTRIBUTES}/{name}"
                problem = _cannot_take(obj, kind, spec)
                if problem and not _takes_nothing(obj, kind):
                    problems.append(f"{key}: {problem}")
        # a dry run: the real one matches again (cleared in place: the release report holds
        # this very object)
        self.outcome.matched.clear()
        self.outcome.deferred.clear()
        self.outcome.unused.clear()
        if problems:
            raise IncompatibleTargetError(
                "the TensorFlow objects differ from the checkpoint's:\n  " + "\n  ".join(
                    problems[:20]) + ("" if len(problems) <= 20 else
                                      f"\n  ... and {len(problems) - 20} more"),
                mismatched=[p.split(":", 1)[0] for p in problems])

    def apply(self, live: Any, sid: int = 0) -> Outcome:
        """Put every matched value into its live object; queue the rest as deferred.

        Runs eagerly even when called while a ``tf.function`` is traced (an object created
        inside one gets its deferred values then: Keras builds its optimizer inside fit's
        train function), as TensorFlow's own restore does: assign ops recorded into the
        traced graph would not run now, and would run again at every call."""
        with tf.init_scope():
            for obj, s in list(self.pairs(live, sid)):
                self._assign(obj, s)
        return self.outcome

    def _assign(self, obj: Any, sid: int) -> None:
        attrs = self.graph[sid][1]
        if not attrs:
            return
        uid = getattr(obj, "_update_uid", None)
        if isinstance(uid, int) and uid > self.restore_uid:
            return  # a newer restore already wrote this object (as TensorFlow decides)
        tensors: dict[str, Any] = {}
        for name, tname, kind in attrs:
            value = self.value(sid, name)
            where = f"{self.label(sid)}/{ATTRIBUTES}/{name}"
            if _takes_nothing(obj, kind):
                # as tf.train: the value stays unused (assert_consumed() says so)
                self.outcome.unused.append((sid, name))
                continue
            problem = _cannot_take(obj, kind, value)
            if problem:
                raise IncompatibleTargetError(f"{where}: {problem}", mismatched=[where])
            var = base_variable(obj)
            if var is not None and (kind == "variable" or kind.startswith("serialized:")):
                if isinstance(value, VariableLeaf) and value.variable is var:
                    continue  # restored in place already
                var.assign(as_variable_value(leaf_to_tensor(value, kind, where), var))
            else:
                tensors[tname or (name if len(attrs) > 1 else _only_name(obj, where))] = \
                    leaf_to_tensor(value, kind, where)
        if tensors:  # all of the object's tensors in one call, as tf.train passes them
            obj._restore_from_tensors(tensors)
        if is_trackable(obj):
            obj._maybe_initialize_trackable()
            obj._update_uid = self.restore_uid


class _Deferred:
    """A saved subtree waiting on its parent for a child that does not exist yet; TensorFlow
    calls :meth:`restore` when the child is tracked (``Trackable._track_trackable``)."""

    def __init__(self, owner: Restore, sid: int) -> None:
        self.owner, self.sid = owner, sid

    @property
    def checkpoint(self) -> Restore:
        return self.owner

    def is_simple_variable(self) -> bool:
        return False  # never an initializer: the value is assigned when the object is tracked

    def restore(self, trackable: Any) -> None:
        self.owner.outcome.deferred.discard(self.sid)
        self.owner.apply(trackable, self.sid)  # eagerly, also inside a traced tf.function


class _SlotPosition(_Deferred):
    """A saved slot variable handed to its optimizer, which restores it when it creates it
    (``_restore_slot_variable``), or creates it now holding the saved value (a simple
    variable, eagerly: TensorFlow's restoring initializer)."""

    @property
    def restore_uid(self) -> int:
        return self.owner.restore_uid

    def is_simple_variable(self) -> bool:
        node = self.owner.graph[self.sid]
        return not node[0] and len(node[1]) == 1 and node[1][0][0] == VARIABLE_VALUE and \
            node[1][0][2] == "variable"

    def value_tensors(self, shape_and_slices: Any = None) -> dict[str, Any]:
        where = f"{self.owner.label(self.sid)}/{ATTRIBUTES}/{VARIABLE_VALUE}"
        value = self.owner.value(self.sid, VARIABLE_VALUE)
        return {VARIABLE_VALUE: leaf_to_tensor(value, "variable", where)}


def _only_name(obj: Any, where: str) -> str:
    names = list(obj._serialize_to_tensors()) if \
        saveable_object_util.trackable_has_serialize_to_tensor(obj) else []
    if len(names) != 1:
        raise IncompatibleTargetError(
            f"{where}: cannot tell which of {type(obj).__name__}'s saved tensors this is")
    return names[0]


def unrestored(outcome: Outcome, graph: list[list[Any]]) -> list[tuple[int, str | None]]:
    """Saved values no object took: ``(node, None)`` for an object never matched,
    ``(node, attribute)`` for a value its matched object takes none of."""
    out: list[tuple[int, str | None]] = [
        (s, None) for s, (_c, attrs, *_slots) in enumerate(graph) if attrs and s not in outcome.matched]
    return out + [(s, a) for s, a in outcome.unused]


def _report_unrestored(outcome: Outcome, graph: list[list[Any]], pretty: list[str],
                       where: str) -> None:
    if outcome.expect_partial:
        return
    left = unrestored(outcome, graph)
    if not left:
        return
    names = [pretty[s] + ("" if a is None else f" ({a})") for s, a in left]
    log.warning(
        "pitstop: a restore of %s is released while %d value(s) in the checkpoint found no "
        "object (a partial restore): %s%s. If that is intended (e.g. only the model is "
        "restored for inference), call status.expect_partial() on the restore's status.",
        where or "a checkpoint", len(left), ", ".join(names[:20]),
        f" and {len(names) - 20} more" if len(names) > 20 else "")


def _takes_nothing(obj: Any, kind: str) -> bool:
    """An object that takes no saved values at all (a bare ``Trackable``, a container where
    the checkpoint has a variable): tf.train leaves such values unused instead of failing."""
    del kind
    return base_variable(obj) is None and not (
        is_trackable(obj) and saveable_object_util.trackable_has_serialize_to_tensor(obj))


def _cannot_take(obj: Any, kind: str, value: Any) -> str | None:
    """Why ``obj`` cannot take a saved value of ``kind`` (None when it can)."""
    var = base_variable(obj)
    if kind.startswith("serialized:") and var is not None:
        saved = kind.split(":", 1)[1]
        if var.dtype.name != saved:
            return (f"dtype {saved} in the checkpoint, {var.dtype.name} in this variable; "
                    "create it with the dtype that was saved")
        return None
    if kind == "variable":
        if var is None:
            if saveable_object_util.trackable_has_serialize_to_tensor(obj):
                return None  # e.g. a variable-like object with its own serialization
            return (f"the checkpoint holds a variable here, this is a {type(obj).__name__}; "
                    "restore into the kind of object that saved it")
        return variable_problem(var, value)
    if not saveable_object_util.trackable_has_serialize_to_tensor(obj):
        return (f"the checkpoint holds {kind} state here, this {type(obj).__name__} takes "
                "none; restore into the kind of object that saved it")
    return None


def variable_problem(var: tf.Variable, value: Any) -> str | None:
    """Why ``var`` cannot take the saved array ``value`` (None when it can): a shape its own
    (possibly partly undefined) shape does not admit, or another dtype, as tf.train refuses."""
    shape, dtype = _shape_dtype(value)
    if shape is not None and not var.shape.is_compatible_with(shape):
        mine = var.shape.as_list() if var.shape.rank is not None else "any shape"
        return (f"shape {list(shape)} in the checkpoint, {mine} in this variable; build the "
                "model with the configuration that saved it")
    try:
        live = numpy_dtype(var.dtype, "")
    except UnsupportedStateError:
        live = None
    if dtype is not None and live != dtype:
        return (f"dtype {dtype} in the checkpoint, {var.dtype.name} in this variable; "
                "create it with the dtype that was saved (or cast after restoring)")
    return None


def _shape_dtype(value: Any) -> tuple[tuple[int, ...] | None, np.dtype | None]:
    if isinstance(value, (ArraySpec, ArrayLeaf, np.ndarray)):
        return tuple(value.shape), np.dtype(value.dtype)
    return None, None


def restore_into(live: Any, tree: Any, where: str = "", restore: Restore | None = None
                 ) -> Outcome:
    """Restore a captured tree into ``live`` with TensorFlow's matching rules (``restore``:
    the :class:`Restore` of ``tree`` to use, to read what it matched afterwards)."""
    r = restore if restore is not None else Restore(tree, where)
    try:
        return r.apply(live)
    except CheckpointError:
        raise
    except (tf.errors.OpError, ValueError, TypeError) as e:
        raise IncompatibleTargetError(
            f"{where or 'a TensorFlow object'}: TensorFlow refused a restored value "
            f"({type(e).__name__}: {e})") from e
