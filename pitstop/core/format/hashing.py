"""Integrity hashes: xxh3-128 by default (fast, non-cryptographic), sha256 on request."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import xxhash

#: name -> constructor of an incremental hasher with ``update(buffer)`` and ``hexdigest()``.
ALGORITHMS: dict[str, Callable[[], Any]] = {
    "xxh3-128": xxhash.xxh3_128,
    "xxh3-64": xxhash.xxh3_64,
    "sha256": hashlib.sha256,
    "blake2b": hashlib.blake2b,
}
DEFAULT = "xxh3-128"


def new_hasher(algorithm: str) -> Any:
    """Return a fresh incremental hasher for ``algorithm`` (see :data:`ALGORITHMS`)."""
    try:
        return ALGORITHMS[algorithm]()
    except KeyError:
        raise ValueError(
            f"unknown hash algorithm {algorithm!r}; choose one of {sorted(ALGORITHMS)}"
        ) from None


def hash_bytes(algorithm: str, data: Any) -> str:
    """Hash one buffer and return the hex digest."""
    h = new_hasher(algorithm)
    h.update(data)
    return str(h.hexdigest())
