"""The one tolerant reader of ``.pitstop/directory.json`` for those that only look (``pitstop
ls``, ``inspect``, ``verify``, ``gc``): its records (naming, retention, skipped saves,
identity) read from one parse, a damaged file read as "nothing recorded".

A writer reads the identity strictly instead (:func:`pitstop.core.directory.identity.read_identity`).
"""

from __future__ import annotations

import re
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


__all__ = ["DirectoryRecord", "read_record", "TIER_ID"]
