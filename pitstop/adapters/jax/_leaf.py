"""A ``jax.Array`` as an array leaf: read once to host at the snapshot, rebuilt on restore.

JAX arrays are immutable, so a restore never writes into one: it builds a new array where
the target's sharding says, from the checkpoint's regions (each device reads only the shards
that overlap its own), and the adapter puts the new array where the old one was. A sharded
array is saved shard by shard, each distinct shard once (replicas are not written twice),
without ever gathering the whole array into one buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ...core.dtypes import check_savable_dtype
from ...core.errors import UnsupportedStateError
from ...core.tree import ArrayLeaf

Index = tuple[tuple[int, int], ...]


def host_dtype(dtype: Any, where: str = "") -> np.dtype:
    """The numpy dtype a JAX array of ``dtype`` is stored as (bfloat16, float8 and int4 are
    ml_dtypes types, which numpy holds bit-exactly)."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise UnsupportedStateError(
            f"{where or 'this array'} has dtype {dtype}, which has no numpy equivalent; "
            "convert it before saving") from None
    if dt.hasobject:
        check_savable_dtype(dt)
    return dt


def normalize(index: tuple[slice, ...], shape: tuple[int, ...]) -> Index:
    """A JAX shard index (slices, possibly open) as ``(start, stop)`` per dimension."""
    out = []
    for sl, n in zip(index, shape, strict=False):
        start, stop, _step = sl.indices(n)
        out.append((start, stop))
    out.extend((0, n) for n in shape[len(out):])
    return tuple(out)


class _ShardLeaf(ArrayLeaf):
    """One distinct shard of a sharded array (a single-device array), for the snapshot."""

    __slots__ = ("data", "shape", "dtype")

    def __init__(self, data: Any, dtype: np.dtype) -> None:
        self.data = data
        self.shape = tuple(int(s) for s in data.shape)
        self.dtype = dtype

    def snapshot_into(self, out: np.ndarray) -> None:
        np.copyto(out, np.asarray(self.data), casting="no")


class JaxArrayLeaf(ArrayLeaf):
    """A reference to a live ``jax.Array`` (or, as a restore target only, to a shape,
    dtype and sharding: a ``jax.ShapeDtypeStruct``)."""

    deferred = True

    def __init__(self, array: Any, where: str = "", *, spec: Any = None) -> None:
        src = array if array is not None else spec
        self.array = array
        self.where = where
        self.shape = tuple(int(s) for s in src.shape)
        self.dtype = host_dtype(src.dtype, where)
        self.sharding = getattr(src, "sharding", None)
        self.weak_type = bool(getattr(src, "weak_type", False))
        #: the restored array, set by :meth:`restore_from` and handed back by the adapter
        self.restored: Any = None
        self._pieces: list[tuple[Index, ArrayLeaf]] | None = None
        if array is not None and len(array.sharding.device_set) > 1 \
                and not array.is_fully_replicated:
            if not array.is_fully_addressable:
                raise UnsupportedStateError(
                    f"{where or 'this array'} spans several processes (jax.distributed); this "
                    "pitstop saves arrays whose shards this process holds all of. Gather it "
                    "first (jax.experimental.multihost_utils.process_allgather) or save each "
                    "process's local shards as separate entries.")
            self._pieces = _distinct_shards(array, self.shape, self.dtype)
            self.sharded = len(self._pieces) > 1

    # ------------------------------------------------------------------ save
    def pieces(self) -> list[tuple[Index, ArrayLeaf]]:
        assert self._pieces is not None
        return self._pieces

    def snapshot_into(self, out: np.ndarray) -> None:
        a = self.array
        if a is None:
            raise UnsupportedStateError(
                f"{self.where or 'this entry'} is a jax.ShapeDtypeStruct: it describes an array "
                "to restore into and holds no data to save")
        if len(a.sharding.device_set) > 1:
            a = a.addressable_shards[0].data  # replicated: any one copy is the whole array
        np.copyto(out, np.asarray(a), casting="no")

    # ------------------------------------------------------------------ restore
    def restore_from(self, read: Callable[[Index], np.ndarray]) -> None:
        shape = self.shape
        sharding = self.sharding
        if sharding is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        made = jax.make_array_from_callback(
            shape, sharding, lambda idx: read(normalize(idx or (), shape)))
        if self.weak_type:
            made = _weak(made)
        self.restored = made

    def assign(self, value: np.ndarray) -> None:
        self.restore_from(lambda idx: value[tuple(slice(a, b) for a, b in idx)])

    def __repr__(self) -> str:
        return f"JaxArrayLeaf({self.dtype}{list(self.shape)}, {self.sharding})"


def _distinct_shards(array: Any, shape: tuple[int, ...], dtype: np.dtype
                     ) -> list[tuple[Index, ArrayLeaf]]:
    """Each distinct shard once (the first replica of each index), in index order."""
    seen: dict[Index, ArrayLeaf] = {}
    for shard in sorted(array.addressable_shards, key=lambda s: s.replica_id):
        index = normalize(shard.index, shape)
        if index not in seen:
            seen[index] = _ShardLeaf(shard.data, dtype)
    return sorted(seen.items())


def _weak(x: Any) -> Any:
    """``x`` marked weakly typed, as the array it replaces was (type promotion in the
    resumed run must be the uninterrupted run's)."""
    try:
        from jax._src.lax import lax as _lax

        return _lax._convert_element_type(x, x.dtype, weak_type=True)
    except Exception:  # noqa: BLE001 - a JAX without this internal: strong type, same values
        return x
