"""Value leaves: small JSON-able state (step, epoch, RNG states, a scheduler's fields)
encoded as strict JSON, keeping what JSON would lose in small ``{"$type": ...}`` wrappers,
and decoded back strictly.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from pitstop.core.errors import UnsupportedStateError
from pitstop.core.tree.paths import MAX_DEPTH, _too_deep, _where, join

SCALAR_TYPES = (bool, int, float, str, type(None))


def encode_value(v: Any, path: str = "", depth: int = 0) -> Any:
    """Encode a value subtree as strict JSON, keeping what JSON would lose (tuples, int keys,
    bytes, non-finite floats) in small ``{"$type": ...}`` wrappers."""
    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return v
    if isinstance(v, float):
        if math.isfinite(v):
            return v
        return {"$float": repr(v)}
    if depth >= MAX_DEPTH:
        raise _too_deep(path)
    if isinstance(v, bytes):
        return {"$bytes": base64.b64encode(v).decode("ascii")}
    if isinstance(v, tuple):
        return {"$tuple": [encode_value(x, join(path, i), depth + 1) for i, x in enumerate(v)]}
    if isinstance(v, list):
        return [encode_value(x, join(path, i), depth + 1) for i, x in enumerate(v)]
    if isinstance(v, Mapping):
        if all(type(k) is str and not k.startswith("$") for k in v):
            return {k: encode_value(x, join(path, k), depth + 1) for k, x in v.items()}
        items = []
        for k, x in v.items():
            if isinstance(k, np.integer):
                k = int(k)  # equal and hash-equal: comes back as an int
            if not isinstance(k, (str, int, float, bytes, tuple, type(None))):
                raise UnsupportedStateError(
                    f"state entry {_where(path)}: dict key {k!r} of type {type(k).__name__} is "
                    "not savable; use str or int keys"
                )
            items.append([encode_value(k, join(path, k), depth + 1),
                          encode_value(x, join(path, k), depth + 1)])
        return {"$dict": items}
    if isinstance(v, (set, frozenset)):
        raise UnsupportedStateError(
            f"state entry {_where(path)}: sets are not savable; use a sorted list")
    raise UnsupportedStateError(
        f"state entry {_where(path)}: cannot save a {type(v).__module__}.{type(v).__qualname__} "
        "without pickle. Pass arrays, JSON-able values, or an object with "
        "state_dict()/load_state_dict()."
    )


def decode_value(v: Any) -> Any:
    """Inverse of :func:`encode_value`. Strict: a wrapper that :func:`encode_value` could
    not have written (``{"$float": "abc"}``, ``{"$dict": 5}``, ``{"$bytes": "!!!"}``) raises
    ValueError naming what is wrong, never decodes to something else."""
    if isinstance(v, list):
        return [decode_value(x) for x in v]
    if isinstance(v, dict):
        if len(v) == 1:
            (tag, payload), = v.items()
            if tag in _TAGS:
                return _TAGS[tag](payload)
        return {k: decode_value(x) for k, x in v.items()}
    return v


def _decode_float(payload: Any) -> float:
    if type(payload) is not str:
        raise ValueError(f"$float holds {_brief(payload)}, not a string")
    try:
        return float(payload)
    except ValueError:
        raise ValueError(f"$float holds {_brief(payload)}, not a number") from None


def _decode_bytes(payload: Any) -> bytes:
    if type(payload) is not str:
        raise ValueError(f"$bytes holds {_brief(payload)}, not a base64 string")
    try:
        return base64.b64decode(payload, validate=True)
    except (ValueError, TypeError):  # binascii.Error is a ValueError
        raise ValueError(f"$bytes holds {_brief(payload)}, which is not strict base64") from None


def _decode_tuple(payload: Any) -> tuple[Any, ...]:
    if not isinstance(payload, list):
        raise ValueError(f"$tuple holds {_brief(payload)}, not a list")
    return tuple(decode_value(x) for x in payload)


def _decode_dict(payload: Any) -> dict[Any, Any]:
    if not isinstance(payload, list) or not all(
            isinstance(item, list) and len(item) == 2 for item in payload):
        raise ValueError(f"$dict holds {_brief(payload)}, not a list of [key, value] pairs")
    out = {}
    for k, x in payload:
        key = _decode_key(k)
        try:
            hash(key)
        except TypeError:
            raise ValueError(f"$dict has a key {_brief(k)} that cannot be a dict key") from None
        out[key] = decode_value(x)
    return out


_TAGS: dict[str, Callable[[Any], Any]] = {
    "$float": _decode_float, "$bytes": _decode_bytes, "$tuple": _decode_tuple,
    "$dict": _decode_dict,
}


def _brief(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:56] + "...'"


def _decode_key(k: Any) -> Any:
    """A ``$dict`` key, written with :func:`encode_value` (keys written as plain JSON by
    earlier versions decode to themselves; a list is a legacy tuple key)."""
    if isinstance(k, list):
        return tuple(decode_value(x) for x in k)
    return decode_value(k)

