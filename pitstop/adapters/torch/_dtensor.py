"""A ``torch.distributed.tensor.DTensor`` as a sharded array leaf.

A DTensor (FSDP2 ``fully_shard`` parameters and optimizer states, tensor parallel weights,
``distribute_tensor``) is one global array of which each rank holds a local tensor. Its
leaf has the **global** shape; :meth:`DTensorLeaf.pieces` gives this rank's local tensor
with its ``(start, stop)`` region per dimension in global coordinates, so a checkpoint
records which part of the array each rank saved. A restore reads exactly this rank's region
of the checkpoint (the reader assembles it from whichever shards were saved, or slices a
plain array) and writes it in place into the local tensor: the same DTensor (and
``nn.Parameter``) objects hold the restored values, whatever the sharding they were saved
with.

The region comes from the DTensor's own metadata: ``Shard`` follows ``torch.chunk`` (the
last shards of an uneven split are short or empty), ``_StridedShard`` (FSDP2 + TP) is asked
for its index list, and the result is checked against what DCP's planner uses
(``compute_local_shape_and_global_offset``) and against the local tensor itself. A local
tensor that is not one rectangular region of the global array, and a ``Partial`` placement
(values still to be summed across ranks), are refused with the fix.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from pitstop.adapters.torch._leaf import TensorLeaf, named, numpy_dtype
from pitstop.core.errors import UnsupportedStateError
from pitstop.core.tree import ArrayLeaf

Index = tuple[tuple[int, int], ...]


def is_dtensor(obj: Any) -> bool:
    """Whether ``obj`` is a DTensor, without importing ``torch.distributed.tensor`` (a DTensor
    can only exist once that module is loaded)."""
    mod = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    return cls is not None and isinstance(obj, cls)


def local_tensor(dtensor: Any) -> torch.Tensor:
    """The plain tensor holding this rank's part of ``dtensor``: the very storage the DTensor
    computes with (never a copy), waited for when it is the result of a pending collective."""
    with torch.no_grad():  # to_local() outside autograd is the local tensor itself
        local = dtensor.to_local()
    wait = getattr(local, "wait", None)
    if type(local).__name__ == "AsyncCollectiveTensor" and callable(wait):
        local = wait()
    return local  # type: ignore[no-any-return]


def local_region(dtensor: Any, where: str = "") -> Index | None:
    """``(start, stop)`` per dimension of the global array that this rank's local tensor
    holds, or None when this rank is not part of the DTensor's mesh (it holds nothing).

    Raises :class:`UnsupportedStateError` for a ``Partial`` placement and for a local tensor
    that is not one rectangular region of the global array.
    """
    shape = tuple(int(s) for s in dtensor.shape)
    mesh = dtensor.device_mesh
    placements = tuple(dtensor.placements)
    key: Any = (shape, mesh, placements)
    try:
        return _REGIONS[key]  # the same layout at every save: computed once
    except KeyError:
        pass
    except TypeError:  # an unhashable mesh or placement: computed each time
        key = None
    for mesh_dim, p in enumerate(placements):
        if p.is_partial():
            raise UnsupportedStateError(
                f"{named(where)} is a DTensor with a Partial placement ({p}) on mesh "
                f"dimension {mesh_dim}: each rank holds a term of a pending reduction, not "
                "values of the tensor. Reduce it first and keep the result in the state: "
                "t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim) (or "
                "Shard(d) placements), or t.full_tensor().")
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    region = _region(shape, tuple(int(n) for n in mesh.shape), tuple(int(c) for c in coord),
                     placements, where)
    _cross_check(dtensor, shape, region, where)
    if key is not None and len(_REGIONS) < _MAX_REGIONS:
        _REGIONS[key] = region
    return region


#: (global shape, mesh, placements) -> this rank's region, for layouts seen before
_REGIONS: dict[Any, Index | None] = {}
_MAX_REGIONS = 1 << 16


def _region(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...],
            placements: Sequence[Any], where: str) -> Index:
    """The region of ``shape`` the rank at ``coord`` holds, placements applied left to right
    (DTensor's convention): each dimension's global indices, then checked to be a range."""
    from torch.distributed.tensor.placement_types import Shard

    strided = _strided_type()
    held: list[range | list[int]] = [range(n) for n in shape]
    for mesh_dim, p in enumerate(placements):
        if p.is_replicate():
            continue
        n, rank = mesh_shape[mesh_dim], coord[mesh_dim]
        if strided is not None and isinstance(p, strided):
            dim = int(p.dim)
            offsets = _strided_offsets(p, len(held[dim]), n, rank, where)
            cur = held[dim]
            held[dim] = [cur[o] for o in offsets]
        elif isinstance(p, Shard):
            dim = int(p.dim)
            cur = held[dim]
            size = len(cur)
            chunk = -(-size // n) if size else 0  # torch.chunk: ceil(size / n) per chunk
            start = min(chunk * rank, size)
            held[dim] = cur[start:min(start + chunk, size)]
        else:
            raise UnsupportedStateError(
                f"{named(where)} is a DTensor with a {p} placement on mesh dimension "
                f"{mesh_dim}, which pitstop does not know how to map to a region of the "
                "array; redistribute it to Shard(d) / Replicate() placements before saving.")
    out: list[tuple[int, int]] = []
    for dim, idx in enumerate(held):
        if len(idx) == 0:
            out.append((0, 0))
            continue
        first = idx[0]
        if not (isinstance(idx, range) and idx.step == 1) and \
                list(idx) != list(range(first, first + len(idx))):
            raise UnsupportedStateError(
                f"{named(where)} is a DTensor whose local tensor on this rank holds rows "
                f"{_some(list(idx))} of dimension {dim} (placements {list(placements)}): not "
                "one contiguous block of the global array, which pitstop stores shard by "
                "shard. Redistribute it to Shard(d) / Replicate() placements (or use a mesh "
                "whose shards are contiguous) before saving or restoring it.")
        out.append((first, first + len(idx)))
    return tuple(out)


def _strided_type() -> Any:
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # a torch without it: no DTensor can have one
        return None
    return _StridedShard


def _strided_offsets(p: Any, size: int, n: int, rank: int, where: str) -> list[int]:
    """The indices (into the current ``size`` elements of its dimension) a ``_StridedShard``
    gives rank ``rank`` of ``n``, asked of the placement itself (its API moved across torch
    releases: ``offset_mode`` in 2.10+, ``return_first_offset`` before)."""
    try:
        from torch.distributed.tensor.placement_types import _StridedShardOffsetMode

        got = p._local_shard_size_and_offset(size, n, rank,
                                             offset_mode=_StridedShardOffsetMode.ALL)
    except ImportError:
        try:
            got = p._local_shard_size_and_offset(size, n, rank, return_first_offset=False)
        except (TypeError, AttributeError) as e:
            raise _strided_unknown(p, where, e) from None
    except (TypeError, AttributeError) as e:
        raise _strided_unknown(p, where, e) from None
    count, offsets = got
    if isinstance(offsets, int):
        offsets = list(range(offsets, offsets + int(count)))
    offsets = [int(o) for o in offsets]
    if len(offsets) != int(count):
        raise _strided_unknown(p, where, ValueError(f"{len(offsets)} offsets for {count}"))
    return offsets


def _strided_unknown(p: Any, where: str, e: Exception) -> UnsupportedStateError:
    return UnsupportedStateError(
        f"{named(where)} is a DTensor with a {p} placement (FSDP2 + tensor parallel), whose "
        f"local rows this torch ({torch.__version__}) does not tell pitstop ({type(e).__name__}: "
        f"{e}); redistribute it to Shard(d) / Replicate() placements before saving, or use a "
        "torch release with _StridedShard.local_shard_size_and_offset.")


def _cross_check(dtensor: Any, shape: tuple[int, ...], region: Index, where: str) -> None:
    """The region agrees with what DCP's planner uses for this DTensor (local shape and
    global offset); a disagreement means the placements mean something pitstop does not
    know, and is refused rather than saved or restored at the wrong place."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        return
    sizes, offsets = compute_local_shape_and_global_offset(
        shape, dtensor.device_mesh, dtensor.placements)
    mine = tuple(b - a for a, b in region)
    if tuple(int(s) for s in sizes) != mine or (
            0 not in mine and tuple(int(o) for o in offsets) != tuple(a for a, _ in region)):
        raise UnsupportedStateError(
            f"{named(where)}: the DTensor's placements {list(dtensor.placements)} give this "
            f"rank the block {[list(r) for r in region]} by torch.chunk's rule, but torch says "
            f"size {list(sizes)} at offset {list(offsets)}; redistribute it to Shard(d) / "
            "Replicate() placements before saving or restoring it.")


