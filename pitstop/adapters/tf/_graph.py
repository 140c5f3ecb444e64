"""TensorFlow's object graph, walked and matched as ``tf.train.Checkpoint`` walks and matches it.

A TensorFlow object (a ``tf.train.Checkpoint``, a Keras 3 model or optimizer on the TensorFlow
backend, a ``tf.Module``, a ``tf.random.Generator``...) is captured as the graph of trackable
objects reachable from it, breadth first in the order TensorFlow lists children, each object
once (an object reachable by several paths is saved at the first one, as TensorFlow does)::

    {".OBJECT_GRAPH": [[children, attributes], ...],        # node 0 is the object itself
     "<child>": {"<grandchild>": {".ATTRIBUTES": {"VARIABLE_VALUE": <array>}}}, ...}

``children`` is ``[[local name, node id], ...]``; ``attributes`` is ``[[name, tensor name,
kind], ...]``. Path components are TensorFlow's escaped local names, so every array sits at the
key TensorFlow's own checkpoint uses (``opt/_iterations/.ATTRIBUTES/VARIABLE_VALUE``).

Slot variables of ``tf.compat.v1.train`` optimizers (Adam's ``m`` and ``v``: no object's
dependencies) follow the other nodes, as TensorFlow lists them; the optimizer's node then has a
third element, ``[[slot name, variable node id, slot node id], ...]``, and each slot sits at
TensorFlow's key for it (``v/.OPTIMIZER_SLOT/opt/m/.ATTRIBUTES/VARIABLE_VALUE``).

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
import sys
import threading
import weakref
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.checkpoint import saveable_compat
from tensorflow.python.saved_model import registration
from tensorflow.python.trackable import base as trackable_base
from tensorflow.python.trackable import trackable_utils
from tensorflow.python.training.saving import saveable_object_util

from pitstop.adapters.tf._leaf import (
    VariableLeaf,
    as_variable_value,
    base_variable,
    leaf_to_tensor,
    numpy_dtype,
    tensor_to_leaf,
)
from pitstop.core.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleTargetError,
    UnsupportedStateError,
)
from pitstop.core.tree import ArrayLeaf, ArraySpec

GRAPH = ".OBJECT_GRAPH"
#: local names of the children pitstop adds to TensorFlow's graph start so (no Python
#: attribute can): Keras layers' seed generators, which tf.train does not save
EXTRA = ".seed_generator_"
#: Keras 3 sublayers and variables TensorFlow's graph does not reach (a layer kept in a
#: list attribute of a subclassed model: Keras tracks it, tf.train does not)
EXTRA_LAYER = ".keras_layer_"
EXTRA_VARIABLE = ".keras_variable_"
EXTRAS = (EXTRA, EXTRA_LAYER, EXTRA_VARIABLE)


def is_extra(name: str) -> bool:
    """Whether a local name is one pitstop adds to TensorFlow's graph (see EXTRAS)."""
    return name.startswith(EXTRAS)
ATTRIBUTES = trackable_utils.OBJECT_ATTRIBUTES_NAME  # ".ATTRIBUTES"
#: the key component between a variable's path and its optimizer's in a slot variable's key
#: (``v/.OPTIMIZER_SLOT/opt/m``); no escaped local name can be it
SLOTS = ".OPTIMIZER_SLOT"
VARIABLE_VALUE = "VARIABLE_VALUE"

log = logging.getLogger("pitstop")
_uids = itertools.count(1)
_uid_lock = threading.Lock()


def is_trackable(obj: Any) -> bool:
    return isinstance(obj, trackable_base.Trackable)


def serializes(obj: Any) -> bool:
    """Whether ``obj`` saves tensors of its own (``_serialize_to_tensors``)."""
    return bool(saveable_object_util.trackable_has_serialize_to_tensor(obj))


def children(obj: Any, reached: set[int] | None = None) -> dict[str, Any]:
    """The checkpoint dependencies of ``obj``, by local name, as TensorFlow lists them, plus
    the random state TensorFlow's graph leaves out (see :func:`_seed_generators`) and the
    Keras layers and variables it does not reach (:func:`_keras_untracked`; ``reached``:
    ids of objects TensorFlow's graph reaches elsewhere, which are not added again)."""
    out = _tf_children(obj)
    out.update(_keras_untracked(obj, out, reached or set()))
    return out


def _tf_children(obj: Any) -> dict[str, Any]:
    out = dict(tf.train.TrackableView.children(obj)) if is_trackable(obj) else {}
    out.update(_seed_generators(obj, out))
    return out


