"""Flattening a user's state: nested dicts, lists and tuples walked into array leaves (by
reference) and value leaves, framework objects turned into subtrees by their adapters, and
the structure recorded so that :func:`~pitstop.core.tree.structure.unflatten` rebuilds it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pitstop.core.errors import CheckpointError, UnsupportedStateError
from pitstop.core.tree.leaves import ArrayLeaf, NumpyLeaf
from pitstop.core.tree.paths import MAX_DEPTH, _leaf_path, _too_deep, _where, join
from pitstop.core.tree.values import SCALAR_TYPES, encode_value


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


def _value(obj: Any, path: str, flat: FlatState, parent: Any, key: Any) -> int:
    p = _leaf_path(path)
    # on the caller's thread: fails now, not later in the background persist (a set, an
    # object), and copies deeply whatever the container (a MappingProxyType, a UserDict)
    flat.encoded[p] = encode_value(obj, path)
    flat.values[p] = obj
    if parent is not None:
        flat.parents[p] = (parent, key)
    return 0

