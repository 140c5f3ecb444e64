"""How pitstop names what it writes in a checkpoint directory, in one place.

A committed checkpoint is ``step_<step, zero-padded to 10 digits>`` (more digits once a step
needs them). A checkpoint moved out of the listing keeps its name and gains a suffix:
``.corrupt-<unix time>-<4 hex>`` (failed verification) or ``.abandoned-<unix time>-<4 hex>``
(a newer step of a run that was rolled back, moved aside at the rolled-back run's first
save). Only names that :func:`parse_step_name` accepts are checkpoints; ``step_5`` (not
padded) or ``step_0000000005x`` are foreign entries that pitstop lists as such and never
touches.
"""

from __future__ import annotations

import re

_STEP = re.compile(r"^step_(\d{10,})$")
#: reasons a checkpoint is moved aside (kept whole, never listed, never deleted by pitstop)
MOVED_ASIDE = ("corrupt", "abandoned")
_ASIDE = re.compile(r"^(step_\d{10,})\.(corrupt|abandoned)-(\d+)-([0-9a-f]{4})$")


def step_name(step: int) -> str:
    """The directory name of the checkpoint of ``step``."""
    return f"step_{step:010d}"


def parse_step_name(name: str) -> int | None:
    """The step of a checkpoint directory name, or None when pitstop did not name it so."""
    m = _STEP.match(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_name(step) == name else None


def aside_name(name: str, reason: str, unix_time: int, tag: str) -> str:
    """The name a checkpoint gets when it is moved aside for ``reason``."""
    if reason not in MOVED_ASIDE:
        raise ValueError(f"unknown reason {reason!r}")
    return f"{name}.{reason}-{unix_time}-{tag}"


def parse_aside_name(name: str) -> tuple[int, str] | None:
    """(step, reason) of a moved-aside checkpoint's name, or None."""
    m = _ASIDE.match(name)
    if m is None:
        return None
    step = parse_step_name(m.group(1))
    return None if step is None else (step, m.group(2))


__all__ = ["step_name", "parse_step_name", "aside_name", "parse_aside_name", "MOVED_ASIDE"]