def _keras_untracked(obj: Any, known: dict[str, Any], reached: set[int]) -> dict[str, Any]:
    """A Keras 3 layer's sublayers and variables that TensorFlow's graph does not list
    (Keras tracks layers kept in a list or dict attribute; ``tf.train.Checkpoint`` saves
    none of their non-trainable state, e.g. BatchNormalization's moving statistics, and
    restores the trainable part only through an optimizer): added as ``.keras_layer_<i>``
    and ``.keras_variable_<i>`` (their index in Keras's own lists), so nothing a Keras model
    holds is left out of a save."""
    keras = sys.modules.get("keras")
    if keras is None or not isinstance(obj, keras.Layer):
        return {}
    layers = getattr(obj, "_layers", None)
    if not isinstance(layers, list):
        return {}
    listed = {id(v) for v in known.values()} | reached
    for v in known.values():  # a variable TensorFlow lists through its Keras wrapper
        inner = base_variable(v)
        if inner is not None:
            listed.add(id(inner))
    extra: dict[str, Any] = {}
    for i, layer in enumerate(layers):
        if id(layer) not in listed:
            extra[f"{EXTRA_LAYER}{i}"] = layer
    own = [*getattr(obj, "_trainable_variables", []), *getattr(obj, "_non_trainable_variables", [])]
    for i, var in enumerate(own):
        inner = base_variable(var)
        if id(var) not in listed and (inner is None or id(inner) not in listed):
            extra[f"{EXTRA_VARIABLE}{i}"] = var
    return extra


def _seed_generators(obj: Any, known: dict[str, Any]) -> dict[str, Any]:
    """Keras 3 layers draw dropout and noise from ``SeedGenerator`` objects whose state
    variable ``tf.train.Checkpoint`` does not save, so a resumed run would draw other masks.
    They are added as children named ``.seed_generator_<i>`` (no Python attribute can have
    that name) and each generator's ``state`` as its child."""
    extra: dict[str, Any] = {}
    gens = getattr(obj, "_seed_generators", None) if not isinstance(obj, tf.Variable) else None
    if isinstance(gens, (list, tuple)) and gens:
        listed = {id(v) for v in known.values()}
        for i, g in enumerate(gens):
            if id(g) not in listed and base_variable(getattr(g, "state", None)) is not None:
                extra[f"{EXTRA}{i}"] = g
    state = getattr(obj, "state", None) if type(obj).__name__ == "SeedGenerator" else None
    if not known and base_variable(state) is not None:
        extra["state"] = state
    return extra


@dataclass
class Walk:
    """An object graph as TensorFlow's saver sees it: the objects breadth first, then the
    slot variables of the optimizers among them (``tf.compat.v1.train`` optimizers keep
    Adam's ``m`` and ``v`` there, outside the dependency graph)."""

    objects: list[Any]
    #: each node's children as ``(local name, node id)`` (slot variables have none)
    edges: list[list[tuple[str, int]]]
    #: each node's path of local names from the root (a slot variable: its variable's)
    paths: list[tuple[str, ...]]
    #: each node's key components, as TensorFlow's checkpoint keys name it
    keys: list[list[str]]
    #: optimizer node -> its slot variables, ``(slot name, variable node, slot node)``
    slots: dict[int, list[tuple[str, int, int]]]
    #: whether a node is one pitstop adds to TensorFlow's graph (see EXTRAS)
    extra: list[bool]
    #: optimizer node -> slot variables of variables outside this graph (not saved)
    dropped: dict[int, int]


def walk(root: Any, where: str = "") -> Walk:
    """Breadth-first traversal as TensorFlow's, then the slot variables as TensorFlow lists
    them. Keras layers and variables TensorFlow's own graph does not reach are added after
    it (a second pass, only when there are any), so every key TensorFlow writes stays as it
    writes it."""
    first = _walk(root, _tf_children)
    reached = {id(o) for o in first[0]}
    for o in first[0]:
        if _keras_untracked(o, {}, reached):
            first = _walk(root, lambda obj: children(obj, reached))
            break
    objects, edges, paths = first
    w = Walk(objects, edges, paths, [key_components(p) for p in paths], {},
             [any(is_extra(c) for c in p) for p in paths], {})
    _add_slot_variables(w, where)
    return w


def _slot_names(obj: Any) -> list[str]:
    """The slot names of a ``tf.compat.v1.train`` optimizer (anything with TensorFlow's
    ``get_slot_names``/``get_slot``), or none. Looked up on the class, as a cheap stand-in
    for TensorFlow's ``"get_slot_names" in dir(obj)``."""
    obj = getattr(obj, "_pitstop_root", obj)  # a root= object behind the root's view
    if getattr(type(obj), "get_slot_names", None) is None:
        return []
    return list(obj.get_slot_names())


