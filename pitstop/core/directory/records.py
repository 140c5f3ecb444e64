"""The one tolerant reader of ``.pitstop/directory.json`` for those that only look (``pitstop
ls``, ``inspect``, ``verify``, ``gc``): its records (naming, retention, skipped saves,
saves on a preemption notice, identity) read from one parse, a damaged file read as
"nothing recorded".

A writer reads the identity strictly instead (:func:`pitstop.core.directory.identity.read_identity`).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Any

from pitstop.core.directory.identity import IDENTITY
from pitstop.core.directory.names import DEFAULT, Naming
from pitstop.core.directory.text import brief
from pitstop.core.format.decoding import load_json
from pitstop.core.save.skips import ls_line
from pitstop.core.storage import Storage

#: a directory id that can name memory-tier files (pitstop writes uuid4().hex)
TIER_ID = re.compile(r"^[0-9A-Za-z_-]{1,128}$")
#: the notices ``pitstop ls`` shows (the newest ones; the writer keeps 20)
SHOWN_NOTICES = 5


def _seconds(value: Any) -> float | None:
    """A finite number of ``value`` (a JSON number), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _clock(unix: float, *, day: bool = False) -> str:
    # tenths cut, not rounded: the job's log line says the same time
    whole, tenth = divmod(int(unix * 10), 10)
    try:
        text = time.strftime("%Y-%m-%d %H:%M:%S" if day else "%H:%M:%S",
                             time.localtime(whole))
    except (OverflowError, OSError, ValueError):  # past year 9999
        return f"? ({unix!r})"
    return text if day else f"{text}.{tenth}"


@dataclass(frozen=True)
class PreemptionSave:
    """One save made on a preemption notice (``"preemption"`` in directory.json): where the
    notice came from, when, the deadline it gave, the step saved and when it was durable."""

    source: str
    noticed_unix: float
    step: int
    deadline_unix: float | None = None
    #: None: the save failed
    durable_unix: float | None = None
    expected_persist_s: float | None = None
    #: the expected persist time fitted before the deadline (None: not known)
    fits: bool | None = None

    @classmethod
    def from_json(cls, item: Any) -> PreemptionSave | None:
        """One entry as the writer records it; None for one that is not (tolerant: a
        damaged entry is left out, never an error)."""
        if not isinstance(item, dict):
            return None
        source, step = item.get("source"), item.get("step")
        noticed = _seconds(item.get("noticed_unix"))
        if not isinstance(source, str) or not source or isinstance(step, bool) or \
                not isinstance(step, int) or noticed is None:
            return None
        fits = item.get("fits")
        return cls(source[:40], noticed, step, _seconds(item.get("deadline_unix")),
                   _seconds(item.get("durable_unix")), _seconds(item.get("expected_persist_s")),
                   fits if isinstance(fits, bool) else None)

    @property
    def margin_s(self) -> float | None:
        """Seconds from durable to the deadline (negative: after it); None where either is
        not known."""
        if self.durable_unix is None or self.deadline_unix is None:
            return None
        return self.deadline_unix - self.durable_unix

    def line(self) -> str:
        """What ``pitstop ls`` says of it, in one line."""
        what = self.source if self.source.startswith("SIG") else \
            f"a preemption notice from {self.source}"
        text = f"step {self.step}: saved on {what} (at {_clock(self.noticed_unix, day=True)}), "
        margin = self.margin_s
        if self.durable_unix is None:
            text += "failed: the save did not become durable (see the job's log)"
        elif margin is None:
            text += f"durable at {_clock(self.durable_unix)}, no deadline given"
        elif margin >= 0:
            text += f"durable at {_clock(self.durable_unix)}, {margin:.1f} s before the deadline"
        else:
            text += (f"durable at {_clock(self.durable_unix)}, {-margin:.1f} s after the "
                     f"deadline ({_clock(self.deadline_unix or 0.0)})")
        if self.fits is False:
            expected = f" ({self.expected_persist_s:.1f} s, from earlier saves)" \
                if self.expected_persist_s is not None else ""
            text += (f"; its expected persist time{expected} did not fit before the deadline: "
                     "saved by the fastest path")
        return text


@dataclass(frozen=True)
class DirectoryRecord:
    """What ``.pitstop/directory.json`` holds, read once: ``value`` is its JSON (None when
    there is no such file, or it cannot be read or parsed)."""

    value: Any = None
    #: the file is there (it may still be unreadable or malformed)
    present: bool = False
    #: why it could not be read (None: read, or not there)
    read_error: OSError | None = None
    #: read, but not JSON pitstop writes (a syntax error, a key twice, not UTF-8 ...)
    malformed: bool = False

    @property
    def doc(self) -> dict[str, Any] | None:
        """The record as a JSON object; None when it is none."""
        return self.value if isinstance(self.value, dict) else None

    def naming(self) -> Naming:
        """How the directory names its checkpoints: the default where none is recorded, or
        where the file is unreadable; InvalidArgumentError when it records an invalid one."""
        doc = self.doc
        if doc is None or "naming" not in doc:
            return DEFAULT  # none yet, or written before namings were recorded
        return Naming.from_json(doc["naming"])

    @property
    def retention(self) -> Any:
        """The retention its writer recorded (``"retention"``, see
        :func:`pitstop.core.directory.retention.retention_record`); None: none recorded."""
        doc = self.doc
        return doc.get("retention") if doc is not None else None

    def skipped_line(self) -> str | None:
        """The line ``pitstop ls`` prints for the periodic saves the writer skipped as busy
        (``"skipped"``); None when it records none."""
        return ls_line(self.value)

    def preemption_saves(self) -> list[PreemptionSave]:
        """The saves made on preemption notices (``"preemption"``), oldest first; the
        entries that cannot be read are left out."""
        items = self.doc.get("preemption") if self.doc is not None else None
        if not isinstance(items, list):
            return []
        return [p for p in map(PreemptionSave.from_json, items) if p is not None]

    @property
    def directory_id(self) -> str | None:
        """The id it records (not checked), None when it records none."""
        ident = self.doc.get("directory_id") if self.doc is not None else None
        return ident if isinstance(ident, str) else None

    @property
    def encrypted(self) -> bool:
        """It records that the directory's checkpoints are encrypted."""
        return self.doc is not None and bool(self.doc.get("encryption"))

    def tier_id(self) -> tuple[str | None, str | None]:
        """(the directory's id, None), (None, what is wrong with the file), or (None, None)
        where there is none (nothing was ever written here, so no memory tier either): the
        id names the directory's memory-tier files."""
        if self.read_error is not None:
            return None, f"cannot read it ({self.read_error.strerror})"
        if not self.present:
            return None, None
        if self.malformed:
            return None, "not valid JSON (or a key twice)"
        if self.doc is None:
            return None, f"not a JSON object (found {brief(self.value, 40)})"
        ident = self.doc.get("directory_id")
        if not isinstance(ident, str) or not TIER_ID.fullmatch(ident):
            return None, f"no valid directory_id in it (found {brief(ident, 40)})"
        return ident, None


def read_record(storage: Storage) -> DirectoryRecord:
    """The directory's ``.pitstop/directory.json``, read and parsed once; never raises."""
    try:
        raw = storage.read_meta(IDENTITY)
    except OSError as e:
        return DirectoryRecord(present=True, read_error=e)
    if raw is None:
        return DirectoryRecord()
    try:
        return DirectoryRecord(load_json(raw), present=True)
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        return DirectoryRecord(present=True, malformed=True)


__all__ = ["DirectoryRecord", "PreemptionSave", "read_record", "SHOWN_NOTICES", "TIER_ID"]
