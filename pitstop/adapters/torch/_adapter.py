"""Adapters for torch objects: tensors, modules, optimizers, generators, stateful objects.

Each ``capture`` returns a tree whose tensors are :class:`TensorLeaf` references to the live
tensors (restore streams bytes straight into them); each ``apply`` puts back what cannot be
restored in place: hyper-parameters, step counters, scheduler and scaler state, and whole
subtrees the checkpoint had but the target did not (an optimizer before its first step).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from pitstop.core.errors import UnsupportedStateError

from ._leaf import TensorLeaf, to_tensor

_WRAPPER = "_orig_mod"  # torch.compile's OptimizedModule keeps the real module here


def unwrap_module(module: nn.Module) -> nn.Module:
    """The module a wrapper holds: DDP / DataParallel ``.module``, ``torch.compile``'s
    ``_orig_mod``, any nesting of them. Checkpoint keys are the unwrapped module's keys."""
    while True:
        inner = getattr(module, _WRAPPER, None)
        if isinstance(inner, nn.Module):
            module = inner
            continue
        if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            module = module.module
            continue
        return module


def _clean_key(key: str) -> str:
    """Drop ``_orig_mod.`` components (compiled submodules) from a state_dict key."""
    if _WRAPPER not in key:
        return key
    return ".".join(p for p in key.split(".") if p != _WRAPPER)


def _wrap(tree: Any, where: str) -> Any:
    """Copy the containers of ``tree`` with every tensor replaced by a TensorLeaf."""
    if isinstance(tree, torch.Tensor):
        return TensorLeaf(tree, where)
    if isinstance(tree, Mapping):
        return {k: _wrap(v, f"{where}/{k}") for k, v in tree.items()}
    if isinstance(tree, list):
        return [_wrap(v, f"{where}/{i}") for i, v in enumerate(tree)]
    if isinstance(tree, tuple):
        return tuple(_wrap(v, f"{where}/{i}") for i, v in enumerate(tree))
    return tree


