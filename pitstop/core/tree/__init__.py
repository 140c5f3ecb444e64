"""The neutral state tree: nested dicts/lists whose leaves are arrays or JSON-able values.

``flatten`` turns a user's state into ``{key_path: leaf}`` where each leaf is an
:class:`ArrayLeaf` (a reference to live memory, never a copy) or a value leaf (small
JSON-able state). Framework objects are turned into subtrees by adapters
(:mod:`pitstop.core.adapter`); core itself never imports a framework.

The package's modules, bottom up: ``paths`` (key paths), ``values`` (the JSON encoding of
value leaves), ``leaves`` (array leaves, :class:`ArraySpec`), ``structure`` (the recorded
nesting: checked, rebuilt), ``flatten`` (a state walked into leaves). The names below are
the ones adapters and the rest of pitstop use.
"""

from pitstop.core.tree.flatten import (
    AdapterNode,
    FlatState,
    FlattenCache,
    Resolver,
    contains_array,
    flatten,
)
from pitstop.core.tree.leaves import ArrayLeaf, ArraySpec, NumpyLeaf, has_internal_overlap
from pitstop.core.tree.paths import MAX_DEPTH, escape, join, split, unescape
from pitstop.core.tree.structure import (
    StructureError,
    check_structure,
    iter_structure_paths,
    select,
    unflatten,
)
from pitstop.core.tree.values import SCALAR_TYPES, decode_value, encode_value

__all__ = [
    "MAX_DEPTH", "SCALAR_TYPES", "AdapterNode", "ArrayLeaf", "ArraySpec", "FlatState",
    "FlattenCache", "NumpyLeaf", "Resolver", "StructureError", "check_structure",
    "contains_array", "decode_value", "encode_value", "escape", "flatten",
    "has_internal_overlap", "iter_structure_paths", "join", "select", "split", "unescape",
    "unflatten",
]
