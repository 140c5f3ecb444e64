"""Helpers shared by the torch adapter tests (imported as a top-level module by pytest)."""

from __future__ import annotations

import torch


def bits(t):
    """The raw bytes of a tensor's values, in logical order (bit-exact comparisons, NaNs too)."""
    return t.detach().clone().contiguous().view(-1).view(torch.uint8)


def same_bits(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))
