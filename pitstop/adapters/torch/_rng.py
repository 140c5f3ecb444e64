"""torch's global generators for :class:`pitstop.RNG`: the CPU one and, when this process
uses CUDA, one per CUDA device. States are raw bytes (saved as base64 JSON values)."""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("pitstop")


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().numpy().tobytes()


def _tensor(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def get_state() -> dict[str, Any]:
    """CPU state, plus CUDA states only if CUDA is already initialized (never initializes it)."""
    state: dict[str, Any] = {"cpu": _bytes(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_bytes(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(_tensor(state["cpu"]))
    cuda = state.get("cuda")
    if not cuda:
        return
    if not torch.cuda.is_available():
        log.warning("pitstop: the checkpoint holds CUDA random state but CUDA is not available "
                    "here; only the CPU generator was restored")
        return
    n = torch.cuda.device_count()
    if n != len(cuda):
        log.warning("pitstop: the checkpoint holds random state for %d CUDA devices, this "
                    "process sees %d; restoring the first %d", len(cuda), n, min(n, len(cuda)))
    for i, s in enumerate(cuda[:n]):
        torch.cuda.set_rng_state(_tensor(s), i)
