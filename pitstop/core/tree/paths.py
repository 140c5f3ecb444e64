"""Key paths: the names of a state tree's leaves.

Key paths join components with ``/``; a ``/`` or ``~`` inside a component is escaped as
``~1`` / ``~0`` (as in JSON Pointer) and an empty component is written ``~2``, so every path
maps back to exactly one component list and no key collides with another (or with
``<root>``, the path of a state that is itself a single leaf).
"""

from __future__ import annotations

from typing import Any

from pitstop.core.errors import UnsupportedStateError

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


def _leaf_path(path: str) -> str:
    return path if path else "<root>"


def _where(path: str) -> str:
    return repr(path) if path else "<root>"


def _too_deep(path: str) -> UnsupportedStateError:
    return UnsupportedStateError(
        f"state entry {_where(path[:200] + ('...' if len(path) > 200 else ''))}: nested more "
        f"than {MAX_DEPTH} levels deep; pitstop saves states up to that depth (flatten the "
        "structure, or keep deep data in an array)")

