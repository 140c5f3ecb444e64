"""The TensorFlow objects a pitstop state can hold, and how each is captured and restored."""

from __future__ import annotations

import sys
import threading
import warnings
from typing import Any

import numpy as np
import tensorflow as tf

from pitstop.adapters.tf import _graph, _restore
from pitstop.adapters.tf._leaf import VariableLeaf, base_variable
from pitstop.core.adapter import Adapter
from pitstop.core.errors import IncompatibleTargetError, UnsupportedStateError
from pitstop.core.tree import ArraySpec


class VariableAdapter(Adapter):
    """A ``tf.Variable`` (or a Keras 3 variable on the TensorFlow backend) placed in the state:
    one array, read at the snapshot, assigned on restore."""

    #: a variable of undefined shape holds values of any shape its own admits: one that
    #: differs from the checkpoint's is given the checkpoint's (``check`` refuses the rest)
    replace_on_mismatch = True

    def can_handle(self, obj: Any) -> bool:
        return base_variable(obj) is not None

    def capture(self, obj: Any) -> VariableLeaf:
        return VariableLeaf(obj)

    def check(self, obj: Any, tree: Any) -> None:
        var = base_variable(obj)
        if not isinstance(tree, ArraySpec):
            raise IncompatibleTargetError(
                f"the checkpoint holds a {type(tree).__name__} here, not a variable's array; "
                "restore into the kind of object that saved it")
        problem = _restore.variable_problem(var, tree)
        if problem:
            raise IncompatibleTargetError(problem)

    def apply(self, obj: Any, tree: Any) -> None:
        if isinstance(tree, np.ndarray):  # not restored in place: assign it
            VariableLeaf(obj).assign(tree)


class TrackableAdapter(Adapter):
    """Any trackable TensorFlow object (``tf.train.Checkpoint``, ``tf.Module``, Keras 3 models,
    layers and optimizers on the TensorFlow backend, ``tf.random.Generator``, ``tf.data``
    iterators): its object graph, matched on restore by TensorFlow's rules (see ``_graph``).

    Restores like ``tf.train.Checkpoint.restore``: values go to the objects the saved graph
    reaches by the same local names; objects not created yet get theirs when they are."""

    #: a graph that differs from the saved one (a model not built yet, a renamed attribute)
    #: is matched object by object, not refused as a whole
    replace_on_mismatch = True

    def can_handle(self, obj: Any) -> bool:
        return _graph.is_trackable(obj) and base_variable(obj) is None

    def frameworks(self, obj: Any) -> tuple[str, ...]:
        """The frameworks besides TensorFlow that wrote ``obj`` (the manifest's
        writer["frameworks"]): Keras for its models, layers and optimizers."""
        keras = sys.modules.get("keras")
        if keras is not None and isinstance(obj, (keras.Layer, keras.Optimizer)):
            return ("keras",)
        return ()

    def __init__(self) -> None:
        #: what the last capture could not save, by the captured object's id (``caveats``
        #: is asked right after ``capture``, on the same thread)
        self._caveats = threading.local()

    def capture(self, obj: Any) -> dict[str, Any]:
        caveats: list[str] = []
        self._caveats.last = (id(obj), caveats)
        try:
            return _graph.capture(obj, caveats=caveats)
        except tf.errors.OpError as e:
            raise UnsupportedStateError(
                f"TensorFlow could not capture this {type(obj).__name__}: {e.message}. A "
                "tf.data iterator whose pipeline holds external state (tf.py_function, a "
                "stateful map) cannot be saved; make those steps stateless or drop the "
                "iterator from the state.") from None

    def caveats(self, obj: Any) -> list[str]:
        """What the capture of ``obj`` just taken could not save (said once by the manager)."""
        last = getattr(self._caveats, "last", None)
        return list(last[1]) if last is not None and last[0] == id(obj) else []

    def check(self, obj: Any, tree: Any) -> None:
        _restore.Restore(tree).check(obj)
        _refuse_keras_without_match(obj, tree)

    def apply(self, obj: Any, tree: Any) -> None:
        r = _restore.Restore(tree)
        _restore.restore_into(obj, tree, restore=r)
        _warn_unmatched(obj, r)


