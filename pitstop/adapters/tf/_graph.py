"""TensorFlow's object graph, walked and captured as ``tf.train.Checkpoint`` walks it.

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

The restore walk, which matches this graph against live objects, is ``_restore``.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import tensorflow as tf
from tensorflow.python.checkpoint import saveable_compat
from tensorflow.python.saved_model import registration
from tensorflow.python.trackable import base as trackable_base
from tensorflow.python.trackable import trackable_utils
from tensorflow.python.training.saving import saveable_object_util

from pitstop.adapters.tf._leaf import (
    VariableLeaf,
    base_variable,
    tensor_to_leaf,
)
from pitstop.core.errors import (
    UnsupportedStateError,
)

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


