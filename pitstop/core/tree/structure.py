"""The recorded structure of a flattened state (which containers held which leaves): its
check against a manifest's keys, and the rebuild of the nested state from it.
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Mapping
from typing import Any

import numpy as np

from pitstop.core.errors import CheckpointNotFoundError
from pitstop.core.tree.paths import MAX_DEPTH, _leaf_path, _where, join, split
from pitstop.core.tree.values import _brief


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