class DTensorLeaf(TensorLeaf):
    """A live DTensor: global ``shape``, this rank's local tensor as its pieces, restored in
    place region by region (the DTensor and its Parameter stay the same objects)."""

    sharded = True

    def __init__(self, dtensor: Any, where: str = "") -> None:
        # (TensorLeaf.__init__ refuses DTensors; the local tensor gets its checks below)
        #: the DTensor itself: ``apply`` hands this very object back
        self.tensor = dtensor
        self.where = where
        self.shape = tuple(int(s) for s in dtensor.shape)
        self.dtype = numpy_dtype(dtensor.dtype, where)
        self.snapshot_fence: Callable[[], None] | None = None
        #: this rank's region of the global array (None: this rank is not in the mesh)
        self.region = local_region(dtensor, where)
        local = local_tensor(dtensor)
        #: the local tensor as a plain leaf: its snapshot (CPU view or async device copy)
        #: and in-place restore are a plain tensor's
        self.local = TensorLeaf(local, where)
        want = tuple(b - a for a, b in self.region) if self.region is not None else None
        if want is not None and tuple(local.shape) != want:
            raise UnsupportedStateError(
                f"{named(where)} is a DTensor whose local tensor has shape {list(local.shape)}, "
                f"but its placements {list(dtensor.placements)} give this rank "
                f"{list(want)} elements of the global shape {list(self.shape)} (a local tensor "
                "padded or replaced behind DTensor's back?); save t.full_tensor() or a "
                "DTensor made with DTensor.from_local(..., shape=, stride=) instead.")

    # ------------------------------------------------------------------ save
    @property
    def holds_all(self) -> bool:
        """True when this rank's local tensor is the whole array (Replicate placements, a
        one-device mesh)."""
        return self.region is not None and all(
            a == 0 and b == n for (a, b), n in zip(self.region, self.shape, strict=True))

    def pieces(self) -> list[tuple[Index, ArrayLeaf]]:
        """This rank's local tensor with its global region; none when it holds no element
        (an empty shard of an uneven split, a rank outside the mesh). A replica is one piece
        covering the whole array: identical on every rank, stored once."""
        if self.region is None or any(a == b for a, b in self.region):
            return []
        return [(self.region, self.local)]

    def snapshot_into(self, out: np.ndarray) -> None:
        if not self.holds_all:
            raise UnsupportedStateError(
                f"{named(self.where)} is a DTensor of which this rank holds only the block "
                f"{[list(r) for r in self.region or ()]} of {list(self.shape)}; it is saved "
                "shard by shard (pieces()), never as one array on one rank.")
        self.local.snapshot_into(out)
        self.snapshot_fence = self.local.snapshot_fence

    # ------------------------------------------------------------------ restore
    def check_restorable(self) -> None:
        """Refuse, before anything is written, a local tensor that cannot take its region in
        place (elements sharing memory) or that no longer matches the DTensor."""
        local = local_tensor(self.tensor)
        if local is not self.local.tensor and (
                local.shape != self.local.tensor.shape
                or local.data_ptr() != self.local.tensor.data_ptr()):
            raise UnsupportedStateError(
                f"{named(self.where)}: the DTensor's local tensor was replaced after the "
                "state was captured; capture the state again (call restore() with the live "
                "objects) before restoring.")
        self.local.check_restorable()

    def host_view(self) -> np.ndarray | None:
        return None  # restored through restore_from: only this rank's region is read

    def restore_from(self, read: Callable[[Index], np.ndarray]) -> None:  # type: ignore[override]
        """Read this rank's region of the checkpoint and write it into the local tensor in
        place (a host copy, then one device copy for an accelerator tensor)."""
        if self.region is None or any(a == b for a, b in self.region):
            return  # nothing held here: nothing to read
        self.local.assign(np.ascontiguousarray(read(self.region)))

    def assign(self, value: np.ndarray) -> None:
        """Put the whole array ``value`` (global shape) back: this rank's region of it."""
        if tuple(value.shape) != self.shape:
            raise UnsupportedStateError(
                f"cannot restore an array of shape {list(value.shape)} into "
                f"{named(self.where)}, a DTensor of global shape {list(self.shape)}")
        if self.region is None:
            return
        self.local.assign(np.ascontiguousarray(value[tuple(slice(a, b) for a, b in self.region)]))

    def __repr__(self) -> str:
        return (f"DTensorLeaf({self.tensor.dtype}{list(self.shape)}, "
                f"{list(getattr(self.tensor, 'placements', ()))}, region {self.region})")


