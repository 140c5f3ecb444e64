"""Reading a just-committed checkpoint's data files from the staging buffer they were
written from (a restore right after a save: memory speed, whatever the page cache holds).

The manifest and everything else still come from the storage, and the reader verifies every
array's hash against that manifest as always, so the buffer is only ever a faster copy of
bytes the committed checkpoint vouches for.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class StagedStorage:
    """``storage`` with the data files of checkpoint ``name`` served from ``buf``
    (``files``: data file -> (offset in the buffer, length))."""

    def __init__(self, storage: Any, name: str, buf: np.ndarray,
                 files: dict[str, tuple[int, int]]) -> None:
        self._storage = storage
        self._name = name
        self._buf = buf
        self._files = files

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._storage, attr)

    def open_reader(self, name: str, relpath: str) -> int:
        if name == self._name and relpath in self._files:
            # (the reader then reads through read_into, below)
            raise OSError(f"{relpath} of {name} is read from the staging buffer")
        opener = getattr(self._storage, "open_reader", None)
        if opener is None:  # (object storage) the reader reads through read_into
            raise OSError(f"{self._storage!r} reads through read_into")
        return int(opener(name, relpath))

    def read_into(self, name: str, relpath: str, offset: int, out: Any) -> int:
        where = self._files.get(relpath) if name == self._name else None
        if where is None:
            return int(self._storage.read_into(name, relpath, offset, out))
        base, length = where
        view = memoryview(out).cast("B")
        n = max(0, min(len(view), length - offset))
        view[:n] = self._buf[base + offset:base + offset + n].data
        return n
