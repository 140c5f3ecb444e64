"""Bitwise fingerprints of a state: what the conformance battery compares.

A fingerprint is a flat ``{path: Bits}`` of copies, taken through the suite's ``to_host``
hook for framework objects and by the walk below for numpy, the standard library's values
and containers. Two states are the same when their fingerprints are equal: same paths,
same types, same dtypes and shapes, same bytes.
"""

from __future__ import annotations

import hashlib
import random
import struct
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np


class Bits(NamedTuple):
    """The bitwise identity of one leaf: its kind (type and dtype), shape and raw bytes.

    A suite's ``to_host`` returns one for a leaf numpy cannot hold as it is (a framework
    dtype numpy lacks), e.g. ``Bits("torch.bfloat16", (2, 3), t.view(torch.int16)...)``."""

    kind: str
    shape: tuple[int, ...]
    data: bytes


def _array_bits(a: np.ndarray) -> Bits:
    return Bits(f"ndarray[{a.dtype.name}]", tuple(a.shape), np.ascontiguousarray(a).tobytes())


def fingerprint(obj: Any, to_host: Callable[[Any], Any]) -> dict[str, Bits]:
    """``{path: Bits}`` of everything ``obj`` holds (copies: later changes do not show)."""
    out: dict[str, Bits] = {}
    _walk(obj, "", to_host, out, 0)
    return out


def _walk(obj: Any, path: str, to_host: Callable[[Any], Any], out: dict[str, Bits],
          depth: int) -> None:
    if depth > 64:
        raise TypeError(f"fingerprint: {path or '<root>'} nests too deep (a cycle?)")
    host = to_host(obj)
    if host is not NotImplemented and host is not obj:
        _walk(host, path + "@", to_host, out, depth + 1)
        return
    here = path or "<root>"
    if isinstance(obj, Bits):
        out[here] = obj
    elif isinstance(obj, np.ndarray):
        if obj.dtype == object:
            raise TypeError(f"fingerprint: {here} is an object array")
        out[here] = _array_bits(obj)
    elif isinstance(obj, np.generic):
        out[here] = Bits(type(obj).__name__, (), obj.tobytes())
    elif isinstance(obj, np.random.Generator):
        out[here] = Bits("Generator", (), b"")
        _walk(obj.bit_generator.state, path + "/state", to_host, out, depth + 1)
    elif isinstance(obj, np.random.RandomState):
        out[here] = Bits("RandomState", (), b"")
        _walk(obj.get_state(legacy=False), path + "/state", to_host, out, depth + 1)
    elif isinstance(obj, random.Random):
        out[here] = Bits("Random", (), b"")
        _walk(obj.getstate(), path + "/state", to_host, out, depth + 1)
    elif isinstance(obj, Mapping):
        out[here] = Bits(type(obj).__qualname__, (len(obj),), b"")
        for k, v in obj.items():
            _walk(v, f"{path}/{k!r}", to_host, out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        out[here] = Bits(type(obj).__qualname__, (len(obj),), b"")
        for i, v in enumerate(obj):
            _walk(v, f"{path}/{i}", to_host, out, depth + 1)
    elif isinstance(obj, float):
        out[here] = Bits(type(obj).__qualname__, (), struct.pack("<d", obj))
    elif obj is None or isinstance(obj, (bool, int, str, bytes)):
        out[here] = Bits(type(obj).__qualname__, (), repr(obj).encode())
    elif callable(getattr(obj, "state_dict", None)):
        _walk(obj.state_dict(), path + ".state_dict()", to_host, out, depth + 1)
    else:
        raise TypeError(f"fingerprint: cannot read {type(obj).__qualname__} at {here}; "
                        "have the suite's to_host() turn it into numpy arrays, values or Bits")


def digest(fp: dict[str, Bits]) -> dict[str, str]:
    """``{path: sha256}`` of a fingerprint: what a child process prints of its final state."""
    return {k: hashlib.sha256(repr((b.kind, b.shape)).encode() + b.data).hexdigest()
            for k, b in fp.items()}


def differences(expected: Mapping[str, Any], actual: Mapping[str, Any], limit: int = 12) -> list[str]:
    """What differs between two fingerprints (or digests), one line per path, at most
    ``limit`` lines (and a count of the rest)."""
    lines = []
    for k in sorted(set(expected) | set(actual)):
        if k not in actual:
            lines.append(f"{k}: missing (expected {_show(expected[k])})")
        elif k not in expected:
            lines.append(f"{k}: unexpected ({_show(actual[k])})")
        elif expected[k] != actual[k]:
            lines.append(f"{k}: expected {_show(expected[k])}, got {_show(actual[k])}")
    if len(lines) > limit:
        lines[limit:] = [f"... and {len(lines) - limit} more"]
    return lines


def _show(b: Any) -> str:
    if not isinstance(b, Bits):
        return str(b)[:16]
    data = b.data if len(b.data) <= 16 else b.data[:16] + b"..."
    return f"{b.kind}{list(b.shape)} {data.hex()}"
