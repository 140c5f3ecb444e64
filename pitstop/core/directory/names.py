"""How pitstop names what it writes in a checkpoint directory, in one place.

A directory's :class:`Naming` (recorded in ``.pitstop/directory.json`` when the directory is
created) says what its committed checkpoints are called: ``<prefix><step, zero-padded to at
least ``digits`` digits>``. The default, :data:`DEFAULT`, is ``step_`` + 10 digits
(``step_0000000042``); ``Naming("ckpt-", 0)`` gives tf.train.CheckpointManager's ``ckpt-42``
and ``Naming("", 0)`` Orbax's ``42``. Only the canonical spelling is a checkpoint: under the
default, ``step_5`` (not padded) or ``step_0000000005x`` are foreign entries that pitstop
lists as such and never touches; under ``ckpt-``/0, ``ckpt-05`` is foreign.

A checkpoint moved out of the listing keeps its name and gains a suffix:
``.corrupt-<unix time>-<4 hex>`` (failed verification) or ``.abandoned-<unix time>-<4 hex>``
(a newer step of a run that was rolled back, moved aside at the rolled-back run's first
save). A save in progress is ``.tmp-<name>-<8 hex>``, a deletion in progress
``.tmp-deleting-<name>-<8 hex>``. A prefix never starts with ``.`` and never ends with a
digit, so a checkpoint name is never a temporary's or a moved-aside one's, and its step
reads back unambiguously.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from pitstop.core.errors import InvalidArgumentError

#: reasons a checkpoint is moved aside (kept whole, never listed, never deleted by pitstop)
MOVED_ASIDE = ("corrupt", "abandoned")
#: the most digits a naming may pad to, and the longest prefix (bytes): a name, its
#: temporaries and its moved-aside form must fit a file name (255 bytes)
MAX_DIGITS = 20
MAX_PREFIX_BYTES = 128
TMP_PREFIX = ".tmp-"
_DIGITS = "0123456789"
_ASIDE = re.compile(r"^(.+)\.(corrupt|abandoned)-([0-9]+)-([0-9a-f]{4})$", re.S)
_TMP = re.compile(r"^\.tmp-(.+)-[0-9a-f]{8}$", re.S)


@dataclass(frozen=True)
class Naming:
    """The names of one directory's checkpoints: ``prefix`` + the step zero-padded to at
    least ``digits`` digits. Raises InvalidArgumentError (naming step_prefix or step_digits)
    for a naming whose names would not read back unambiguously."""

    prefix: str = "step_"
    digits: int = 10

    def __post_init__(self) -> None:
        p, d = self.prefix, self.digits
        if not isinstance(p, str):
            raise InvalidArgumentError(f"step_prefix must be a str, got {type(p).__name__} {p!r}")
        if "/" in p or "\0" in p:
            raise InvalidArgumentError(
                f"step_prefix {p!r} holds a {'/' if '/' in p else 'NUL character'}; a "
                "checkpoint is one directory entry, so its prefix cannot")
        if p.startswith("."):
            raise InvalidArgumentError(
                f"step_prefix {p!r} starts with '.': pitstop's own entries (.pitstop, .tmp-*) "
                "do, and names starting with '.' are never checkpoints")
        if p and p[-1] in _DIGITS:
            raise InvalidArgumentError(
                f"step_prefix {p!r} ends with a digit, so its names would not say where the "
                "step begins; end it with another character (e.g. 'ckpt-')")
        try:
            size = len(os.fsencode(p))
        except UnicodeError:
            raise InvalidArgumentError(f"step_prefix {p!r} cannot be part of a file name "
                                       "(it holds an unpaired surrogate)") from None
        if size > MAX_PREFIX_BYTES:
            raise InvalidArgumentError(
                f"step_prefix is {size} bytes long; at most {MAX_PREFIX_BYTES} fit in a file "
                "name beside the step and pitstop's suffixes")
        if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= MAX_DIGITS:
            raise InvalidArgumentError(
                f"step_digits must be an int from 0 to {MAX_DIGITS} (the width the step is "
                f"zero-padded to; 0: not padded), got {d!r}")

    def name(self, step: int) -> str:
        """The directory name of the checkpoint of ``step``."""
        return f"{self.prefix}{step:0{self.digits}d}" if self.digits else f"{self.prefix}{step}"

    def parse(self, name: str) -> int | None:
        """The step of a checkpoint directory name, or None when this naming did not make it
        (only the canonical spelling: no extra leading zeros)."""
        if not name.startswith(self.prefix):
            return None
        rest = name[len(self.prefix):]
        if not rest or len(rest) > 255 or rest.strip(_DIGITS):
            return None
        step = int(rest)
        return step if self.name(step) == name else None

    def aside(self, step: int, reason: str, unix_time: int, tag: str) -> str:
        """The name the checkpoint of ``step`` gets when it is moved aside for ``reason``."""
        return aside_name(self.name(step), reason, unix_time, tag)

    def parse_aside(self, name: str) -> tuple[int, str] | None:
        """(step, reason) of a moved-aside checkpoint's name, or None."""
        m = _ASIDE.match(name)
        if m is None:
            return None
        step = self.parse(m.group(1))
        return None if step is None else (step, m.group(2))

    def parse_tmp(self, name: str) -> int | None:
        """The step of a save or deletion in progress (``.tmp-[deleting-]<name>-<8 hex>``)
        of a checkpoint of this naming, or None."""
        m = _TMP.match(name)
        if m is None:
            return None
        inner = m.group(1)
        step = self.parse(inner)
        if step is None and inner.startswith("deleting-"):
            step = self.parse(inner[len("deleting-"):])
        return step

    def describe(self) -> str:
        """How the names look, for messages: ``step_<step padded to 10 digits>``."""
        if self.digits <= 1:
            return f"{self.prefix}<step>"
        return f"{self.prefix}<step padded to {self.digits} digits>"

    def to_json(self) -> dict[str, Any]:
        """The record kept in ``.pitstop/directory.json``."""
        return {"step_prefix": self.prefix, "step_digits": self.digits}

    @classmethod
    def from_json(cls, doc: Any) -> Naming:
        """The naming a ``directory.json`` record holds; InvalidArgumentError when it holds
        none that is valid."""
        if not isinstance(doc, dict) or set(doc) != {"step_prefix", "step_digits"}:
            raise InvalidArgumentError(
                "the naming must be {\"step_prefix\": <str>, \"step_digits\": <int>}, found "
                f"{str(doc)[:80]}")
        return cls(doc["step_prefix"], doc["step_digits"])


def tmp_name(name: str, tag: str, *, deleting: bool = False) -> str:
    """The temporary a save (or, with ``deleting``, a deletion) of ``name`` works in."""
    return f"{TMP_PREFIX}{'deleting-' if deleting else ''}{name}-{tag}"


def aside_name(name: str, reason: str, unix_time: int, tag: str) -> str:
    """The name a checkpoint named ``name`` gets when it is moved aside for ``reason``."""
    if reason not in MOVED_ASIDE:
        raise ValueError(f"unknown reason {reason!r}")
    return f"{name}.{reason}-{unix_time}-{tag}"


#: ``step_`` + 10 digits: every directory written before namings were recorded
DEFAULT = Naming()
#: the default naming's functions (directories whose naming is not known use these)
step_name = DEFAULT.name
parse_step_name = DEFAULT.parse
parse_aside_name = DEFAULT.parse_aside

__all__ = ["Naming", "DEFAULT", "MOVED_ASIDE", "step_name", "parse_step_name", "aside_name",
           "parse_aside_name", "tmp_name"]
