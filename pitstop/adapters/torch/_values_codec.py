"""A sampler's or dataset's ``state_dict()`` as plain values (what a loader's state holds).

Tensors inside (torchdata's samplers keep a generator state as a uint8 tensor) become
``{"__pitstop_tensor__": {"dtype", "shape", "data"}}`` and come back as tensors; tuples
come back as lists, as from any JSON-like value."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

_KEY = "__pitstop_tensor__"


def encode(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return {_KEY: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                       "data": t.view(torch.uint8).numpy().tobytes() if t.numel() else b""}}
    if isinstance(value, Mapping):
        return {str(k) if not isinstance(k, (int, str)) else k: encode(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    return value


def decode(value: Any) -> Any:
    if isinstance(value, Mapping):
        if set(value) == {_KEY}:
            t = value[_KEY]
            dtype = getattr(torch, t["dtype"])
            flat = torch.frombuffer(bytearray(t["data"]), dtype=torch.uint8) if t["data"] \
                else torch.empty(0, dtype=torch.uint8)
            return flat.view(dtype).reshape(t["shape"]).clone()
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value