def _some(items: list[int], n: int = 8) -> str:
    shown = ", ".join(map(str, items[:n]))
    return f"[{shown}{', ...' if len(items) > n else ''}]"


def dtensor_like(param: Any, full: torch.Tensor) -> Any:
    """A DTensor laid out as ``param`` (same mesh and placements) holding ``full``, a plain
    tensor of ``param``'s global shape: each rank keeps only its own region (no collective).
    Used where ``load_state_dict`` would put a whole tensor beside a DTensor parameter."""
    from torch.distributed.tensor import DTensor

    region = local_region(param)
    if region is None:
        local = full.new_empty((0,))
    else:
        local = full[tuple(slice(a, b) for a, b in region)].contiguous()
    device = local_tensor(param).device
    return DTensor.from_local(local.to(device), param.device_mesh, param.placements,
                              run_check=False, shape=param.shape, stride=param.stride())


def tensor_leaf(tensor: torch.Tensor, where: str = "") -> TensorLeaf:
    """The leaf for any tensor: a :class:`TensorLeaf`, or for a DTensor (FSDP2, tensor
    parallel) a sharded ``DTensorLeaf`` of its global shape holding this rank's shard."""
    if is_dtensor(tensor):
        return DTensorLeaf(tensor, where)
    return TensorLeaf(tensor, where)
