"""How pitstop reads its JSON documents (a manifest, ``.pitstop/directory.json``): strict
JSON with no key twice, the cyclic collector paused while many small objects are made, and
a fresh stack for a caller already deep in its own.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from pitstop.core.tree.paths import MAX_DEPTH


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """One JSON object, refused when a key occurs twice in it: Python's json keeps the last,
    a quick read of the leading fields the first, so the two could disagree about whose
    checkpoint it is (and other JSON readers pick either)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _v in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"key {_brief(dup)} occurs twice in one object")
    return out


def load_json(data: bytes | str) -> Any:
    """The one parse of a manifest and of ``.pitstop/directory.json``: strict JSON (no
    ``NaN``/``Infinity``, no number beyond a double) and no key twice in one object.
    Raises ``ValueError`` (``json.JSONDecodeError`` for a syntax error), ``RecursionError``
    or ``UnicodeDecodeError``."""
    return json.loads(data, object_pairs_hook=_unique, parse_constant=_not_json,
                      parse_float=_finite)


def _not_json(word: str) -> Any:
    """``NaN``, ``Infinity``, ``-Infinity``: Python's json reads them, JSON has no such
    thing (pitstop writes a non-finite float as ``{"$float": "nan"}``)."""
    raise ValueError(f"{word} is not JSON")


def _finite(text: str) -> float:
    """A JSON number with a fraction or exponent; one too large for a double (``1e400``,
    which Python would read as infinity) is not one pitstop writes."""
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"number {text[:40]} is out of range")
    return v


_gc_lock = threading.Lock()

_gc_pauses = [0, False]  # how many gc_paused() are open; whether the collector was enabled


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (reference counting goes on) while a manifest of
    many entries is decoded: its 100,000 small dicts would otherwise set off collections
    that rescan the whole heap of a large job again and again (half of the parse time).
    Pauses on several threads compose: the collector runs again when the last one ends,
    and only if it ran when the first began."""
    with _gc_lock:
        if _gc_pauses[0] == 0:
            _gc_pauses[1] = gc.isenabled()
            gc.disable()
        _gc_pauses[0] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses[0] -= 1
            if _gc_pauses[0] == 0 and _gc_pauses[1]:
                gc.enable()


#: the frames parsing may need: the JSON nesting of the deepest structure pitstop writes
#: (three levels per container), then the checks walking it, with room to spare
PARSE_FRAMES = 3 * MAX_DEPTH + 300


def deeper_than(frames: int) -> bool:
    """Whether the caller's stack is more than ``frames`` frames deep."""
    f: Any = sys._getframe(1)
    for _ in range(max(frames, 0)):
        f = f.f_back
        if f is None:
            return False
    return True


def on_fresh_stack(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` run on a fresh thread's stack (its result, or its exception raised)."""
    out: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            out.append((True, fn(*args)))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            out.append((False, e))

    t = threading.Thread(target=run, name="pitstop-parse", daemon=True)
    t.start()
    t.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


def _brief(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:76] + "...'"

