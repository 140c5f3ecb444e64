"""The neutral state tree: nested dicts/lists whose leaves are arrays or JSON-able values.

``flatten`` turns a user's state into ``{key_path: leaf}`` where each leaf is an
:class:`ArrayLeaf` (a reference to live memory, never a copy) or a :class:`ValueLeaf`
(small JSON-able state). Framework objects are turned into subtrees by adapters
(``pitstop.adapters.registry``); core itself never imports a framework.

Key paths join components with ``/``; a ``/`` or ``~`` inside a component is escaped as
``~1`` / ``~0`` (as in JSON Pointer), so every path maps back to exactly one component list.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .dtypes import check_savable_dtype
from .errors import UnsupportedStateError

SCALAR_TYPES = (bool, int, float, str, type(None))


# --------------------------------------------------------------------------- key paths
def escape(component: str) -> str:
    return component.replace("~", "~0").replace("/", "~1")


def unescape(component: str) -> str:
    return component.replace("~1", "/").replace("~0", "~")


def join(prefix: str, key: Any) -> str:
    part = key if type(key) is str else str(key)
    if "/" in part or "~" in part:
        part = escape(part)
    return f"{prefix}/{part}" if prefix else part


def split(path: str) -> list[str]:
    return [unescape(p) for p in path.split("/")] if path else []


# --------------------------------------------------------------------------- leaves
class ArrayLeaf:
    """A reference to one live array. Subclasses wrap framework buffers (torch, jax, tf).

    The engine calls, in order: ``snapshot_into(out)`` for every leaf (may be asynchronous,
    e.g. a non-blocking device->pinned copy), then each distinct ``snapshot_fence`` once.
    On restore it writes into ``host_view()`` when that is a writable C-contiguous view of
    the live buffer (zero extra copies); otherwise it reads into a scratch array and calls
    ``assign(scratch)``.
    """

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.shape)) * self.dtype.itemsize

    def snapshot_into(self, out: np.ndarray) -> None:
        """Copy the live value into ``out`` (C-contiguous, same shape and dtype)."""
        raise NotImplementedError

    #: Called once after all ``snapshot_into`` of a save, to wait for asynchronous copies.
    snapshot_fence: Callable[[], None] | None = None

    def host_view(self) -> np.ndarray | None:
        """A writable, C-contiguous numpy view of the live buffer, or None if there is none."""
        return None

    def assign(self, value: np.ndarray) -> None:
        """Put a restored value (C-contiguous host array) into the live object."""
        raise NotImplementedError


class NumpyLeaf(ArrayLeaf):
    """An ``np.ndarray`` leaf: any shape, order or stride; restored in place."""

    __slots__ = ("array", "shape", "dtype", "nbytes")
    nbytes: int  # a slot, set once here: overrides the computed property of ArrayLeaf

    def __init__(self, array: np.ndarray) -> None:
        dt = array.dtype
        if dt.hasobject:
            check_savable_dtype(dt)
        self.array = array
        self.shape = array.shape
        self.dtype = dt.newbyteorder("<") if dt.byteorder == ">" else dt
        self.nbytes = array.nbytes

    def snapshot_into(self, out: np.ndarray) -> None:
        np.copyto(out, self.array)  # same dtype, or a byte swap to little-endian

    def host_view(self) -> np.ndarray | None:
        a = self.array
        if a.flags.c_contiguous and a.flags.writeable and a.dtype == self.dtype:
            return a
        return None

    def assign(self, value: np.ndarray) -> None:
        if not self.array.flags.writeable:
            raise UnsupportedStateError("cannot restore into a read-only numpy array")
        np.copyto(self.array, value, casting="equiv")


@dataclass(frozen=True)
class ArraySpec:
    """An array of a checkpoint known by shape and dtype only (what ``Adapter.check`` sees
    before any data is read)."""

    shape: tuple[int, ...]
    dtype: np.dtype


@dataclass
class ValueLeaf:
    """A JSON-able value (any subtree without arrays). Restored by replacing the entry."""

    value: Any


@dataclass
class AdapterNode:
    """A framework object captured by an adapter: its subtree, and how to put it back."""

    obj: Any
    adapter: Any
    subtree: Any
    #: ``[subtree]``: value leaves at the root of the subtree are replaced inside it
    holder: list[Any] | None = None


@dataclass
class FlatState:
    """The result of :func:`flatten`."""

    arrays: dict[str, ArrayLeaf] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    #: path -> (container, key) for value leaves, so restore can replace them in place.
    parents: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    #: adapters to call ``apply`` on after a restore, innermost first.
    adapters: list[tuple[str, AdapterNode]] = field(default_factory=list)
    #: path -> (container, key) for numpy scalars: saved as 0-d arrays, put back as scalars
    scalars: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    structure: Any = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


# --------------------------------------------------------------------------- values
def _is_array_like(obj: Any) -> bool:
    return isinstance(obj, (np.ndarray, np.generic, ArrayLeaf))


def contains_array(obj: Any, resolve: Callable[[Any], Any] | None) -> bool:
    """True when ``obj`` holds an array anywhere (or an object an adapter handles)."""
    if _is_array_like(obj):
        return True
    if isinstance(obj, Mapping):
        return any(contains_array(v, resolve) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(contains_array(v, resolve) for v in obj)
    if isinstance(obj, SCALAR_TYPES + (bytes,)):
        return False
    return resolve is not None and resolve(obj) is not None


def encode_value(v: Any, path: str = "") -> Any:
    """Encode a value subtree as strict JSON, keeping what JSON would lose (tuples, int keys,
    bytes, non-finite floats) in small ``{"$type": ...}`` wrappers."""
    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return v
    if isinstance(v, float):
        if math.isfinite(v):
            return v
        return {"$float": repr(v)}
    if isinstance(v, bytes):
        return {"$bytes": base64.b64encode(v).decode("ascii")}
    if isinstance(v, tuple):
        return {"$tuple": [encode_value(x, path) for x in v]}
    if isinstance(v, list):
        return [encode_value(x, path) for x in v]
    if isinstance(v, Mapping):
        if all(isinstance(k, str) and not k.startswith("$") for k in v):
            return {k: encode_value(x, join(path, k)) for k, x in v.items()}
        items = []
        for k, x in v.items():
            if not isinstance(k, (str, int, float, bool, type(None))):
                raise UnsupportedStateError(
                    f"state entry {path!r}: dict key {k!r} of type {type(k).__name__} is not "
                    "savable; use str or int keys"
                )
            items.append([k, encode_value(x, join(path, k))])
        return {"$dict": items}
    if isinstance(v, (set, frozenset)):
        raise UnsupportedStateError(f"state entry {path!r}: sets are not savable; use a sorted list")
    raise UnsupportedStateError(
        f"state entry {path!r}: cannot save a {type(v).__module__}.{type(v).__qualname__} "
        "without pickle. Pass arrays, JSON-able values, or an object with "
        "state_dict()/load_state_dict()."
    )


def decode_value(v: Any) -> Any:
    """Inverse of :func:`encode_value`."""
    if isinstance(v, list):
        return [decode_value(x) for x in v]
    if isinstance(v, dict):
        if len(v) == 1:
            (tag, payload), = v.items()
            if tag == "$float":
                return float(payload)
            if tag == "$bytes":
                return base64.b64decode(payload)
            if tag == "$tuple":
                return tuple(decode_value(x) for x in payload)
            if tag == "$dict":
                return {(tuple(k) if isinstance(k, list) else k): decode_value(x) for k, x in payload}
        return {k: decode_value(x) for k, x in v.items()}
    return v


# --------------------------------------------------------------------------- flatten
Resolver = Callable[[Any], Any]  # obj -> adapter or None


def flatten(state: Any, resolve: Resolver | None = None) -> FlatState:
    """Flatten ``state`` into array leaves (by reference) and value leaves.

    ``structure`` records containers that hold arrays so :func:`unflatten` can rebuild the
    nesting: a dict becomes ``{"$d": [[key, sub], ...]}``, a list ``{"$l": [...]}``, a tuple
    ``{"$t": [...]}``, an adapter-handled object ``{"$o": sub}``, a leaf ``0`` and a numpy
    scalar (stored as a 0-d array) ``1``.
    """
    flat = FlatState()
    flat.structure = _flatten(state, "", flat, resolve, None, None)
    return flat


def _flatten(obj: Any, path: str, flat: FlatState, resolve: Resolver | None,
             parent: Any, key: Any) -> Any:
    if type(obj) is np.ndarray:  # the common leaf first
        flat.arrays[path or "<root>"] = NumpyLeaf(obj)
        return 0
    if isinstance(obj, ArrayLeaf):
        flat.arrays[_leaf_path(path)] = obj
        return 0
    if isinstance(obj, np.ndarray):
        flat.arrays[_leaf_path(path)] = NumpyLeaf(obj)
        return 0
    if isinstance(obj, np.generic):
        # a numpy scalar is saved as a 0-d array; restore replaces the entry (it is immutable)
        flat.arrays[_leaf_path(path)] = NumpyLeaf(np.array(obj))
        if parent is not None:
            flat.scalars[_leaf_path(path)] = (parent, key)
        return 1
    if isinstance(obj, Mapping):
        if not contains_array(obj, resolve):
            return _value(obj, path, flat, parent, key)
        items = []
        for k, v in obj.items():
            tk = type(k)
            if tk is not str and (tk is not int):
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise UnsupportedStateError(
                        f"state entry {path or '<root>'!r}: key {k!r} must be str or int")
            if tk is not str and str(k) in obj:
                # 1 and "1" share the key path "…/1": one would silently overwrite the other
                raise UnsupportedStateError(
                    f"state entry {path or '<root>'!r}: keys {str(k)!r} and {k!r} have "
                    "the same key path; rename one")
            items.append([k, _flatten(v, join(path, k), flat, resolve, obj, k)])
        return {"$d": items}
    if isinstance(obj, (list, tuple)):
        if not contains_array(obj, resolve):
            return _value(obj, path, flat, parent, key)
        subs = [_flatten(v, join(path, i), flat, resolve, obj, i) for i, v in enumerate(obj)]
        return {"$t": subs} if isinstance(obj, tuple) else {"$l": subs}
    if isinstance(obj, SCALAR_TYPES + (bytes,)):
        return _value(obj, path, flat, parent, key)
    adapter = resolve(obj) if resolve is not None else None
    if adapter is None:
        # raises a clear UnsupportedStateError
        encode_value(obj, path)
        raise AssertionError("unreachable")
    subtree = adapter.capture(obj)
    holder = [subtree]
    node = AdapterNode(obj, adapter, subtree, holder)
    sub = _flatten(subtree, path, flat, resolve, holder, 0)
    flat.adapters.append((path, node))
    return {"$o": sub}


def _leaf_path(path: str) -> str:
    return path if path else "<root>"


def _value(obj: Any, path: str, flat: FlatState, parent: Any, key: Any) -> int:
    p = _leaf_path(path)
    # fail now, on the caller's thread, not later in the background persist (a set, an object)
    encode_value(obj, path)
    flat.values[p] = obj
    if parent is not None:
        flat.parents[p] = (parent, key)
    return 0


def iter_structure_paths(structure: Any, path: str = "") -> Iterator[str]:
    """Yield every leaf path of a recorded structure (for diagnostics)."""
    if structure in (0, 1):
        yield _leaf_path(path)
    elif "$d" in structure:
        for k, sub in structure["$d"]:
            yield from iter_structure_paths(sub, join(path, k))
    elif "$o" in structure:
        yield from iter_structure_paths(structure["$o"], path)
    else:
        for i, sub in enumerate(structure.get("$l", structure.get("$t", []))):
            yield from iter_structure_paths(sub, join(path, i))


def unflatten(structure: Any, leaves: Mapping[str, Any], path: str = "") -> Any:
    """Rebuild the nested state from ``structure`` and a ``{path: value}`` mapping."""
    if structure == 0:
        return leaves[_leaf_path(path)]
    if structure == 1:
        value = leaves[_leaf_path(path)]
        return value[()] if isinstance(value, np.ndarray) else value
    if "$d" in structure:
        return {k: unflatten(sub, leaves, join(path, k)) for k, sub in structure["$d"]}
    if "$o" in structure:
        return unflatten(structure["$o"], leaves, path)
    if "$t" in structure:
        return tuple(unflatten(sub, leaves, join(path, i)) for i, sub in enumerate(structure["$t"]))
    return [unflatten(sub, leaves, join(path, i)) for i, sub in enumerate(structure["$l"])]