def _unwrap(tree: Any) -> Any:
    """Inverse of :func:`_wrap` on a restored tree: TensorLeaf -> its (restored) tensor, a
    numpy array rebuilt from the checkpoint -> a new CPU tensor (``load_state_dict`` moves
    it to the right device and dtype, exactly as a CPU-mapped load of a torch file would)."""
    if isinstance(tree, TensorLeaf):
        return tree.tensor
    if isinstance(tree, (np.ndarray, np.generic)):
        return to_tensor(np.asarray(tree))
    if isinstance(tree, Mapping):
        return {k: _unwrap(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_unwrap(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_unwrap(v) for v in tree)
    return tree


class TensorAdapter:
    """A plain tensor in the state: saved as one array, restored in place."""

    def can_handle(self, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor)

    def capture(self, obj: torch.Tensor) -> Any:
        return TensorLeaf(obj)

    def apply(self, obj: torch.Tensor, tree: Any) -> None:
        if isinstance(tree, np.ndarray):  # not restored in place: copy it in
            with torch.no_grad():
                obj.copy_(to_tensor(tree))

    def describe(self, obj: torch.Tensor) -> dict[str, Any]:
        leaf = TensorLeaf(obj)
        return {"": (leaf.shape, leaf.dtype)}


class ModuleAdapter:
    """``nn.Module`` (also DDP-wrapped or ``torch.compile``d): parameters and buffers by
    reference, keys as in the unwrapped module's ``state_dict``; ``_extra_state`` as values."""

    def can_handle(self, obj: Any) -> bool:
        return isinstance(obj, nn.Module)

    def capture(self, obj: nn.Module) -> dict[str, Any]:
        module = unwrap_module(obj)
        out: dict[str, Any] = {}
        for key, value in module.state_dict(keep_vars=True).items():
            key = _clean_key(key)
            out[key] = TensorLeaf(value, key) if isinstance(value, torch.Tensor) else value
        return out

    def apply(self, obj: nn.Module, tree: dict[str, Any]) -> None:
        # Tensors were restored in place. Hand back through load_state_dict (under the
        # module's own, possibly wrapped, key names) only the rest: extra state
        # (get_extra_state may return a fresh object), and tensors that a state_dict hook
        # produced as copies rather than views of the module's own storage.
        module = unwrap_module(obj)
        live = {t.untyped_storage().data_ptr()
                for t in (*module.parameters(), *module.buffers()) if t.device.type != "meta"}
        rest = {k: v for k, v in tree.items()
                if not isinstance(v, TensorLeaf) or k.endswith("_extra_state")
                or v.tensor.untyped_storage().data_ptr() not in live}
        if not rest:
            return
        names = {_clean_key(k): k for k in module.state_dict(keep_vars=True)}
        loadable = {names.get(k, k): _unwrap(v) for k, v in rest.items()}
        result = module.load_state_dict(loadable, strict=False)
        if result.unexpected_keys:
            raise UnsupportedStateError(
                f"module {type(module).__name__} does not accept {result.unexpected_keys}")

    def describe(self, obj: nn.Module) -> dict[str, Any]:
        return {k: (v.shape, v.dtype) for k, v in self.capture(obj).items()
                if isinstance(v, TensorLeaf)}


class OptimizerAdapter:
    """Any ``torch.optim.Optimizer``: per-parameter state tensors by reference (int keys, as
    in ``state_dict``), ``param_groups`` (lr, betas, weight decay, extras) as values."""

    def can_handle(self, obj: Any) -> bool:
        return isinstance(obj, torch.optim.Optimizer)

    def capture(self, obj: torch.optim.Optimizer) -> dict[str, Any]:
        return _wrap(obj.state_dict(), "")

    def apply(self, obj: torch.optim.Optimizer, tree: dict[str, Any]) -> None:
        # load_state_dict keeps the tensors we already restored in place (``.to`` is a no-op
        # on the same device and dtype) and turns rebuilt arrays into tensors on the
        # parameters' devices, as it does for any state dict
        try:
            obj.load_state_dict(_unwrap(tree))
        except ValueError as e:
            raise UnsupportedStateError(
                f"cannot restore {type(obj).__name__}: {e}. Build the optimizer over the same "
                "parameter groups (same number and sizes) as the run that saved it.") from None


class GeneratorAdapter:
    """A ``torch.Generator`` (CPU or CUDA): its state as a value, set back with set_state."""

    def can_handle(self, obj: Any) -> bool:
        return isinstance(obj, torch.Generator)

    def capture(self, obj: torch.Generator) -> dict[str, Any]:
        return {"device": str(obj.device), "state": obj.get_state().numpy().tobytes()}

    def apply(self, obj: torch.Generator, tree: dict[str, Any]) -> None:
        obj.set_state(torch.frombuffer(bytearray(tree["state"]), dtype=torch.uint8))


class StatefulAdapter:
    """Objects with ``state_dict()``/``load_state_dict()`` (LR schedulers, GradScaler, the
    resumable sampler, user objects): like the generic adapter, but tensors inside the state
    dict are captured by reference and handed back as tensors."""

    def can_handle(self, obj: Any) -> bool:
        return (callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))
                and not isinstance(obj, (nn.Module, torch.optim.Optimizer, torch.Tensor)))

    def capture(self, obj: Any) -> Any:
        return _wrap(obj.state_dict(), "")

    def apply(self, obj: Any, tree: Any) -> None:
        obj.load_state_dict(_unwrap(tree))


class DataLoaderHint:
    """A plain ``DataLoader`` or ``Sampler`` has no state to save: say what to use instead."""

    def can_handle(self, obj: Any) -> bool:
        from torch.utils.data import DataLoader, Sampler
        return isinstance(obj, (DataLoader, Sampler)) and not callable(
            getattr(obj, "state_dict", None))

    def capture(self, obj: Any) -> Any:
        raise UnsupportedStateError(
            f"a {type(obj).__name__} has no state to save, so a resumed run would restart the "
            "epoch. Use pitstop.adapters.torch.ResumableLoader (DataLoader's arguments plus "
            "seed) or ResumableSampler, or leave it out of the state.")

    def apply(self, obj: Any, tree: Any) -> None:  # pragma: no cover - capture raises
        raise AssertionError("unreachable")
