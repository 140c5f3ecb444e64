"""A ``jax.Array`` as an array leaf: read once to host at the snapshot, rebuilt on restore.

JAX arrays are immutable, so a restore never writes into one: it builds a new array where
the target's sharding says, from the checkpoint's regions (each device reads only the shards
that overlap its own), and the adapter puts the new array where the old one was. A sharded
array is saved shard by shard, each distinct shard once (replicas are not written twice),
without ever gathering the whole array into one buffer.

In a multi-process job (``jax.distributed``) an array that spans processes is saved by each
process as the distinct shards it holds (the core writes a shard held by several processes
once, and checks that the processes' shards cover the array); an array every process holds
whole (``P()`` on a mesh of all processes) is one value, written once. A restore builds only
the shards of this process's devices, for any target sharding and any number of processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ...core.dtypes import check_savable_dtype
from ...core.errors import CheckpointError, UnsupportedStateError
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
        #: an array JAX placed by default (not committed to its device) is restored so too:
        #: it must still combine with arrays on other devices, as in the uninterrupted run
        self.committed = bool(getattr(array, "_committed", True)) if array is not None \
            else self.sharding is not None
        #: 64-bit types on (jax_enable_x64, also as a context) where the state was taken:
        #: the restore builds arrays on reader threads, which do not see the caller's context
        self.x64 = bool(jax.config.read("jax_enable_x64"))
        #: the restored array, set by :meth:`restore_from` and handed back by the adapter
        self.restored: Any = None
        self._pieces: list[tuple[Index, ArrayLeaf]] | None = None
        if array is None or array.is_deleted():
            return
        if not array.is_fully_addressable:
            # an array of several processes (jax.distributed): whole on every process and
            # saved as one value (identical on all ranks, so written once), or saved as the
            # shards this process holds; the ranks' shards together cover it
            if not _whole_everywhere(array):
                self._pieces = _distinct_shards(array, self.shape, self.dtype)
                self.sharded = True
        elif len(array.sharding.device_set) > 1 and not array.is_fully_replicated:
            self._pieces = _distinct_shards(array, self.shape, self.dtype)
            self.sharded = len(self._pieces) > 1

    # ------------------------------------------------------------------ save
    def pieces(self) -> list[tuple[Index, ArrayLeaf]]:
        assert self._pieces is not None
        return self._pieces

    def snapshot_into(self, out: np.ndarray) -> None:
        # (the engine puts the entry's key path in front of these)
        a = self.array
        if a is None:
            raise UnsupportedStateError(
                "it is a jax.ShapeDtypeStruct, which describes an array to restore into and "
                "holds no data to save; save the arrays themselves")
        if a.is_deleted():
            raise UnsupportedStateError(
                "this jax.Array was deleted (donated to a jitted function, or .delete()d); "
                "save the array the function returned instead")
        if len(a.sharding.device_set) > 1:
            a = a.addressable_shards[0].data  # replicated: any one copy is the whole array
        np.copyto(out, np.asarray(a), casting="no")

    # ------------------------------------------------------------------ restore
    def check_restorable(self) -> None:
        """Refuse, before anything is read, what JAX could not build exactly: a 64-bit dtype
        with 64-bit types off, or a sharding that does not divide the shape."""
        with jax.enable_x64(self.x64):
            canonical = np.dtype(jax.dtypes.canonicalize_dtype(self.dtype))
        if canonical != self.dtype:
            raise UnsupportedStateError(
                f"{self.where or 'this array'} is {self.dtype} in the checkpoint and the target, "
                f"but JAX has 64-bit types off and would make it {canonical}; turn them on "
                "(jax.config.update('jax_enable_x64', True)) to restore it exactly")
        if self.sharding is not None:
            try:
                self.sharding.shard_shape(self.shape)
            except Exception as e:  # noqa: BLE001 - JAX's IndivisibleError and kin
                raise UnsupportedStateError(
                    f"the target sharding {self.sharding} cannot hold an array of shape "
                    f"{list(self.shape)} ({type(e).__name__}: {e}); choose a sharding whose "
                    "mesh axes divide the dimensions they split") from None

    def restore_from(self, read: Callable[[Index], np.ndarray]) -> None:
        shape = self.shape
        full = tuple((0, n) for n in shape)
        try:
            with jax.enable_x64(self.x64):
                if not self.committed:
                    made = jax.device_put(read(full))  # on the default device, uncommitted
                else:
                    assert self.sharding is not None  # committed: it has one
                    made = jax.make_array_from_callback(
                        shape, self.sharding, lambda idx: read(normalize(idx or (), shape)))
                if self.weak_type:
                    made = _weak(made)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever JAX raises while building it
            raise CheckpointError(
                f"cannot build the restored array {self.where or ''} of shape {list(shape)} "
                f"({self.dtype}) on {self.sharding}: {type(e).__name__}: {e}") from e
        if np.dtype(made.dtype) != self.dtype:
            raise CheckpointError(
                f"JAX made the restored array {self.where or ''} {made.dtype}, not the saved "
                f"{self.dtype}; turn 64-bit types on (jax_enable_x64) to restore it exactly")
        self.restored = made

    def assign(self, value: np.ndarray) -> None:
        self.restore_from(lambda idx: value[tuple(slice(a, b) for a, b in idx)])

    def __repr__(self) -> str:
        return f"JaxArrayLeaf({self.dtype}{list(self.shape)}, {self.sharding})"


def _whole_everywhere(array: Any) -> bool:
    """True when every process of the job holds the whole array (fully replicated on devices
    of each process): it is one value, the same on every rank. Decided from the sharding
    alone, so every process decides alike."""
    if not array.is_fully_replicated:
        return False
    held_by = {d.process_index for d in array.sharding.device_set}
    return held_by == set(range(jax.process_count()))


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
