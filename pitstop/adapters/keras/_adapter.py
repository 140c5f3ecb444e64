"""Keras 3 models, layers, optimizers, metrics, seed generators and variables in a pitstop
state, on every backend.

Each object is saved as the ordered list of its variables (``obj.variables``; a seed
generator's ``state``) with their Keras paths beside them. Order, not names, matches a
checkpoint to the target: Keras numbers layer names per process (``dense`` in one run can be
``dense_3`` in the next), while the order of a model's variables is fixed by its
architecture. Every mismatch is refused before a byte is written, naming the variable.
"""

from __future__ import annotations

import sys
from typing import Any

import keras

from pitstop.adapters.keras._leaf import BACKEND, KerasVariableLeaf
from pitstop.core.adapter import Adapter
from pitstop.core.errors import IncompatibleTargetError
from pitstop.core.tree import ArraySpec

_KINDS: tuple[type, ...] = (keras.Layer, keras.optimizers.Optimizer, keras.metrics.Metric,
                            keras.random.SeedGenerator)


def variables_of(obj: Any) -> list[Any]:
    """The variables pitstop saves for a Keras object, in their fixed order."""
    if isinstance(obj, keras.random.SeedGenerator):
        return [obj.state]
    return list(obj.variables)


def _tf_trackable(obj: Any) -> bool:
    if BACKEND != "tensorflow":
        return False
    from pitstop.adapters.tf import _graph  # the TensorFlow backend: TensorFlow is imported already

    return bool(_graph.is_trackable(obj))


def _hint(obj: Any) -> str:
    if isinstance(obj, keras.optimizers.Optimizer):
        return ("build the optimizer before restoring (optimizer.build(model.trainable_variables)"
                ", or train one step), with the same model it was saved with")
    if isinstance(obj, keras.Layer):
        return ("build the model before restoring (call it on a batch, or model.build(shape)),"
                " with the architecture it was saved with")
    return "restore into the same kind of object, built the same way"


class KerasAdapter(Adapter):
    """Keras objects as ordered variable lists (see the module docstring). On the TensorFlow
    backend, objects TensorFlow tracks are left to the TensorFlow adapter, which saves them
    as ``tf.train.Checkpoint`` does (deferred restoration included)."""

    def can_handle(self, obj: Any) -> bool:
        if isinstance(obj, keras.Variable):
            return BACKEND != "tensorflow"  # there a tf.Variable: the TensorFlow adapter's
        return isinstance(obj, _KINDS) and not _tf_trackable(obj)

    def capture(self, obj: Any) -> Any:
        if isinstance(obj, keras.Variable):
            return KerasVariableLeaf(obj)
        vs = variables_of(obj)
        return {"variables": [KerasVariableLeaf(v) for v in vs],
                "paths": [str(v.path) for v in vs]}

    def check(self, obj: Any, tree: Any) -> None:
        name = type(obj).__name__
        if isinstance(obj, keras.Variable):
            if not isinstance(tree, ArraySpec):
                raise IncompatibleTargetError(
                    f"the checkpoint holds a {type(tree).__name__} here, not a variable")
            _check_one(obj, tree, str(obj.path))
            return
        if not (isinstance(tree, dict) and isinstance(tree.get("variables"), list)):
            raise IncompatibleTargetError(
                f"the checkpoint holds no Keras object here, so it cannot restore this {name}")
        saved, paths = tree["variables"], list(tree.get("paths") or [])
        vs = variables_of(obj)
        if len(saved) != len(vs):
            have = {str(v.path) for v in vs}
            missing = [p for p in paths if p not in have][:5]
            raise IncompatibleTargetError(
                f"this {name} has {len(vs)} variables, the checkpoint {len(saved)}"
                + (f" (saved ones not here: {', '.join(missing)})" if missing else "")
                + f"; {_hint(obj)}", mismatched=paths[:5])
        for i, (v, spec) in enumerate(zip(vs, saved, strict=True)):
            _check_one(v, spec, paths[i] if i < len(paths) else str(v.path))

    def apply(self, obj: Any, tree: Any) -> None:
        """Nothing left to do: every variable was assigned in place by the restore."""


def _check_one(var: Any, spec: Any, saved_path: str) -> None:
    leaf = KerasVariableLeaf(var)
    if not isinstance(spec, ArraySpec):
        raise IncompatibleTargetError(f"the checkpoint holds no array for variable {saved_path}")
    if tuple(spec.shape) != leaf.shape or spec.dtype != leaf.dtype:
        why = ("restore into the architecture it was saved with"
               if tuple(spec.shape) != leaf.shape else
               "the same variable has another dtype here: written under another Keras backend "
               "(a seed generator's state is uint32 on JAX, int32 elsewhere) or another "
               "dtype policy; restore under the backend and policy that saved it")
        raise IncompatibleTargetError(
            f"variable {var.path} is {leaf.dtype}{list(leaf.shape)} here but the checkpoint's "
            f"{saved_path} is {spec.dtype}{list(spec.shape)}; {why}",
            mismatched=[str(var.path)])


def writer_info() -> tuple[dict[str, str], tuple[str, ...]]:
    """The Keras plugin's part of the manifest's ``writer["frameworks"]``: the backend
    (``"keras.backend"``), and that backend's module, whose version is recorded too."""
    keras = sys.modules.get("keras")
    try:
        backend = str(keras.backend.backend()) if keras is not None else None
    except Exception:  # noqa: BLE001 - informational only
        backend = None
    if not backend:
        return {}, ()
    more = (backend,) if backend in ("tensorflow", "torch", "jax") else ()
    return {"keras.backend": backend}, more
