"""The neutral state tree: nested dicts/lists whose leaves are arrays or JSON-able values.

``flatten`` turns a user's state into ``{key_path: leaf}`` where each leaf is an
:class:`ArrayLeaf` (a reference to live memory, never a copy) or a :class:`ValueLeaf`
(small JSON-able state). Framework objects are turned into subtrees by adapters
(:mod:`pitstop.core.adapter`); core itself never imports a framework.

Key paths join components with ``/``; a ``/`` or ``~`` inside a component is escaped as
``~1`` / ``~0`` (as in JSON Pointer) and an empty component is written ``~2``, so every path
maps back to exactly one component list and no key collides with another (or with
``<root>``, the path of a state that is itself a single leaf).
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Container, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

try:
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # numpy < 2
    from numpy import byte_bounds  # type: ignore[attr-defined,no-redef]

from pitstop.core.errors import CheckpointError, CheckpointNotFoundError, UnsupportedStateError
from pitstop.core.format.dtypes import check_savable_dtype

SCALAR_TYPES = (bool, int, float, str, type(None))


# --------------------------------------------------------------------------- key paths
#: deepest nesting of containers pitstop saves (deeper states are refused with a clear error,
#: long before Python's recursion limit)
MAX_DEPTH = 200
EMPTY = "~2"


def escape(component: str) -> str:
    if not component:
        return EMPTY
    return component.replace("~", "~0").replace("/", "~1")


def unescape(component: str) -> str:
    if component == EMPTY:
        return ""
    return component.replace("~1", "/").replace("~0", "~")


def join(prefix: str, key: Any) -> str:
    part = key if type(key) is str else str(key)
    if not part or "/" in part or "~" in part:
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

    #: The adapter vouches that nothing writes this array between a save and the
    #: framework's next optimizer step (torch parameters and optimizer state, never buffers
    #: a forward pass updates): ``snapshot="lazy"`` may copy it in the background until then
    #: (see :mod:`pitstop.core.save.lazy`).
    lazy_safe = False
    #: Called once per save that copies this leaf lazily, before the copy starts: installs
    #: the framework's fence (torch: an optimizer step pre-hook calling
    #: :func:`pitstop.core.save.lazy.fence_all`). Required with ``lazy_safe``.
    lazy_guard: Callable[[], None] | None = None

    def version(self) -> Any:
        """A token every in-place write to the array changes (torch: ``Tensor._version``),
        or None when there is none: a lazy save compares it to catch writes outside the
        contract."""
        return None

    def host_view(self) -> np.ndarray | None:
        """A writable, C-contiguous numpy view of the live buffer, or None if there is none."""
        return None

    def assign(self, value: np.ndarray) -> None:
        """Put a restored value (C-contiguous host array) into the live object."""
        raise NotImplementedError

    def check_restorable(self) -> None:
        """Raise :class:`UnsupportedStateError` when a restore could not write this leaf
        exactly (read-only, elements sharing memory). Called before any byte is written."""

    def memory_span(self) -> tuple[Any, int, int, Any] | None:
        """``(address space, first byte, end, view)`` of the live memory a restore writes
        (``view`` identifies the exact layout), or None when unknown: two leaves whose spans
        overlap are refused unless they are the same view getting the same bytes."""
        return None

    #: True for a leaf split into shards (:meth:`pieces`); the engine then stores each
    #: distinct shard once and the manifest records the global shape and every shard's index
    sharded = False

    def pieces(self) -> list[tuple[tuple[tuple[int, int], ...], ArrayLeaf]]:
        """``[(index, leaf), ...]``: each distinct shard once, ``index`` its ``(start, stop)``
        per dimension; together they cover the array exactly (only when :attr:`sharded`)."""
        raise NotImplementedError

    #: Optional: ``restore_from(read)`` builds the restored value from regions, where
    #: ``read(index)`` returns the checkpoint's values inside ``index`` (``(start, stop)`` per
    #: dimension) as a host array; a leaf that has it is restored through it (a sharded
    #: target then reads only the shards each of its devices needs)
    restore_from: Callable[[Callable[[tuple[tuple[int, int], ...]], np.ndarray]], None] | None \
        = None
    #: True when restoring only keeps the new value for the adapter's ``apply`` (an
    #: immutable array): nothing live changes before the apply phase
    deferred = False
    #: Optional, JSON-able: how the framework laid the array out over its devices (a JAX
    #: ``NamedSharding``: mesh shape, axis names, partition spec), recorded in the manifest's
    #: ``layouts`` and handed back to :attr:`accept_saved` by a restore; opaque to core
    layout: Any = None
    #: Optional: ``accept_saved(dtype, layout) -> hint``, called by a restore before it
    #: compares the leaf with the checkpoint's entry, with the saved dtype and layout (None
    #: when none was recorded). The leaf may take the saved layout where its target left the
    #: placement open, and the saved dtype where its owner opted into a conversion (it then
    #: reports the saved dtype and converts after reading). Returns a hint the refusal of a
    #: remaining difference adds (the option that would allow it), or None.
    accept_saved: Callable[[np.dtype, Any], str | None] | None = None


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

    def check_restorable(self) -> None:
        """Refuse, before a restore writes anything, an array that cannot take the values."""
        a = self.array
        flags = a.flags
        if flags.writeable and (flags.c_contiguous or flags.f_contiguous):
            return  # the common case: no element can share memory with another
        if not flags.writeable:
            raise UnsupportedStateError(
                "the target is a read-only numpy array; restore into a writable array "
                "(np.array(x) copies one)")
        if has_internal_overlap(a.shape, a.strides, a.itemsize):
            raise UnsupportedStateError(
                f"the target array of shape {list(a.shape)} (strides {list(a.strides)}) has "
                "elements that share memory (a broadcast or as_strided view); restore into an "
                "array that owns its memory (e.g. .copy() it)")

    def memory_span(self) -> tuple[Any, int, int, Any] | None:
        a = self.array
        if a.size == 0:
            return None
        lo, hi = byte_bounds(a)
        return ("cpu", lo, hi, (lo, a.shape, a.strides, a.dtype.str))

    def host_view(self) -> np.ndarray | None:
        a = self.array
        if a.flags.c_contiguous and a.flags.writeable and a.dtype == self.dtype:
            # an ndarray subclass (np.matrix keeps two dimensions) is read as a plain array
            return a if type(a) is np.ndarray else a.view(np.ndarray)
        return None

    def assign(self, value: np.ndarray) -> None:
        target = self.array if type(self.array) is np.ndarray else self.array.view(np.ndarray)
        np.copyto(target, value, casting="equiv")


def has_internal_overlap(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """True when two elements of an array with this layout may share memory (a stride of 0
    on a dimension longer than 1, or strides too short for what they step over)."""
    if 0 in shape:
        return False
    dims = sorted((abs(st), n) for n, st in zip(shape, strides, strict=True) if n > 1)
    extent = itemsize
    for st, n in dims:
        if st < extent:
            return True
        extent = st * (n - 1) + extent
    return False


@dataclass(frozen=True)
class ArraySpec:
    """An array of a checkpoint known by shape and dtype only (what ``Adapter.check`` sees
    before any data is read)."""

    shape: tuple[int, ...]
    dtype: np.dtype


@dataclass
class AdapterNode:
    """A framework object captured by an adapter: its subtree, and how to put it back."""

    obj: Any
    adapter: Any
    subtree: Any
    #: ``[subtree]``: value leaves at the root of the subtree are replaced inside it
    holder: list[Any] = field(default_factory=list)
    #: the container holding ``obj`` and its key there (None at the root): where the object
    #: ``apply`` returns goes, for an adapter of immutable objects (``rebuilds``)
    parent: Any = None
    key: Any = None

    @property
    def tree(self) -> Any:
        """The subtree to hand to ``apply`` (the holder's, once restore replaced it)."""
        return self.holder[0] if self.holder else self.subtree


@dataclass
class FlatState:
    """The result of :func:`flatten`."""

    arrays: dict[str, ArrayLeaf] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    #: the value leaves as encoded for the manifest, made on the caller's thread: a deep,
    #: immutable copy (what a save records is what the state held when save() was called)
    encoded: dict[str, Any] = field(default_factory=dict)
    #: path -> (container, key) for value leaves, so restore can replace them in place.
    parents: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    #: adapters to call ``apply`` on after a restore, innermost first.
    adapters: list[tuple[str, AdapterNode]] = field(default_factory=list)
    #: path -> (container, key) for numpy scalars: saved as 0-d arrays, put back as scalars
    scalars: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    #: id(tuple) -> (path, parent container, key) for every tuple that holds arrays: restore
    #: rebuilds one (same type, namedtuples too) when a value inside it changes
    tuples: dict[int, tuple[str, Any, Any]] = field(default_factory=dict)
    #: what adapters said they cannot capture exactly (``caveats``), with their key paths
    caveats: list[str] = field(default_factory=list)
    #: keys of sharded array leaves (their shards are stored separately)
    sharded: list[str] = field(default_factory=list)
    #: the adapters that captured objects of the state, and the names of frameworks an
    #: adapter captured for another ("keras" on TensorFlow): the manifest names their
    #: frameworks (``writer["frameworks"]``)
    used: set[Any] = field(default_factory=set)
    #: a state made by ``load(target=...)``: immutable objects at its root are rebuilt and
    #: the new root left in :attr:`root`
    detached: bool = False
    structure: Any = None
    #: the state object itself
    root: Any = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def layouts(self) -> dict[str, Any]:
        """The layouts array leaves record (the manifest's ``layouts``); empty when the
        state holds no leaf of a framework that records one."""
        if not any(a.records_layout for a in self.used if not isinstance(a, str)):
            return {}
        return {k: a.layout for k, a in self.arrays.items() if a.layout is not None}


# --------------------------------------------------------------------------- values
_SCALARS = SCALAR_TYPES + (bytes,)


def _is_array_like(obj: Any) -> bool:
    return isinstance(obj, (np.ndarray, np.generic, ArrayLeaf))


class _BadNesting(Exception):
    """Raised inside :func:`contains_array`; carries the key path back up as it unwinds."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind
        self.parts: list[Any] = []


def contains_array(obj: Any, resolve: Callable[[Any], Any] | None, _depth: int = 0,
                   _open: set[int] | None = None) -> bool:
    """True when ``obj`` holds an array anywhere (or an object an adapter handles)."""
    plain = type(obj) is dict or type(obj) is list  # (neither an array nor a scalar)
    if not plain and _is_array_like(obj):
        return True
    if not plain and isinstance(obj, _SCALARS):
        return False
    if plain or isinstance(obj, (Mapping, list, tuple)):
        if _depth >= MAX_DEPTH:
            raise _BadNesting("deep")
        if _open is None:
            _open = set()
        ident = id(obj)
        if ident in _open:
            raise _BadNesting("cycle")
        _open.add(ident)
        try:
            items = obj.items() if isinstance(obj, Mapping) else enumerate(obj)
            for k, v in items:
                try:
                    if contains_array(v, resolve, _depth + 1, _open):
                        return True
                except _BadNesting as e:
                    e.parts.append(k)
                    raise
        finally:
            _open.discard(ident)
        return False
    return resolve is not None and resolve(obj) is not None


def _nesting_error(e: _BadNesting, path: str) -> UnsupportedStateError:
    for k in reversed(e.parts):
        path = join(path, k)
    if e.kind == "cycle":
        return UnsupportedStateError(
            f"state entry {_where(path)} contains itself (a reference cycle); pitstop saves "
            "trees, not graphs")
    return _too_deep(path)


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


def _where(path: str) -> str:
    return repr(path) if path else "<root>"


def _too_deep(path: str) -> UnsupportedStateError:
    return UnsupportedStateError(
        f"state entry {_where(path[:200] + ('...' if len(path) > 200 else ''))}: nested more "
        f"than {MAX_DEPTH} levels deep; pitstop saves states up to that depth (flatten the "
        "structure, or keep deep data in an array)")


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


class StructureError(ValueError):
    """A recorded structure that does not fit its manifest; ``key`` is where."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


_NODE_TAGS = frozenset(("$d", "$l", "$t"))


def check_structure(structure: Any, arrays: Container[str], values: Container[str],
                    path: str = "", depth: int = 0) -> None:
    """Raise :class:`StructureError` unless ``structure`` is one :func:`flatten` could have
    recorded for these array and value keys: every node well formed, every leaf a key that
    exists (a numpy-scalar leaf an array), so :func:`unflatten` cannot fail on it."""
    if type(structure) is int and (structure == 0 or structure == 1):
        here = path or "<root>"
        if here not in arrays and (structure == 1 or here not in values):
            raise StructureError(f"structure names a leaf {_where(here)} that the manifest "
                                 "does not hold" + (" as an array" if here in values else ""),
                                 here)
        return
    if depth > 2 * MAX_DEPTH + 8:
        raise StructureError(f"structure is nested more than {2 * MAX_DEPTH} levels deep",
                             _leaf_path(path))
    if type(structure) is not dict:
        raise StructureError(f"structure at {_where(path)} is {_brief(structure)}, not a "
                             "node", _leaf_path(path))
    n = len(structure)
    if n == 1:
        (tag, sub), = structure.items()
    elif n == 2 and "$o" in structure and type(structure.get("$type")) is str:
        tag, sub = "$o", structure["$o"]
    else:
        tag = sub = None
    if tag == "$o":
        check_structure(sub, arrays, values, path, depth + 1)
        return
    if tag not in _NODE_TAGS or type(sub) is not list:
        raise StructureError(f"structure at {_where(path)} is not a node "
                             f"({_brief(structure)})", _leaf_path(path))
    if tag != "$d":
        for i, item in enumerate(sub):
            check_structure(item, arrays, values, f"{path}/{i}" if path else str(i), depth + 1)
        return
    for item in sub:
        if type(item) is not list or len(item) != 2 or (
                type(item[0]) is not str and type(item[0]) is not int):
            raise StructureError(f"structure at {_where(path)}: $d holds {_brief(item)}, not "
                                 "a [str or int key, node] pair", _leaf_path(path))
        node = item[1]
        here = join(path, item[0])
        if type(node) is int and (here in arrays or (node == 0 and here in values)) and (
                node == 0 or node == 1):
            continue  # a leaf that exists (the check below, inlined: one per tensor)
        check_structure(node, arrays, values, here, depth + 1)


# --------------------------------------------------------------------------- flatten
Resolver = Callable[[Any], Any]  # obj -> adapter or None


class FlattenCache:
    """What :func:`flatten` made of the big plain dicts of numpy arrays it walked last
    time (a model's 100,000 parameters), reused when such a dict holds the same arrays
    again under the same keys, with the same shapes and dtypes: a save then costs a
    comparison per array, not a new leaf. One per manager; it keeps references to the
    arrays of the last save's dicts until the next flatten with it, or :meth:`clear`."""

    #: dicts with fewer arrays are walked as usual (nothing to gain)
    MIN = 256

    def __init__(self) -> None:
        #: id(dict) -> (dict, path, keys, arrays, shapes, dtypes, leaf paths, leaves, items)
        self.last: dict[int, tuple[Any, ...]] = {}
        self.next: dict[int, tuple[Any, ...]] = {}

    def clear(self) -> None:
        self.last, self.next = {}, {}

    def reuse(self, obj: dict[str, Any], path: str) -> tuple[Any, ...] | None:
        """The record of ``obj`` at ``path`` when it still holds what it held."""
        rec = self.last.get(id(obj))
        if rec is None or rec[0] is not obj or rec[1] != path or len(obj) != len(rec[2]):
            return None
        if list(obj) != rec[2]:  # (the same str objects: compared by identity first)
            return None
        for a, b, shape, dt in zip(obj.values(), rec[3], rec[4], rec[5], strict=True):
            # (a reshape or a dtype change in place keeps the object: checked too)
            if a is not b or a.shape != shape or a.dtype is not dt:
                return None
        return rec


def flatten(state: Any, resolve: Resolver | None = None,
            cache: FlattenCache | None = None) -> FlatState:
    """Flatten ``state`` into array leaves (by reference) and value leaves.

    ``structure`` records containers that hold arrays so :func:`unflatten` can rebuild the
    nesting: a dict becomes ``{"$d": [[key, sub], ...]}``, a list ``{"$l": [...]}``, a tuple
    ``{"$t": [...]}``, an adapter-handled object ``{"$o": sub}`` (with ``"$type"``, the
    object's type name, when its adapter has ``type_tag``), a leaf ``0`` and a numpy
    scalar (stored as a 0-d array) ``1``. A state nested deeper than :data:`MAX_DEPTH` or
    containing itself is refused with :class:`UnsupportedStateError`.
    """
    flat = FlatState(root=state)
    walker = _Flattener(flat, resolve)
    walker.cache = cache
    if cache is not None:
        cache.next = {}  # (what a flatten that raised had begun)
    flat.structure = walker.walk(state, "", None, None, 0)
    if cache is not None:
        cache.last, cache.next = cache.next, {}
    return flat


class _Flattener:
    def __init__(self, flat: FlatState, resolve: Resolver | None) -> None:
        self.flat = flat
        self.resolve = resolve
        #: ids of the containers on the path being walked (a reference cycle check)
        self.open: set[int] = set()
        self.cache: FlattenCache | None = None

    def walk(self, obj: Any, path: str, parent: Any, key: Any, depth: int) -> Any:
        flat = self.flat
        if type(obj) is np.ndarray:  # the common leaf first
            flat.arrays[path or "<root>"] = NumpyLeaf(obj)
            return 0
        if type(obj) is dict:  # then the common container (a plain dict is no leaf)
            if depth >= MAX_DEPTH:
                raise _too_deep(path)
            return self._container(obj, path, parent, key, depth)
        if isinstance(obj, ArrayLeaf):
            flat.arrays[_leaf_path(path)] = obj
            if obj.sharded:
                flat.sharded.append(_leaf_path(path))
            return 0
        if isinstance(obj, np.ndarray):
            if isinstance(obj, np.ma.MaskedArray):
                raise UnsupportedStateError(
                    f"state entry {_where(path)} is a numpy masked array: pitstop would save "
                    "its data and lose the mask. Put .data and .mask (np.ma.getmaskarray) in "
                    "the state as two arrays.")
            flat.arrays[_leaf_path(path)] = NumpyLeaf(obj)
            return 0
        if isinstance(obj, np.generic):
            # a numpy scalar is saved as a 0-d array; restore replaces the entry (immutable)
            flat.arrays[_leaf_path(path)] = NumpyLeaf(np.array(obj))
            flat.scalars[_leaf_path(path)] = (parent, key)
            return 1
        if isinstance(obj, SCALAR_TYPES + (bytes,)):
            return _value(obj, path, flat, parent, key)
        if depth >= MAX_DEPTH:
            raise _too_deep(path)
        if isinstance(obj, (Mapping, list, tuple)) and not (
                type(obj) is not dict and _frozen_mapping(obj) and self._adapted(obj)):
            return self._container(obj, path, parent, key, depth)
        adapter = self.resolve(obj) if self.resolve is not None else None
        if adapter is None:
            # raises a clear UnsupportedStateError
            encode_value(obj, path)
            raise AssertionError("unreachable")
        if id(obj) in self.open:
            raise UnsupportedStateError(
                f"state entry {_where(path)} contains itself (a reference cycle)")
        self.open.add(id(obj))
        try:
            try:
                subtree = adapter.capture(obj)
            except UnsupportedStateError as e:
                raise _at(e, path) from e.__cause__
            except CheckpointError:
                raise
            except Exception as e:
                raise UnsupportedStateError(
                    f"state entry {_where(path)}: capturing the {type(obj).__name__} failed "
                    f"({type(e).__name__}: {e})") from e
            flat.caveats.extend(f"state entry {_where(path)}: {c}" for c in adapter.caveats(obj))
            node = AdapterNode(obj, adapter, subtree, [subtree], parent, key)
            sub = self.walk(subtree, path, node.holder, 0, depth + 1)
        finally:
            self.open.discard(id(obj))
        flat.adapters.append((path, node))
        flat.used.add(adapter)
        # (a framework one adapter captures for another: Keras on TF)
        flat.used.update(adapter.frameworks(obj))
        name = adapter.type_tag(obj)
        return {"$o": sub, "$type": name} if name else {"$o": sub}

    def _container(self, obj: Any, path: str, parent: Any, key: Any, depth: int) -> Any:
        """A dict, list or tuple: a value leaf when it holds no array, else walked."""
        flat = self.flat
        if id(obj) in self.open:
            raise UnsupportedStateError(
                f"state entry {_where(path)} contains itself (a reference cycle); "
                "pitstop saves trees, not graphs")
        try:
            has_arrays = contains_array(obj, self.resolve, depth)
        except _BadNesting as e:
            raise _nesting_error(e, path) from None
        if not has_arrays and depth > 0:
            # a subtree without arrays is one value leaf (JSON); the root container is
            # always walked, so its entries are matched key by key on restore
            return _value(obj, path, flat, parent, key)
        self.open.add(id(obj))
        try:
            if isinstance(obj, Mapping):
                return self._mapping(obj, path, depth)
            subs = [self.walk(v, join(path, i), obj, i, depth + 1) for i, v in enumerate(obj)]
        finally:
            self.open.discard(id(obj))
        if isinstance(obj, tuple):
            flat.tuples[id(obj)] = (path, parent, key)
            return {"$t": subs}
        return {"$l": subs}

    def _adapted(self, obj: Any) -> bool:
        """An immutable mapping an adapter rebuilds (a Flax FrozenDict): not walked as a
        container, whose entries could not be put back."""
        return self.resolve is not None and self.resolve(obj) is not None

    def _mapping(self, obj: Mapping[Any, Any], path: str, depth: int) -> Any:
        if type(obj) is dict:
            cache = self.cache
            if cache is not None and len(obj) >= cache.MIN:
                rec = cache.reuse(obj, path)
                if rec is not None:  # the same arrays as at the last save
                    self.flat.arrays.update(zip(rec[6], rec[7], strict=True))
                    cache.next[id(obj)] = rec
                    return {"$d": list(rec[8])}
            if all(type(k) is str for k in obj):
                return self._str_dict(obj, path, depth)
        items = []
        texts: dict[str, Any] = {}
        for k, v in obj.items():
            name = _key_text(k, path)
            if name in texts:
                # 1 and "1" share the key path "…/1": one would silently overwrite the other
                raise UnsupportedStateError(
                    f"state entry {_where(path)}: keys {texts[name]!r} and {k!r} have the "
                    f"same key path {join(path, name)!r}; rename one")
            texts[name] = k
            # the structure records the key as saved (an int stays an int); the live key is
            # kept for putting values back (an enum key hashes unlike its text)
            items.append([name if isinstance(k, str) else int(k),
                          self.walk(v, join(path, name), obj, k, depth + 1)])
        return {"$d": items}


    def _str_dict(self, obj: dict[str, Any], path: str, depth: int) -> Any:
        """:meth:`_mapping` of a plain dict whose keys are all plain str (no two can share a
        key path), with its numpy leaves taken inline: a model's parameters, a dict of
        100,000 arrays, cost one short loop step each rather than a call of :meth:`walk`."""
        items: list[list[Any]] = []
        arrays = self.flat.arrays
        cache = self.cache
        prefix = path + "/" if path else ""
        ndarray, leaf = np.ndarray, NumpyLeaf
        only = True  # only plain numpy arrays, under keys that need no escaping
        for k, v in obj.items():
            if type(v) is ndarray and k and "/" not in k and "~" not in k:
                arrays[prefix + k] = leaf(v)
                items.append([k, 0])
            else:
                only = False
                items.append([k, self.walk(v, join(path, k), obj, k, depth + 1)])
        if cache is not None and only and len(obj) >= cache.MIN:
            values = list(obj.values())
            paths = [prefix + k for k in obj]
            cache.next[id(obj)] = (obj, path, list(obj), values, [v.shape for v in values],
                                   [v.dtype for v in values], paths,
                                   [arrays[p] for p in paths], items)
            return {"$d": list(items)}
        return {"$d": items}


def _frozen_mapping(obj: Any) -> bool:
    return isinstance(obj, Mapping) and not isinstance(obj, MutableMapping)


def _key_text(k: Any, path: str) -> str:
    """The text of a dict key beside arrays: a str (subclasses such as str enums by their
    value) or an int (numpy integers, int enums by their value); anything else is refused."""
    if type(k) is str:
        return k
    if isinstance(k, str):
        return str.__str__(k)
    if isinstance(k, (int, np.integer)) and not isinstance(k, (bool, np.bool_)):
        return str(int(k))
    raise UnsupportedStateError(
        f"state entry {_where(path)}: key {k!r} of type {type(k).__name__} cannot be saved "
        "beside arrays (a key path needs a str or an int key); use str or int keys")


def _at(e: UnsupportedStateError, path: str) -> UnsupportedStateError:
    """``e`` with the state path in front (adapters do not know where their object sits)."""
    text = str(e)
    if text.startswith("state entry "):
        return e
    return UnsupportedStateError(f"state entry {_where(path)}: {text}")


def _leaf_path(path: str) -> str:
    return path if path else "<root>"


def _value(obj: Any, path: str, flat: FlatState, parent: Any, key: Any) -> int:
    p = _leaf_path(path)
    # on the caller's thread: fails now, not later in the background persist (a set, an
    # object), and copies deeply whatever the container (a MappingProxyType, a UserDict)
    flat.encoded[p] = encode_value(obj, path)
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


def select(obj: Any, key: str | None, source: str) -> Any:
    """The subtree of a loaded tree at ``key``, a pitstop key path (``"model"``,
    ``"state/model"``); ``source`` names the checkpoint in the error when it has none."""
    if key is None:
        return obj
    node = obj
    for comp in split(key):
        if isinstance(node, Mapping):
            if comp in node:
                node = node[comp]
                continue
            if comp.lstrip("-").isdigit() and int(comp) in node:
                node = node[int(comp)]
                continue
        elif isinstance(node, (list, tuple)) and comp.isdigit() and int(comp) < len(node):
            node = node[int(comp)]
            continue
        if isinstance(node, Mapping):
            have = ", ".join(repr(k) for k in sorted(map(str, node))) or "none"
            found = f"entries there: {have}"
        elif isinstance(node, (list, tuple)):
            found = f"a list of {len(node)} there (keys 0 to {len(node) - 1})"
        else:
            found = f"a {type(node).__name__} there, which has no entries"
        raise CheckpointNotFoundError(
            f"{source} has no entry {key!r} (no {comp!r}; {found}). Pass one of them as key=, "
            "or key=None for everything.")
    return node
