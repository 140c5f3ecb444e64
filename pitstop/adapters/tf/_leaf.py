"""TensorFlow values as pitstop leaves: variables by reference, other tensors by value."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from pitstop.core.errors import UnsupportedStateError
from pitstop.core.tree import ArrayLeaf


def base_variable(obj: Any) -> tf.Variable | None:
    """The ``tf.Variable`` holding ``obj``'s value (``obj`` itself, or the one inside a Keras 3
    variable on the TensorFlow backend), or None when ``obj`` is no variable."""
    if isinstance(obj, tf.Variable):
        return obj
    inner = getattr(obj, "value", None) if _is_keras_variable(obj) else None
    return inner if isinstance(inner, tf.Variable) else None


def _is_keras_variable(obj: Any) -> bool:
    return any(c.__module__.startswith("keras") and c.__name__ == "Variable"
               for c in type(obj).__mro__)


def numpy_dtype(dtype: tf.DType, where: str) -> np.dtype:
    """The numpy dtype pitstop stores a TensorFlow dtype as (bfloat16 via ml_dtypes)."""
    try:
        dt = np.dtype(dtype.as_numpy_dtype)
    except TypeError:
        dt = np.dtype(object)
    if dtype.is_quantized and dt.names and len(dt.names) == 1:
        # qint8, quint8, qint32...: numpy names them as one-field records of the integer
        # TensorFlow stores (and hands back from .numpy())
        dt = dt.fields[dt.names[0]][0]
    if dt.hasobject or dt.names or dtype in (tf.resource, tf.variant, tf.string):
        raise UnsupportedStateError(
            f"{where or 'a variable'} has dtype {dtype.name}; pitstop stores a variable "
            "placed straight in the state as an array, which needs a numeric dtype. Put it in "
            "a tf.Module or tf.train.Checkpoint instead (saved there as tf.train saves it).")
    return dt


def as_variable_value(value: Any, var: tf.Variable) -> tf.Tensor:
    """A restored host array (or tensor) as a tensor ``var`` can take: its own dtype, so a
    quantized variable takes the integers it was saved as."""
    if isinstance(value, tf.Tensor) and value.dtype == var.dtype:
        return value
    return tf.convert_to_tensor(np.asarray(value), dtype=var.dtype)


def current_shape(var: tf.Variable) -> tuple[int, ...]:
    """The shape of ``var``'s value now: its static shape, or, for a variable created with
    an undefined (or partly undefined) shape, the shape of what it holds."""
    if var.shape.is_fully_defined():
        return tuple(int(s) for s in var.shape)
    return tuple(int(s) for s in tf.shape(var.read_value()).numpy())


class VariableLeaf(ArrayLeaf):
    """A reference to one live ``tf.Variable``: read when the snapshot is taken, assigned on
    restore. A read shares the variable's buffer and TensorFlow copies on the next write, so
    the snapshot stays consistent while training goes on."""

    __slots__ = ("variable", "where", "shape", "dtype")

    def __init__(self, variable: Any, where: str = "") -> None:
        var = base_variable(variable)
        if var is None:
            raise UnsupportedStateError(f"{where or 'this object'} is not a tf.Variable")
        #: the tf.Variable itself (inside a Keras variable: the one that holds the value)
        self.variable = var
        self.where = where
        self.dtype = numpy_dtype(var.dtype, where)
        # a variable of undefined shape (tf.Variable(..., shape=tf.TensorShape(None))) is
        # saved as what it holds now, as tf.train saves it
        self.shape = current_shape(var)

    def snapshot_into(self, out: np.ndarray) -> None:
        value = self.variable.read_value()
        np.copyto(out, np.asarray(value).reshape(self.shape))  # a view of the read buffer

    def assign(self, value: np.ndarray) -> None:
        self.variable.assign(as_variable_value(value, self.variable))


def tensor_to_leaf(tensor: Any, where: str) -> tuple[Any, str]:
    """A tensor an object serializes (not a variable) as ``(leaf, kind)``: numeric tensors as
    numpy arrays (``"tensor"``), strings and variants (a ``tf.data`` iterator's state) as their
    serialized bytes in a uint8 array (``"serialized:<dtype>"``)."""
    t = tensor() if callable(tensor) and not isinstance(tensor, tf.Tensor) else tensor
    t = tf.convert_to_tensor(t)
    if t.dtype in (tf.variant, tf.string):
        raw = tf.io.serialize_tensor(t).numpy()
        return np.frombuffer(raw, np.uint8).copy(), f"serialized:{t.dtype.name}"
    dt = numpy_dtype(t.dtype, where)
    return np.array(np.asarray(t.numpy()).view(dt), dtype=dt, copy=True), "tensor"


def leaf_to_tensor(value: Any, kind: str, where: str) -> tf.Tensor:
    """The tensor a restored leaf of ``kind`` stands for (see :func:`tensor_to_leaf`)."""
    if kind.startswith("serialized:"):
        dtype = tf.dtypes.as_dtype(kind.split(":", 1)[1])
        raw = np.ascontiguousarray(value, np.uint8).tobytes()
        return tf.io.parse_tensor(raw, out_type=dtype)
    if isinstance(value, ArrayLeaf):
        value = value.variable.read_value() if isinstance(value, VariableLeaf) else value
    return tf.convert_to_tensor(value)
