"""Keras 3 variables as pitstop leaves, on every backend (TensorFlow, JAX, PyTorch).

A :class:`KerasVariableLeaf` reads a ``keras.Variable``'s value when the snapshot is taken and
assigns it on restore, through the backend's own tensors; what is stored is a plain array of
the variable's dtype, whatever the backend.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import keras
import numpy as np

from pitstop.core.errors import UnsupportedStateError
from pitstop.core.format.dtypes import ML_DTYPES
from pitstop.core.tree import ArrayLeaf

BACKEND: str = keras.backend.backend()


def numpy_dtype(name: str, where: str = "") -> np.dtype:
    """The numpy dtype pitstop stores a Keras dtype name as (bfloat16, float8 via ml_dtypes)."""
    if name in ML_DTYPES:
        return ML_DTYPES[name]
    try:
        dt = np.dtype(name)
    except TypeError:
        dt = np.dtype(object)
    if dt.hasobject or dt.kind in "OUSV":
        raise UnsupportedStateError(
            f"{where or 'a Keras variable'} has dtype {name}; pitstop saves Keras variables "
            "as numeric arrays. Keep this value out of the state (or save it as a plain value).")
    return dt


def _host(value: Any) -> np.ndarray:
    """A host numpy array holding ``value`` (a view where the backend can give one)."""
    if BACKEND == "torch":
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if str(t.dtype) == "torch.bfloat16":
            import torch  # the backend is torch: already imported

            return t.view(torch.int16).numpy().view(ML_DTYPES["bfloat16"])
        return t.numpy()
    if BACKEND == "jax":
        return np.asarray(value)
    return np.asarray(keras.ops.convert_to_numpy(value))


class KerasVariableLeaf(ArrayLeaf):
    """A reference to one live ``keras.Variable``: read at the snapshot, assigned on restore.

    On JAX a variable's value is an immutable array (the snapshot reads a consistent buffer);
    on PyTorch the CPU tensor's memory is read and, on restore, written in place; on
    TensorFlow the read is a copy of the variable's value.
    """

    __slots__ = ("variable", "where", "shape", "dtype")

    def __init__(self, variable: Any, where: str = "") -> None:
        self.variable = variable
        self.where = where or str(getattr(variable, "path", "") or "")
        self.shape = tuple(int(s) for s in variable.shape)
        self.dtype = numpy_dtype(str(variable.dtype), self.where)

    def snapshot_into(self, out: np.ndarray) -> None:
        a = _host(self.variable.value)
        if a.dtype != self.dtype:
            a = a.astype(self.dtype)
        np.copyto(out, a.reshape(self.shape))

    def host_view(self) -> np.ndarray | None:
        if BACKEND != "torch":
            return None  # JAX arrays are immutable; a TensorFlow read is a copy
        t = self.variable.value
        if t.device.type != "cpu" or not t.is_contiguous() or str(t.dtype) == "torch.bfloat16":
            return None
        view = t.detach().numpy()
        return view if view.dtype == self.dtype and view.flags.writeable else None

    def assign(self, value: np.ndarray) -> None:
        if BACKEND == "torch" and self.dtype == ML_DTYPES.get("bfloat16"):
            import torch

            raw = torch.from_numpy(np.ascontiguousarray(value).view(np.int16))
            self.variable.value.data.copy_(raw.view(torch.bfloat16).reshape(self.shape))
            return
        self.variable.assign(value)


def leaves(variables: Iterable[Any]) -> list[KerasVariableLeaf]:
    """One leaf per variable, in order."""
    return [KerasVariableLeaf(v) for v in variables]
