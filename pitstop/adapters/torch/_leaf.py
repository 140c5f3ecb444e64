"""A torch tensor as an array leaf: captured by reference, snapshotted and restored in place.

CPU tensors are read and written through a numpy view of their own storage (no copy);
bfloat16 and float8 tensors are viewed as same-width integers and then as the matching
``ml_dtypes`` type, so every byte goes through bit-exact. CUDA tensors are copied with
``non_blocking=True`` into the (page-locked) staging buffer and the snapshot waits once,
in :attr:`TensorLeaf.snapshot_fence`, for all of them. A DTensor (FSDP2, tensor parallel)
becomes a sharded leaf of its global shape (``_dtensor.DTensorLeaf``, see ``_dtensor.tensor_leaf``).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pitstop.core.errors import UnsupportedStateError
from pitstop.core.format.dtypes import ML_DTYPES
from pitstop.core.save.lazy import fence_all
from pitstop.core.tree import ArrayLeaf

log = logging.getLogger("pitstop")

#: torch dtype -> numpy dtype for the dtypes ``Tensor.numpy()`` supports directly
_DIRECT: dict[torch.dtype, np.dtype] = {
    torch.float64: np.dtype(np.float64), torch.float32: np.dtype(np.float32),
    torch.float16: np.dtype(np.float16), torch.complex128: np.dtype(np.complex128),
    torch.complex64: np.dtype(np.complex64), torch.bool: np.dtype(np.bool_),
    torch.int8: np.dtype(np.int8), torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64),
    torch.uint8: np.dtype(np.uint8),
}
for _name, _np in (("uint16", np.uint16), ("uint32", np.uint32), ("uint64", np.uint64)):
    if hasattr(torch, _name):
        _DIRECT[getattr(torch, _name)] = np.dtype(_np)

#: torch dtype -> (same-width integer dtype to view through, the ml_dtypes type's name); the
#: ml_dtypes type itself is looked up at the first such tensor (see core.format.dtypes)
_BIT_NAMES: dict[torch.dtype, tuple[torch.dtype, str]] = {torch.bfloat16: (torch.int16, "bfloat16")}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
              "float8_e8m0fnu"):
    if hasattr(torch, _name):
        _BIT_NAMES[getattr(torch, _name)] = (torch.uint8, _name)
_TORCH_OF_ML: dict[str, torch.dtype] = {name: t for t, (_i, name) in _BIT_NAMES.items()}

_NP_INT = {torch.int16: np.dtype(np.int16), torch.uint8: np.dtype(np.uint8)}
_TORCH_OF_NP: dict[np.dtype, torch.dtype] = {v: k for k, v in _DIRECT.items()}


def _bits(dtype: torch.dtype) -> tuple[torch.dtype, np.dtype] | None:
    """(the integer dtype to view through, the numpy dtype) of a torch dtype numpy has no
    type for but ml_dtypes has, else None."""
    entry = _BIT_NAMES.get(dtype)
    if entry is None or entry[1] not in ML_DTYPES:
        return None
    return entry[0], ML_DTYPES[entry[1]]


def named(where: str, what: str = "tensor") -> str:
    """``tensor 'layer.weight'`` when the key is known, else ``this tensor`` (the core puts
    the state path in front of an adapter's message)."""
    return f"{what} {where!r}" if where else f"this {what}"


def numpy_dtype(dtype: torch.dtype, where: str = "") -> np.dtype:
    """The numpy dtype a tensor of ``dtype`` is saved as; raises for dtypes numpy cannot hold."""
    if dtype in _DIRECT:
        return _DIRECT[dtype]
    bits = _bits(dtype)
    if bits is not None:
        return bits[1]
    raise UnsupportedStateError(
        f"{named(where)} has dtype {dtype}, which pitstop cannot save bit-exactly (no numpy or "
        "ml_dtypes equivalent). Convert it first, e.g. complex32 -> .to(torch.complex64), a "
        "quantized tensor -> .dequantize() or .int_repr(), a packed float4 -> .view(torch.uint8).")


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """Inverse of :func:`numpy_dtype`."""
    dtype = np.dtype(dtype)
    found = _TORCH_OF_NP.get(dtype) or _TORCH_OF_ML.get(ML_DTYPES.name_of(dtype) or "")
    if found is None:
        raise UnsupportedStateError(
            f"the checkpoint holds an array of numpy dtype {dtype}, which has no torch "
            "equivalent; restore it into a numpy array instead of a tensor")
    return found


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A numpy view (no copy, any strides) of a CPU tensor's storage, with the saved dtype."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    bits = _bits(t.dtype)
    if bits is not None:
        return t.view(bits[0]).numpy().view(bits[1])
    return t.numpy()


def from_numpy(a: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``a``'s memory (any supported dtype, incl. bfloat16 and float8)."""
    dt = torch_dtype(a.dtype)
    bits = _bits(dt)
    if bits is not None:
        return torch.from_numpy(a.view(_NP_INT[bits[0]])).view(dt)
    return torch.from_numpy(a)


def to_tensor(a: np.ndarray, like: torch.Tensor | None = None) -> torch.Tensor:
    """A restored numpy array as a tensor on ``like``'s device (CPU when None)."""
    # (np.ascontiguousarray would turn a 0-d array into a 1-d one)
    t = from_numpy(a if a.flags.c_contiguous and a.flags.writeable else a.copy())
    if like is not None and like.device.type != "cpu":
        t = t.to(like.device)
    return t


class TensorLeaf(ArrayLeaf):
    """A reference to one live tensor (parameter, buffer, optimizer state, plain tensor)."""

    def __init__(self, tensor: torch.Tensor, where: str = "") -> None:
        if isinstance(tensor, torch.nn.parameter.UninitializedTensorMixin):  # type: ignore[attr-defined]
            raise UnsupportedStateError(
                f"{named(where, 'parameter')} of a lazy module is not initialized yet; run "
                "one forward pass before saving or restoring.")
        if tensor.layout != torch.strided:
            raise UnsupportedStateError(
                f"{named(where)} has layout {tensor.layout}; only dense tensors are saved. "
                "Convert it with .to_dense() and keep the dense copy in the state.")
        if tensor.is_quantized or tensor.is_nested or tensor.device.type == "meta":
            kind = ("quantized" if tensor.is_quantized else "nested" if tensor.is_nested
                    else "on the meta device (it holds no data)")
            fix = (".dequantize() (or .int_repr())" if tensor.is_quantized else
                   ".to_padded_tensor(0), or .unbind() into a list" if tensor.is_nested else
                   "module.to_empty(device=...) then reset_parameters() (or load real "
                   "weights into it)")
            raise UnsupportedStateError(
                f"{named(where)} is {kind}; pitstop saves dense tensors with data. "
                f"Materialize it before saving: {fix}.")
        if type(tensor).__name__ == "ShardedTensor":
            raise UnsupportedStateError(
                f"{named(where)} is a ShardedTensor (deprecated by torch); convert the model "
                "to DTensor (FSDP2 fully_shard, torch.distributed.tensor) or save each "
                "rank's local_shards() as separate entries.")
        if type(tensor).__name__ == "DTensor":
            raise UnsupportedStateError(
                f"{named(where)} is a DTensor, which a TensorLeaf cannot hold; build its leaf "
                "with pitstop.adapters.torch._dtensor.tensor_leaf() (a sharded DTensorLeaf)")
        #: the live tensor itself (not a detached alias: apply hands this very object back)
        self.tensor = tensor
        #: its key inside the object that holds it ("" for a tensor placed in the state)
        self.where = where
        self.shape = tuple(int(s) for s in tensor.shape)
        self.dtype = numpy_dtype(tensor.dtype, where)
        self.snapshot_fence: Callable[[], None] | None = None
        #: set by the adapters for parameters and optimizer state (see ``lazy_guard``)
        self.lazy_safe = False

    # ------------------------------------------------------------------ lazy snapshot
    @staticmethod
    def lazy_guard() -> None:
        """Every optimizer step waits for pending lazy copies (see :func:`install_fence`)."""
        install_fence()

    def version(self) -> Any:
        """``(_version, data_ptr)``: an in-place write (``p.mul_``, ``copy_``,
        ``load_state_dict``) bumps the first, ``p.data = x`` changes the second. Writes
        through ``p.data`` bump neither (torch gives ``.data`` its own counter)."""
        t = self.tensor
        return (t._version, t.data_ptr())

    # ------------------------------------------------------------------ save
    def snapshot_into(self, out: np.ndarray) -> None:
        t = self.tensor
        if t.device.type == "cpu":
            np.copyto(out, numpy_view(t), casting="no")
            return
        t = t.detach()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        # device -> page-locked host, asynchronously; the fence waits once for all of them
        _ensure_pinned(out)
        from_numpy(out).copy_(t, non_blocking=True)
        self.snapshot_fence = _fence_for(t.device)

    # ------------------------------------------------------------------ restore
    def check_restorable(self) -> None:
        """Refuse, before a restore writes anything, a tensor that cannot take the values
        exactly: one whose elements share memory (an ``expand``ed or ``as_strided`` view), where
        writing element after element would leave the last row everywhere."""
        t = self.tensor
        if _has_internal_overlap(t):
            raise UnsupportedStateError(
                f"cannot restore into {named(self.where)}: its shape {list(t.shape)} with "
                f"stride {list(t.stride())} makes several elements share memory (an expanded "
                "or as_strided view). Restore into a tensor that owns its memory (e.g. .clone() "
                "an expanded view).")

    def host_view(self) -> np.ndarray | None:
        t = self.tensor
        if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
            return None
        view = numpy_view(t)
        return view if view.flags.c_contiguous and view.flags.writeable else None

    def assign(self, value: np.ndarray) -> None:
        self.check_restorable()  # never write the last row everywhere, whoever calls
        t = self.tensor
        try:
            if t.device.type == "cpu" and not t.is_conj() and not t.is_neg():
                np.copyto(numpy_view(t), value, casting="no")
            else:
                src = from_numpy(value if value.flags.c_contiguous else value.copy())
                # an inference tensor takes in-place writes only inside inference mode
                with torch.inference_mode() if t.is_inference() else torch.no_grad():
                    t.copy_(src)
        except (RuntimeError, ValueError, TypeError) as e:
            raise UnsupportedStateError(
                f"cannot restore into {named(self.where)} of shape {list(t.shape)} (stride "
                f"{list(t.stride())}): {e}. Restore into a tensor that owns its memory "
                "(e.g. .clone() an expanded view).") from e

    def __repr__(self) -> str:
        return f"TensorLeaf({self.tensor.dtype}{list(self.shape)} on {self.tensor.device})"


def _has_internal_overlap(t: torch.Tensor) -> bool:
    """True when two elements of ``t`` may share memory: torch's own answer where it has one,
    else a stride of 0 on a dimension longer than 1, or strides that step over less than
    the dimensions inside them span (a conservative test for as_strided layouts)."""
    if t.is_contiguous() or t.numel() <= 1:
        return False  # the common case, cheap: one check per leaf before every restore
    probe = getattr(torch, "_debug_has_internal_overlap", None)
    if probe is not None:
        try:
            answer = int(probe(t))
        except (RuntimeError, TypeError):
            answer = 2
        if answer in (0, 1):  # MemOverlap::No / Yes; 2 is "too hard to tell"
            return answer == 1
    extent = 1  # in elements
    for stride, size in sorted((abs(st), n) for n, st in zip(t.shape, t.stride(), strict=True)
                               if n > 1):
        if stride < extent:
            return True
        extent = stride * (size - 1) + extent
    return False


# ---------------------------------------------------------------------- lazy snapshot
_fence_installed = [False]


def _optimizer_fence(optimizer: Any, args: Any, kwargs: Any) -> None:
    fence_all()


def install_fence() -> None:
    """Install, once per process, a global ``torch.optim`` step pre-hook that waits for every
    pending lazy copy (``GradScaler.step`` calls ``optimizer.step``, so it waits too). It
    stays installed (a no-op check of an empty list when nothing is pending): removing it
    while another thread iterates torch's hook dict would break that thread's step."""
    if _fence_installed[0]:
        return
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_optimizer_fence)
    _fence_installed[0] = True


# ---------------------------------------------------------------------- CUDA
_fences: dict[Any, Callable[[], None]] = {}


def _fence_for(device: torch.device) -> Callable[[], None]:
    """One fence per device and stream, so the engine calls each only once per save."""
    stream = torch.cuda.current_stream(device)
    key = (device.index, stream.cuda_stream)
    fence = _fences.get(key)
    if fence is None:
        fence = _fences[key] = stream.synchronize
    return fence


#: id of each staging buffer already seen by pin_staging (registered or not) -> True
_pinned: dict[int, bool] = {}


def pin_staging(buf: np.ndarray) -> None:
    """Staging hook: page-lock a new staging buffer so device copies into it are async.

    Only when this process actually uses CUDA; unregistered when the buffer is freed.
    """
    key = id(buf)
    if key in _pinned or buf.nbytes == 0:
        return
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    ptr, size = int(buf.ctypes.data), int(buf.nbytes)
    rc = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
    ok = _code(rc) == 0
    if not ok:
        log.warning("pitstop: could not page-lock a %.1f MiB staging buffer (%s); device "
                    "snapshots will be synchronous", size / 2**20, rc)
    _pinned[key] = ok  # remembered either way: never retried per snapshot
    weakref.finalize(buf, _unpin, key, ptr if ok else None)


def _ensure_pinned(out: np.ndarray) -> None:
    """Pin the staging buffer ``out`` is a view of, if the hook has not (the staging hooks
    of a manager are fixed when it is built, which may be before torch support loaded)."""
    root = out
    while isinstance(root.base, np.ndarray):
        root = root.base
    if id(root) not in _pinned:
        pin_staging(root)


def _unpin(key: int, ptr: int | None) -> None:
    _pinned.pop(key, None)
    if ptr is None:
        return
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - interpreter shutdown
        pass


def _code(rc: Any) -> int:
    try:
        return int(rc)
    except (TypeError, ValueError):
        return int(getattr(rc, "value", 1))
