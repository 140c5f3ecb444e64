"""How text read from a run directory (a key, a file or metric name a manifest or
``directory.json`` holds) is shown: printable, on one line; one rule for every reader that
prints it (the retention explanation, the ``pitstop`` command)."""

from __future__ import annotations

import json
from typing import Any


def printable(text: object) -> str:
    """Text read from a checkpoint (a key, a file or metric name) as printable text on one
    line: a newline, an escape sequence or a bidi override in it is escaped, so a manifest
    cannot forge output lines ("step 2: ok") or drive the terminal."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace")
                   .decode("ascii") for c in s)


def brief(obj: Any, width: int = 100) -> str:
    """A JSON value as compact printable text, cut to ``width`` characters (``...``)."""
    try:
        text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        text = repr(obj)
    text = printable(text)
    return text if len(text) <= width else text[: width - 3] + "..."


__all__ = ["printable", "brief"]
