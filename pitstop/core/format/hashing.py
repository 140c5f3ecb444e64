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
#: name -> the hex digest of one buffer in one call, where the library has one: many small
#: arrays then cost no hasher object each
_ONE_CALL: dict[str, Callable[[Any], str]] = {
    "xxh3-128": xxhash.xxh3_128_hexdigest,
    "xxh3-64": xxhash.xxh3_64_hexdigest,
}


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
    return digest_of(algorithm)(data)


def digest_of(algorithm: str) -> Callable[[Any], str]:
    """The function that hashes one buffer with ``algorithm`` and returns its hex digest
    (one library call for xxh3; for a loop over many small buffers)."""
    one = _ONE_CALL.get(algorithm)
    if one is not None:
        return one
    new_hasher(algorithm)  # (an unknown name: its ValueError)
    make = ALGORITHMS[algorithm]

    def digest(data: Any) -> str:
        h = make()
        h.update(data)
        return str(h.hexdigest())
    return digest
