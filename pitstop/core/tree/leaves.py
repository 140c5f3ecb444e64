"""Array leaves: references to live arrays (never copies) that adapters subclass for their
framework's buffers, the numpy one, and :class:`ArraySpec` (an array known by shape and
dtype only).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

try:
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # numpy < 2
    from numpy import byte_bounds  # type: ignore[attr-defined,no-redef]

from pitstop.core.errors import UnsupportedStateError
from pitstop.core.format.dtypes import check_savable_dtype


# --------------------------------------------------------------------------- leaves
class ArrayLeaf:
    """A reference to one live array. Subclasses wrap framework buffers (torch, jax, tf).

    The engine calls, in order: ``snapshot_into(out)`` for every leaf (may be asynchronous,
    e.g. a non-blocking device->pinned copy), then each distinct ``snapshot_fence`` once.
    On restore it writes into ``host_view()`` when that is a writable C-contiguous view of
    the live buffer (zero extra copies); otherwise it reads into a scratch array and calls
    ``assign(scratch)``.
    """

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.shape)) * self.dtype.itemsize

    def snapshot_into(self, out: np.ndarray) -> None:
        """Copy the live value into ``out`` (C-contiguous, same shape and dtype)."""
        raise NotImplementedError

    #: Called once after all ``snapshot_into`` of a save, to wait for asynchronous copies.
    snapshot_fence: Callable[[], None] | None = None

    #: The adapter vouches that nothing writes this array between a save and the
    #: framework's next optimizer step (torch parameters and optimizer state, never buffers
    #: a forward pass updates): ``snapshot="lazy"`` may copy it in the background until then
    #: (see :mod:`pitstop.core.save.lazy`).
    lazy_safe = False
    #: Called once per save that copies this leaf lazily, before the copy starts: installs
    #: the framework's fence (torch: an optimizer step pre-hook calling
    #: :func:`pitstop.core.save.lazy.fence_all`). Required with ``lazy_safe``.
    lazy_guard: Callable[[], None] | None = None

    def version(self) -> Any:
        """A token every in-place write to the array changes (torch: ``Tensor._version``),
        or None when there is none: a lazy save compares it to catch writes outside the
        contract."""
        return None

    def host_view(self) -> np.ndarray | None:
        """A writable, C-contiguous numpy view of the live buffer, or None if there is none."""
        return None

    def assign(self, value: np.ndarray) -> None:
        """Put a restored value (C-contiguous host array) into the live object."""
        raise NotImplementedError

    def check_restorable(self) -> None:
        """Raise :class:`UnsupportedStateError` when a restore could not write this leaf
        exactly (read-only, elements sharing memory). Called before any byte is written."""

    def memory_span(self) -> tuple[Any, int, int, Any] | None:
        """``(address space, first byte, end, view)`` of the live memory a restore writes
        (``view`` identifies the exact layout), or None when unknown: two leaves whose spans
        overlap are refused unless they are the same view getting the same bytes."""
        return None

    #: True for a leaf split into shards (:meth:`pieces`); the engine then stores each
    #: distinct shard once and the manifest records the global shape and every shard's index
    sharded = False

    def pieces(self) -> list[tuple[tuple[tuple[int, int], ...], ArrayLeaf]]:
        """``[(index, leaf), ...]``: each distinct shard once, ``index`` its ``(start, stop)``
        per dimension; together they cover the array exactly (only when :attr:`sharded`)."""
        raise NotImplementedError

    #: Optional: ``restore_from(read)`` builds the restored value from regions, where
    #: ``read(index)`` returns the checkpoint's values inside ``index`` (``(start, stop)`` per
    #: dimension) as a host array; a leaf that has it is restored through it (a sharded
    #: target then reads only the shards each of its devices needs)
    restore_from: Callable[[Callable[[tuple[tuple[int, int], ...]], np.ndarray]], None] | None \
        = None
    #: True when restoring only keeps the new value for the adapter's ``apply`` (an
    #: immutable array): nothing live changes before the apply phase
    deferred = False
    #: Optional, JSON-able: how the framework laid the array out over its devices (a JAX
    #: ``NamedSharding``: mesh shape, axis names, partition spec), recorded in the manifest's
    #: ``layouts`` and handed back to :attr:`accept_saved` by a restore; opaque to core
    layout: Any = None
    #: Optional: ``accept_saved(dtype, layout) -> hint``, called by a restore before it
    #: compares the leaf with the checkpoint's entry, with the saved dtype and layout (None
    #: when none was recorded). The leaf may take the saved layout where its target left the
    #: placement open, and the saved dtype where its owner opted into a conversion (it then
    #: reports the saved dtype and converts after reading). Returns a hint the refusal of a
    #: remaining difference adds (the option that would allow it), or None.
    accept_saved: Callable[[np.dtype, Any], str | None] | None = None


class NumpyLeaf(ArrayLeaf):
    """An ``np.ndarray`` leaf: any shape, order or stride; restored in place."""

    __slots__ = ("array", "shape", "dtype", "nbytes")
    nbytes: int  # a slot, set once here: overrides the computed property of ArrayLeaf

    def __init__(self, array: np.ndarray) -> None:
        dt = array.dtype
        if dt.hasobject:
            check_savable_dtype(dt)
        self.array = array
        self.shape = array.shape
        self.dtype = dt.newbyteorder("<") if dt.byteorder == ">" else dt
        self.nbytes = array.nbytes

    def snapshot_into(self, out: np.ndarray) -> None:
        np.copyto(out, self.array)  # same dtype, or a byte swap to little-endian

    def check_restorable(self) -> None:
        """Refuse, before a restore writes anything, an array that cannot take the values."""
        a = self.array
        flags = a.flags
        if flags.writeable and (flags.c_contiguous or flags.f_contiguous):
            return  # the common case: no element can share memory with another
        if not flags.writeable:
            raise UnsupportedStateError(
                "the target is a read-only numpy array; restore into a writable array "
                "(np.array(x) copies one)")
        if has_internal_overlap(a.shape, a.strides, a.itemsize):
            raise UnsupportedStateError(
                f"the target array of shape {list(a.shape)} (strides {list(a.strides)}) has "
                "elements that share memory (a broadcast or as_strided view); restore into an "
                "array that owns its memory (e.g. .copy() it)")

    def memory_span(self) -> tuple[Any, int, int, Any] | None:
        a = self.array
        if a.size == 0:
            return None
        lo, hi = byte_bounds(a)
        return ("cpu", lo, hi, (lo, a.shape, a.strides, a.dtype.str))

    def host_view(self) -> np.ndarray | None:
        a = self.array
        if a.flags.c_contiguous and a.flags.writeable and a.dtype == self.dtype:
            # an ndarray subclass (np.matrix keeps two dimensions) is read as a plain array
            return a if type(a) is np.ndarray else a.view(np.ndarray)
        return None

    def assign(self, value: np.ndarray) -> None:
        target = self.array if type(self.array) is np.ndarray else self.array.view(np.ndarray)
        np.copyto(target, value, casting="equiv")


def has_internal_overlap(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """True when two elements of an array with this layout may share memory (a stride of 0
    on a dimension longer than 1, or strides too short for what they step over)."""
    if 0 in shape:
        return False
    dims = sorted((abs(st), n) for n, st in zip(shape, strides, strict=True) if n > 1)
    extent = itemsize
    for st, n in dims:
        if st < extent:
            return True
        extent = st * (n - 1) + extent
    return False


@dataclass(frozen=True)
class ArraySpec:
    """An array of a checkpoint known by shape and dtype only (what ``Adapter.check`` sees
    before any data is read)."""

    shape: tuple[int, ...]
    dtype: np.dtype