def _add_slot_variables(w: Walk, where: str) -> None:
    """Append each optimizer's slot variables as TensorFlow's ``serialize_slot_variables``
    does: optimizers in node order, slot names in their order, variables in node order; a
    slot of a variable outside the graph is not saved (counted in ``w.dropped``)."""
    n = len(w.objects)
    ids = {id(o): i for i, o in enumerate(w.objects)}
    for opt_id in range(n):
        names = _slot_names(w.objects[opt_id])
        if not names:
            continue
        opt = getattr(w.objects[opt_id], "_pitstop_root", w.objects[opt_id])
        found = 0
        for slot_name in names:
            for var_id in range(n):
                try:
                    slot = opt.get_slot(w.objects[var_id], slot_name)
                except (AttributeError, KeyError):
                    slot = None
                if slot is None:
                    continue
                key = [*w.keys[var_id], SLOTS, *w.keys[opt_id],
                       trackable_utils.escape_local_name(slot_name)]
                label = "/".join([where, *key] if where else key)
                if id(slot) in ids or (is_trackable(slot) and slot._trackable_children()):
                    raise UnsupportedStateError(
                        f"{label}: this slot variable of {type(opt).__name__} is also an "
                        "object of the graph, or has dependencies of its own; neither "
                        "TensorFlow nor pitstop can save it. Do not track an optimizer's "
                        "slot variables yourself.")
                found += 1
                sid = ids[id(slot)] = len(w.objects)
                w.objects.append(slot)
                w.edges.append([])
                w.paths.append(w.paths[var_id])
                w.keys.append(key)
                w.extra.append(w.extra[var_id] or w.extra[opt_id])
                w.slots.setdefault(opt_id, []).append((slot_name, var_id, sid))
        slots = getattr(opt, "_slots", None)
        total = sum(len(d) for d in slots.values() if isinstance(d, Mapping)) \
            if isinstance(slots, Mapping) else found
        if total > found:
            w.dropped[opt_id] = total - found


def _walk(root: Any, kids: Any) -> tuple[list[Any], list[list[tuple[str, int]]],
                                         list[tuple[str, ...]]]:
    objects: list[Any] = [root]
    ids: dict[int, int] = {id(root): 0}
    paths: list[tuple[str, ...]] = [()]
    edges: list[list[tuple[str, int]]] = []
    queue = deque([0])
    while queue:
        n = queue.popleft()
        out: list[tuple[str, int]] = []
        for name, child in kids(objects[n]).items():
            cid = ids.get(id(child))
            if cid is None:
                cid = ids[id(child)] = len(objects)
                objects.append(child)
                paths.append((*paths[n], name))
                queue.append(cid)
            out.append((name, cid))
        while len(edges) <= n:
            edges.append([])
        edges[n] = out
    return objects, edges, paths


def key_components(path: tuple[str, ...]) -> list[str]:
    return [trackable_utils.escape_local_name(p) for p in path]


def _serialized(obj: Any, where: str) -> dict[str, Any] | None:
    """The tensors ``obj`` saves of its own (not its children's), or None when none."""
    if registration.get_registered_saver_name(obj):
        raise UnsupportedStateError(
            f"{where} ({type(obj).__name__}) is saved by a registered TensorFlow saver; "
            "pitstop cannot capture it. Keep it out of the state, or save it with tf.train.")
    if saveable_object_util.trackable_has_serialize_to_tensor(obj):
        return dict(obj._serialize_to_tensors())
    if type(obj)._gather_saveables_for_checkpoint is not \
            trackable_base.Trackable._gather_saveables_for_checkpoint and \
            obj._gather_saveables_for_checkpoint():
        raise UnsupportedStateError(
            f"{where} ({type(obj).__name__}) is saved through TensorFlow's legacy "
            "SaveableObject API, which pitstop does not capture; give the class "
            "_serialize_to_tensors/_restore_from_tensors (TensorFlow's current API).")
    return None


