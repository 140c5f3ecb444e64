"""Putting restored values where the live ones are: containers merged in place, tuples and
namedtuples rebuilt as their own type, and the checks that say beforehand where that
cannot be done."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np

from pitstop.core.errors import CheckpointError
from pitstop.core.tree import encode_value

_PLAIN = (bool, int, float, str, bytes, type(None))


def merge(live: Any, new: Any) -> Any:
    """Put the restored value ``new`` where ``live`` is: mutable containers are updated in
    place and keep their type (dict, OrderedDict, defaultdict, list, bytearray), nested ones
    too, so aliases the program holds stay the restored objects; a defaultdict's new entries
    are made by its factory; tuples (namedtuples too) are rebuilt as their own type; an
    equal plain value stays the object it is. Returns what the parent must hold: ``live``
    itself when nothing had to be replaced."""
    if isinstance(live, MutableMapping) and isinstance(new, Mapping):
        factory = getattr(live, "default_factory", None)
        items = []
        for k, v in new.items():
            if type(k) is str and k not in live and k.isdigit() and int(k) in live:
                # a checkpoint that lost its int keys (imported from DCP, whose keys are
                # all strings) goes back under the keys the live dict has
                k = int(k)
            if k in live:
                items.append((k, merge(live[k], v)))
            elif factory is not None and isinstance(v, (Mapping, list)):
                items.append((k, merge(factory(), v)))
            else:
                items.append((k, v))
        live.clear()
        for k, v in items:  # item by item: Counter.update would add counts
            live[k] = v
        return live
    if isinstance(live, list) and isinstance(new, (list, tuple)):
        live[:] = [merge(live[i], v) if i < len(live) else v for i, v in enumerate(new)]
        return live
    if isinstance(live, bytearray) and isinstance(new, (bytes, bytearray)):
        live[:] = new
        return live
    if isinstance(live, tuple) and isinstance(new, (tuple, list)) and len(live) == len(new):
        items = [merge(x, v) for x, v in zip(live, new, strict=True)]
        if all(a is b for a, b in zip(items, live, strict=True)):
            return live
        return _rebuild_tuple(live, items, _tuple_style(live))
    if type(live) is type(new) and isinstance(live, _PLAIN) and not _changes(live, new):
        return live
    return new


def _merge_problem(live: Any, new: Any) -> str | None:
    """Why :func:`merge` could not put ``new`` where ``live`` is (a tuple type that cannot
    be rebuilt from its items, deep inside a value), or None; checked before any write."""
    if isinstance(live, MutableMapping) and isinstance(new, Mapping):
        for k, v in new.items():
            if k in live:
                why = _merge_problem(live[k], v)
                if why is not None:
                    return why
        return None
    if isinstance(live, list) and isinstance(new, (list, tuple)):
        for x, v in zip(live, new, strict=False):
            why = _merge_problem(x, v)
            if why is not None:
                return why
        return None
    if isinstance(live, tuple) and isinstance(new, (tuple, list)) and len(live) == len(new):
        for x, v in zip(live, new, strict=True):
            why = _merge_problem(x, v)
            if why is not None:
                return why
        if _changes(live, new) and _tuple_style(live) is None:
            return (f"it holds a {type(live).__name__}, a tuple type that cannot be rebuilt "
                    "from its items; use a namedtuple, a tuple or a list")
    return None


def _changes(live: Any, new: Any) -> bool:
    """True when putting ``new`` where ``live`` is would change something."""
    if isinstance(live, (MutableMapping, list, bytearray)) and \
            isinstance(new, (Mapping, list, tuple, bytes, bytearray)):
        return False  # merged in place: the container itself stays
    if isinstance(live, tuple) and isinstance(new, (tuple, list)):
        return len(live) != len(new) or any(
            _changes(a, b) for a, b in zip(live, new, strict=True))
    if type(live) is not type(new):
        return True
    try:
        return bool(encode_value(live) != encode_value(new))
    except CheckpointError:
        return True


def _same_scalar(live: Any, new: Any) -> bool:
    return type(live) is type(new) and np.asarray(live).tobytes() == np.asarray(new).tobytes()


def _tuple_style(like: tuple[Any, ...]) -> str | None:
    """How a tuple of ``like``'s type is built from items, found by rebuilding ``like``
    itself (no data needed): None when no known way gives an equal tuple."""
    cls = type(like)
    if cls is tuple:
        return "iter"
    if callable(getattr(cls, "_make", None)):
        return "make"
    for style in ("iter", "args"):
        try:
            again = cls(list(like)) if style == "iter" else cls(*like)
        except Exception:  # noqa: BLE001 - any constructor that does not fit
            continue
        if type(again) is cls and tuple(again) == tuple(like):
            return style
    return None


def _rebuild_tuple(like: tuple[Any, ...], items: list[Any], style: str | None
                   ) -> tuple[Any, ...]:
    """A tuple of ``like``'s own type (namedtuples included) holding ``items``."""
    cls = type(like)
    if cls is tuple:
        return tuple(items)
    if style == "make":
        return cls._make(items)  # type: ignore[attr-defined,no-any-return]
    if style == "args":
        return cls(*items)
    if style == "iter":
        return cls(items)
    raise CheckpointError(f"a {cls.__name__} cannot be rebuilt from its items")
