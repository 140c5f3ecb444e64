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

import contextlib
import contextvars
import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from pitstop.core.errors import CheckpointError, UnsupportedStateError
from pitstop.core.format.dtypes import check_savable_dtype
from pitstop.core.tree import ArrayLeaf

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


#: set by :func:`allow_dtype_cast`: targets captured inside it may take another floating dtype
_CAST: contextvars.ContextVar[bool] = contextvars.ContextVar("pitstop_jax_cast", default=False)
CAST_HINT = ("to convert it on restore, as Orbax's ArrayRestoreArgs(dtype=...) does, load "
             "inside `with pitstop.adapters.jax.allow_dtype_cast():`")


@contextlib.contextmanager
def allow_dtype_cast() -> Iterator[None]:
    """Inside it, a restore into a JAX target (a ``jax.Array`` or ``jax.ShapeDtypeStruct``)
    of another floating dtype than the saved one converts the saved values to the target's
    dtype (``bfloat16`` from ``float32``, rounded to nearest even, as Orbax casts), instead
    of refusing. Only between floating dtypes; anything else is still refused."""
    token = _CAST.set(True)
    try:
        yield
    finally:
        _CAST.reset(token)


def layout_of(sharding: Any) -> dict[str, Any] | None:
    """The manifest's record of a ``NamedSharding`` (mesh shape, axis names and types, the
    partition spec, the device ids in mesh order), or None for any other sharding."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    try:
        return _LAYOUTS[sharding]
    except KeyError:
        pass
    except TypeError:  # unhashable: computed each time
        return _layout(sharding)
    if len(_LAYOUTS) > 256:
        _LAYOUTS.clear()
    made = _LAYOUTS[sharding] = _layout(sharding)
    return made


_LAYOUTS: dict[Any, dict[str, Any] | None] = {}


def _layout(sharding: Any) -> dict[str, Any] | None:
    mesh = sharding.mesh
    if not isinstance(mesh, jax.sharding.Mesh):  # an AbstractMesh holds no devices
        return None
    spec: list[Any] = []
    for part in sharding.spec:
        if part is None or isinstance(part, str):
            spec.append(part)
        elif isinstance(part, tuple) and all(isinstance(p, str) for p in part):
            spec.append(list(part))
        else:  # UNCONSTRAINED and kin: not a placement to record
            return None
    layout: dict[str, Any] = {
        "kind": "NamedSharding", "mesh_shape": [int(n) for n in mesh.devices.shape],
        "axis_names": [str(a) for a in mesh.axis_names], "spec": spec,
        "devices": [int(d.id) for d in mesh.devices.flat],
        "job_devices": jax.device_count()}
    types = getattr(mesh, "axis_types", None)
    if types:
        layout["axis_types"] = [getattr(t, "name", str(t)) for t in types]
    memory_kind = getattr(sharding, "memory_kind", None)
    if isinstance(memory_kind, str):
        layout["memory_kind"] = memory_kind
    return layout


def describe(layout: dict[str, Any]) -> str:
    """A recorded layout as a user reads it: ``NamedSharding(mesh {'data': 4}, P('data'))``."""
    mesh = dict(zip(layout.get("axis_names", []), layout.get("mesh_shape", []), strict=False))
    spec = ", ".join("None" if p is None else repr(p) if isinstance(p, str) else
                     repr(tuple(p)) for p in layout.get("spec", []))
    return f"NamedSharding(mesh {mesh}, P({spec}))"


def sharding_from(layout: Any) -> tuple[Any, str | None]:
    """``(sharding, None)``: the recorded layout rebuilt on this job's devices (the recorded
    devices when this job has as many devices as the saving job and those among them, else
    all of this job's devices when the mesh had as many, in ``jax.devices()`` order);
    ``(None, why)`` when this job cannot hold it;
    ``(None, None)`` when nothing usable was recorded."""
    if not isinstance(layout, dict) or layout.get("kind") != "NamedSharding":
        return None, None
    key = json.dumps(layout, sort_keys=True)
    hit = _SHARDINGS.get(key)
    if hit is None:
        hit = _SHARDINGS[key] = _sharding(layout)
        if len(_SHARDINGS) > 256:
            _SHARDINGS.clear()
    return hit


_SHARDINGS: dict[str, tuple[Any, str | None]] = {}


def _sharding(layout: dict[str, Any]) -> tuple[Any, str | None]:
    try:
        shape = tuple(int(n) for n in layout["mesh_shape"])
        names = tuple(str(a) for a in layout["axis_names"])
        spec = [p if p is None or isinstance(p, str) else tuple(p) for p in layout["spec"]]
        ids = [int(i) for i in layout.get("devices", [])]
        job = int(layout.get("job_devices", -1))
    except (KeyError, TypeError, ValueError):
        return None, None  # a record this version cannot read: as if none
    n = math.prod(shape)
    devices = jax.devices()
    by_id = {d.id: d for d in devices}
    if len(ids) == n and job == len(devices) and all(i in by_id for i in ids):
        chosen = [by_id[i] for i in ids]  # a job like the saving one: the same devices
    elif len(devices) == n:
        chosen = list(devices)
    else:
        return None, (f"its mesh has {n} devices and this job has {len(devices)} "
                      f"({devices[0].platform})")
    kwargs: dict[str, Any] = {}
    types = layout.get("axis_types")
    axis_type = getattr(jax.sharding, "AxisType", None)
    if types and axis_type is not None:
        try:
            kwargs["axis_types"] = tuple(axis_type[t] for t in types)
        except KeyError:
            pass
    try:
        mesh = jax.sharding.Mesh(np.array(chosen, dtype=object).reshape(shape), names, **kwargs)
        memory_kind = layout.get("memory_kind")
        extra = {"memory_kind": memory_kind} if isinstance(memory_kind, str) else {}
        try:
            return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec),
                                              **extra), None
        except Exception:  # noqa: BLE001 - a memory kind these devices lack: the default one
            return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)), None
    except Exception as e:  # noqa: BLE001 - whatever JAX refuses in the record
        return None, f"JAX cannot rebuild it here ({type(e).__name__}: {e})"


def _floating(dt: np.dtype) -> bool:
    try:
        return bool(jax.numpy.issubdtype(dt, jax.numpy.floating))
    except TypeError:
        return False


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
        #: the target's own dtype, sharding and placement (a restore may take the saved
        #: layout where the target left its placement open, see :meth:`accept_saved`)
        self._own = (self.dtype, self.sharding, self.committed)
        #: restored in ``self.dtype`` and converted to this one (allow_dtype_cast)
        self.cast_to: np.dtype | None = None
        self.cast_ok = _CAST.get()
        #: why the placement the checkpoint recorded cannot be used here (refused)
        self._unplaceable: str | None = None
        self._pieces: list[tuple[Index, ArrayLeaf]] | None = None
        if array is None or array.is_deleted():
            return
        if self.committed:
            self.layout = layout_of(self.sharding)
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
    def accept_saved(self, dtype: np.dtype, layout: Any) -> str | None:
        """Before the restore compares this target with the checkpoint: a target without a
        sharding (a ``jax.ShapeDtypeStruct`` from ``jax.eval_shape``) takes the sharding the
        checkpoint recorded; a floating target of another floating dtype takes the saved one
        and converts after reading, inside :func:`allow_dtype_cast` (else the hint names it)."""
        self.dtype, self.sharding, self.committed = self._own
        self.cast_to = self._unplaceable = None
        hint = None
        if dtype != self.dtype and _floating(dtype) and _floating(self.dtype):
            if self.cast_ok:
                self.cast_to, self.dtype = self.dtype, np.dtype(dtype)
            else:
                hint = CAST_HINT
        if self.array is None and self.sharding is None and layout is not None:
            sharding, why = sharding_from(layout)
            if sharding is not None:
                self.sharding, self.committed = sharding, True
            elif why is not None:
                self._unplaceable = (
                    f"the checkpoint recorded it as {describe(layout)}, which this job's "
                    f"devices cannot hold: {why}; pass a target with a sharding for it "
                    "(jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(...)))"
                    ", e.g. jax.tree.map over jax.eval_shape's result)")
        return hint

    def check_restorable(self) -> None:
        """Refuse, before anything is read, what JAX could not build exactly: a 64-bit dtype
        with 64-bit types off, a sharding that does not divide the shape, or a recorded
        sharding this job's devices cannot hold for a target that gave none."""
        if self._unplaceable is not None:
            raise UnsupportedStateError(self._unplaceable)
        made = self.cast_to if self.cast_to is not None else self.dtype
        with jax.enable_x64(self.x64):
            canonical = np.dtype(jax.dtypes.canonicalize_dtype(made))
        if canonical != made:
            raise UnsupportedStateError(
                f"{self.where or 'this array'} is {made} in the target, "
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
        cast = self.cast_to
        if cast is not None:  # converted on the host, shard by shard (round to nearest even)
            raw = read

            def read(index: Index) -> np.ndarray:
                return raw(index).astype(cast)
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
        want = cast if cast is not None else self.dtype
        if np.dtype(made.dtype) != want:
            raise CheckpointError(
                f"JAX made the restored array {self.where or ''} {made.dtype}, not the "
                f"{want} asked for; turn 64-bit types on (jax_enable_x64) to restore it exactly")
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