def capture(root: Any, where: str = "", caveats: list[str] | None = None) -> dict[str, Any]:
    """The state tree of ``root``'s object graph (see the module docstring); what it cannot
    save (slot variables of variables outside the graph) is said in ``caveats``."""
    w = walk(root, where)
    tree: dict[str, Any] = {}
    graph: list[list[Any]] = []
    for n, obj in enumerate(w.objects):
        comps = w.keys[n]
        label = "/".join([where, *comps]) if where else "/".join(comps) or "the root"
        attrs: list[list[str]] = []
        values: dict[str, Any] = {}
        var = base_variable(obj)
        if var is not None and var.dtype == tf.string:
            # no array dtype holds strings: kept as the serialized tensor, read now
            values[VARIABLE_VALUE], kind = tensor_to_leaf(var.read_value(), label)
            attrs.append([VARIABLE_VALUE, VARIABLE_VALUE, kind])
        elif var is not None:
            values[VARIABLE_VALUE] = VariableLeaf(obj, label)
            attrs.append([VARIABLE_VALUE, VARIABLE_VALUE, "variable"])
        elif is_trackable(obj):
            tensors = _serialized(obj, label)
            if tensors:
                legacy = saveable_compat.get_saveable_name(obj)
                for tname, tensor in tensors.items():
                    if isinstance(tensor, Mapping):
                        raise UnsupportedStateError(
                            f"{label} ({type(obj).__name__}) saves sliced tensors; pitstop "
                            "saves whole tensors only")
                    name = f"{legacy}{tname}" if legacy else tname  # as TensorFlow names it
                    values[name], kind = tensor_to_leaf(tensor, label)
                    attrs.append([name, tname, kind])
        if values:
            node = tree
            for c in comps:
                node = node.setdefault(c, {})
            node[ATTRIBUTES] = values
        node_entry: list[Any] = [[[name, cid] for name, cid in w.edges[n]], attrs]
        if n in w.slots:  # [slot name, variable node, slot node], as TensorFlow records them
            node_entry.append([[name, var, sid] for name, var, sid in w.slots[n]])
        graph.append(node_entry)
    if caveats is not None:
        for opt_id, count in w.dropped.items():
            kind = type(getattr(w.objects[opt_id], "_pitstop_root", w.objects[opt_id])).__name__
            name = "/".join(w.keys[opt_id])
            caveats.append(
                f"{f'{name} ({kind})' if name else f'this {kind}'} holds {count} slot variable(s) (e.g. Adam's m and v) of variables that are "
                "not in this object's graph: they are not saved, as tf.train saves a slot "
                "only with its variable, and a resumed run would start them from zero. Put "
                "the variables and the optimizer in one tf.train.Checkpoint or tf.Module "
                "(e.g. Checkpoint(model=model, optimizer=opt)).")
    tree[GRAPH] = graph
    return tree


# ------------------------------------------------------------------------------ restore
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


def _valid_graph(graph: Any) -> bool:
    if not isinstance(graph, list) or not graph:
        return False
    n = len(graph)
    for node in graph:
        if not (isinstance(node, list) and len(node) in (2, 3) and isinstance(node[0], list)
                and isinstance(node[1], list) and (len(node) == 2 or isinstance(node[2], list))):
            return False
        for ref in node[2] if len(node) == 3 else ():  # [slot name, variable, slot variable]
            if not (isinstance(ref, list) and len(ref) == 3 and isinstance(ref[0], str)
                    and all(type(i) is int and 0 <= i < n for i in ref[1:])):
                return False
        for edge in node[0]:
            if not (isinstance(edge, list) and len(edge) == 2 and isinstance(edge[0], str)
                    and type(edge[1]) is int and 0 <= edge[1] < n):
                return False
        for attr in node[1]:
            if not (isinstance(attr, list) and len(attr) == 3
                    and all(isinstance(a, str) for a in attr)):
                return False
    return True


def _saved_paths(graph: list[list[Any]]) -> list[tuple[str, ...]]:
    """Each saved node's first breadth-first path, as the capture named it."""
    paths: list[tuple[str, ...] | None] = [None] * len(graph)
    paths[0] = ()
    queue = deque([0])
    while queue:
        n = queue.popleft()
        base = paths[n]
        assert base is not None
        for name, cid in graph[n][0]:
            if paths[cid] is None:
                paths[cid] = (*base, name)
                queue.append(cid)
    return [p if p is not None else ("<unreachable>",) for p in paths]


def saved_keys(graph: list[list[Any]], paths: list[tuple[str, ...]] | None = None
               ) -> list[list[str]]:
    """Each saved node's key components: its path's, or a slot variable's
    (``<variable>/.OPTIMIZER_SLOT/<optimizer>/<slot name>``, as TensorFlow keys it)."""
    paths = paths if paths is not None else _saved_paths(graph)
    keys = [key_components(p) for p in paths]
    for opt_sid, node in enumerate(graph):
        for slot_name, var_sid, slot_sid in (node[2] if len(node) > 2 else ()):
            keys[slot_sid] = [*keys[var_sid], SLOTS, *keys[opt_sid],
                              trackable_utils.escape_local_name(slot_name)]
    return keys


def _pretty_names(graph: list[list[Any]], paths: list[tuple[str, ...]]) -> list[str]:
    names = [".".join(["(root)", *p]) for p in paths]
    for opt_sid, node in enumerate(graph):
        for slot_name, var_sid, slot_sid in (node[2] if len(node) > 2 else ()):
            names[slot_sid] = f"{names[var_sid]}'s state {slot_name!r} for {names[opt_sid]}"
    return names


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