def _refuse_keras_without_match(obj: Any, tree: Any) -> None:
    """A built Keras model none of whose variables would get a value from a checkpoint that
    holds values for it was saved from another architecture (a Sequential restored into a
    Functional model): refused, not resumed from its initial weights. (Some unmatched
    attributes are warned about after the restore, as tf.train would leave them.)"""
    keras = sys.modules.get("keras")
    if keras is None or not isinstance(obj, keras.Layer):
        return
    # its weights, not its variables: those include the seed state of its Dropout layers,
    # which a model not built yet already holds
    mine = {id(base_variable(v)) for v in obj.weights}
    if not mine:
        return  # not built yet: its variables take their values when created (deferred)
    r = _restore.Restore(tree)
    saved = [s for s, (_c, attrs, *_slots) in enumerate(r.graph) if attrs]
    if not saved:
        return
    matched = {id(base_variable(o)) for o, _ in r.pairs(obj, defer=False)
               if base_variable(o) is not None}
    if not mine & matched:
        raise IncompatibleTargetError(
            f"none of this {type(obj).__name__}'s {len(mine)} variables has a value in the "
            f"checkpoint's object ({len(saved)} saved values: {r.label(saved[0])}, ...): it was "
            "saved from another architecture or model class (TensorFlow matches by attribute "
            "names). Restore into the model it was saved from.")


def _warn_unmatched(obj: Any, r: _restore.Restore) -> None:
    """Matching by local names, as tf.train's, leaves a renamed attribute's variables at
    their initial values with no error; tf.train's status would say so at
    ``assert_consumed()``, which a pitstop state has no place for: say it here, when saved
    values found no object *and* existing variables got no value (objects merely not created
    yet are not warned about)."""
    unused = [s for s, (_c, attrs, *_slots) in enumerate(r.graph)
              if attrs and s not in r.outcome.matched]
    if not unused:
        return
    matched = {id(o) for o in r.outcome.live()}
    w = _graph.walk(obj)
    unset = ["/".join(key) for o, key, extra in zip(w.objects, w.keys, w.extra, strict=True)
             if id(o) not in matched and not extra
             and (base_variable(o) is not None or (_graph.is_trackable(o) and _graph.serializes(o)))]
    if not unset:
        return

    def some(items: list[str]) -> str:
        return ", ".join(items[:5]) + (f" and {len(items) - 5} more" if len(items) > 5 else "")

    warnings.warn(
        f"pitstop: restoring a {type(obj).__name__}: {len(unused)} saved object(s) with values "
        f"found no object of that name ({some([r.label(s) for s in unused])}) and "
        f"{len(unset)} existing variable(s) got no value ({some(unset)}). TensorFlow matches "
        "objects by attribute name, so a renamed or added attribute keeps its initial "
        "values, as with tf.train (whose assert_consumed() would fail); use the attribute "
        "names that saved the checkpoint.", UserWarning, stacklevel=2)


class TensorHint(Adapter):
    """A ``tf.Tensor`` is immutable: there is nothing to restore it into."""

    def can_handle(self, obj: Any) -> bool:
        return isinstance(obj, tf.Tensor) and base_variable(obj) is None

    def capture(self, obj: Any) -> Any:
        raise UnsupportedStateError(
            "a tf.Tensor is immutable, so a restore could not put a value back into it; keep "
            "state that changes in a tf.Variable (restored in place), or save np.asarray(t)")

    def apply(self, obj: Any, tree: Any) -> None:  # pragma: no cover - capture refuses
        raise UnsupportedStateError("a tf.Tensor cannot be restored into")
