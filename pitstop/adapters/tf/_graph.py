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

A restore walks the saved graph from the root together with the live objects, matching
children by local name, exactly as TensorFlow does: renaming a Python attribute breaks a
restore as it does in TensorFlow, and no more. Values whose object does not exist yet are
queued on its parent through TensorFlow's own deferred-restoration hook, so a layer built after
the restore gets its values when it creates its variables.
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

from ...core.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleTargetError,
    UnsupportedStateError,
)
from ...core.tree import ArrayLeaf, ArraySpec
from ._leaf import (
    VariableLeaf,
    as_variable_value,
    base_variable,
    leaf_to_tensor,
    numpy_dtype,
    tensor_to_leaf,
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


def walk(root: Any) -> tuple[list[Any], list[list[tuple[str, int]]], list[tuple[str, ...]]]:
    """Breadth-first traversal as TensorFlow's: objects, each one's children as
    ``(local name, node id)`` and each one's path (local names from the root). Keras layers
    and variables TensorFlow's own graph does not reach are added after it (a second pass,
    only when there are any), so every key TensorFlow writes stays as it writes it."""
    first = _walk(root, _tf_children)
    reached = {id(o) for o in first[0]}
    for o in first[0]:
        if _keras_untracked(o, {}, reached):
            return _walk(root, lambda obj: children(obj, reached))
    return first


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


def capture(root: Any, where: str = "") -> dict[str, Any]:
    """The state tree of ``root``'s object graph (see the module docstring)."""
    objects, edges, paths = walk(root)
    tree: dict[str, Any] = {}
    graph: list[list[Any]] = []
    for n, obj in enumerate(objects):
        comps = key_components(paths[n])
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
        graph.append([[[name, cid] for name, cid in edges[n]], attrs])
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
        with _uid_lock:
            self.restore_uid = next(_uids)
        self.outcome = Outcome()
        if report_unrestored:
            # as tf.train: once the restore is released (no value waits for an object any
            # more), say which values no object took, unless expect_partial() was called
            weakref.finalize(self, _report_unrestored, self.outcome, self.graph, self.paths,
                             where)

    def pretty(self, sid: int) -> str:
        """tf.train's name for a saved object: ``(root).model.layer``."""
        return ".".join(["(root)", *self.paths[sid]])

    # the attribute TensorFlow's deferred-restoration hook sorts by
    @property
    def checkpoint(self) -> Restore:
        return self

    def label(self, sid: int) -> str:
        comps = key_components(self.paths[sid])
        return "/".join([self.where, *comps] if self.where else comps) or (self.where or "root")

    def value(self, sid: int, attr: str) -> Any:
        node = self.tree
        try:
            for c in key_components(self.paths[sid]):
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

    def _has_values(self, sid: int, _seen: set[int] | None = None) -> bool:
        seen = _seen if _seen is not None else set()
        if sid in seen:
            return False
        seen.add(sid)
        return bool(self.graph[sid][1]) or any(
            self._has_values(c, seen) for _, c in self.graph[sid][0])

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
        (s, None) for s, (_c, attrs) in enumerate(graph) if attrs and s not in outcome.matched]
    return out + [(s, a) for s, a in outcome.unused]


def _report_unrestored(outcome: Outcome, graph: list[list[Any]],
                       paths: list[tuple[str, ...]], where: str) -> None:
    if outcome.expect_partial:
        return
    left = unrestored(outcome, graph)
    if not left:
        return
    names = [".".join(["(root)", *paths[s]]) + ("" if a is None else f" ({a})")
             for s, a in left]
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
        if not (isinstance(node, list) and len(node) == 2 and isinstance(node[0], list)
                and isinstance(node[1], list)):
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
