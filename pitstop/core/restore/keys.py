"""Key paths of a target and a checkpoint: which keys lie under a prefix, what a recorded
structure node is (the plan and the check phases match targets by them)."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

ROOT = "<root>"


class _Keys:
    """A sorted set of key paths answering "which keys lie under this prefix" by bisection."""

    def __init__(self, keys: Iterable[str]) -> None:
        self.set = set(keys)
        self._sorted: list[str] | None = None

    @property
    def keys(self) -> list[str]:
        """Every key, sorted (sorted on first use: a restore that matches needs no order)."""
        if self._sorted is None:
            self._sorted = sorted(self.set)
        return self._sorted

    def under(self, prefix: str) -> list[str]:
        """Keys equal to ``prefix`` or below it (every key for the root, ``""``)."""
        if not prefix:
            return list(self.keys)
        lo = bisect.bisect_left(self.keys, prefix + "/")
        hi = bisect.bisect_left(self.keys, prefix + "0")  # "0" follows "/" in code points
        out = self.keys[lo:hi]
        if prefix in self.set:
            out.append(prefix)
        return out


def _is_under(key: str, prefix: str) -> bool:
    return not prefix or key == prefix or key.startswith(prefix + "/")


def _root_key(path: str) -> str:
    return path or ROOT


def _kind(structure: Any) -> str:
    """What a recorded structure node is, through adapter wrappers: leaf, dict, list, tuple."""
    while isinstance(structure, dict) and "$o" in structure:
        structure = structure["$o"]
    if not isinstance(structure, dict):
        return "leaf"
    for tag, kind in (("$d", "dict"), ("$l", "list"), ("$t", "tuple")):
        if tag in structure:
            return kind
    return "leaf"


def _child(node: Any, comp: str) -> Any:
    """The structure node of one path component below ``node`` (None if absent)."""
    while isinstance(node, dict) and "$o" in node:
        node = node["$o"]
    if not isinstance(node, dict):
        return None
    if "$d" in node:
        for k, sub in node["$d"]:
            if str(k) == comp:
                return sub
        return None
    seq = node.get("$l", node.get("$t"))
    if seq is not None and comp.isdigit() and int(comp) < len(seq):
        return seq[int(comp)]
    return None
