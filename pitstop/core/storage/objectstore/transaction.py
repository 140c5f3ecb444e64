"""One save on an object store: marker first, data objects create-only, manifest last."""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from typing import Any

from pitstop.core.directory.names import tmp_name
from pitstop.core.errors import StepExistsError
from pitstop.core.storage.base import Transaction, Writer
from pitstop.core.storage.objectstore.ops import MANIFEST, _check_segment, log


class _ObjectTransaction(Transaction):
    """One save: marker first, data objects create-only, manifest last (the commit)."""

    def __init__(self, storage: Any, name: str, joined: str | None = None) -> None:
        _check_segment(name, "checkpoint name")
        self.storage = storage
        self.name = name
        #: another rank's part of the leader's save (the leader's token); None: the leader's
        self.joined = joined
        self.location = storage.path_of(name)
        self.tag = uuid.uuid4().hex[:8]
        self.marker = tmp_name(name, self.tag)
        self.files: list[str] = []
        #: key -> etag of every object this save created (abort deletes exactly these)
        self.created: dict[str, str | None] = {}
        self._lock = threading.Lock()
        self.committed = False
        self.commit_tried = False
        self.manifest = b""
        self.token = self.tag
        ops = storage._ops
        storage._clean_orphans(name)
        if joined is None and ops.exists(storage._key(name, MANIFEST)):
            raise StepExistsError(
                f"{self.location} already exists (committed by another save of the same "
                "step); pitstop never overwrites a committed checkpoint")
        storage._write_marker(self.marker, {"op": "save", "name": name, "files": [],
                                            "host": socket.gethostname(), "pid": os.getpid(),
                                            "started_unix": time.time()})

    def open_write(self, relpath: str, direct: bool = False) -> Writer:
        key = self.storage._safe(self.name, relpath)
        with self.storage._gen_lock:
            self.storage._writing.add(key)
        with self._lock:
            self.files.append(relpath)
            # recorded before a byte of it is written: cleanup then knows it is ours
            self.storage._write_marker(self.marker, {"op": "save", "name": self.name,
                                                     "files": sorted(self.files)})
        return self.storage._ops.open_writer(key, True, self._created)

    def _settled(self) -> None:
        """This save writes nothing more: its keys are no longer this writer's uploads."""
        keys = {self.storage._key(self.name, f) for f in self.files}
        with self.storage._gen_lock:
            self.storage._writing -= keys

    def _created(self, key: str, etag: str | None) -> None:
        with self._lock:
            self.created[key] = etag

    def done(self) -> None:
        """Another rank's part, after the leader committed: its marker goes (its objects
        belong to the committed checkpoint now)."""
        self._settled()
        try:
            self.storage._ops.delete([self.storage._key(self.marker)])
        except OSError as e:  # cleanup removes a marker of a committed checkpoint later
            log.debug("pitstop: the marker %s stays (%s)", self.marker, e)

    def commit(self, manifest: bytes) -> None:
        if self.joined is not None:
            raise RuntimeError("only the leader's transaction commits")
        storage = self.storage
        key = storage._key(self.name, MANIFEST)
        self.manifest = bytes(manifest)
        self.commit_tried = True
        try:
            storage._ops.put(key, self.manifest, create_only=True)
        except FileExistsError:
            raise StepExistsError(
                f"{self.location} already exists (committed by another save of the same "
                "step meanwhile); pitstop never overwrites a committed checkpoint") from None
        self.committed = True
        self._settled()
        storage._bump(self.name)
        try:
            storage._ops.delete([storage._key(self.marker)])
        except OSError as e:  # committed all the same: cleanup removes the marker later
            log.debug("pitstop: %s committed, its marker stays (%s)", self.location, e)

    def abort(self) -> None:
        """Remove what this save wrote; never raises (what it cannot remove stays with its
        marker, for the next cleanup)."""
        if self.committed:
            return
        self._settled()
        storage, ops = self.storage, self.storage._ops
        try:
            if self.commit_tried:
                mkey = storage._key(self.name, MANIFEST)
                try:
                    now = ops.get(mkey)
                except FileNotFoundError:
                    now = None
                if now is not None and now != self.manifest:
                    return  # another writer's checkpoint: nothing here is ours to touch
                if now is not None:
                    try:
                        ops.delete([mkey])  # it landed after all: un-commit before data goes
                    except Exception:  # noqa: BLE001
                        # then it stays committed, whole (its data was complete)
                        log.warning("pitstop: %s was committed after all (its manifest "
                                    "landed though the request failed); it stays",
                                    self.location)
                        ops.delete([storage._key(self.marker)])
                        return
            storage._bump(self.name)
            if ops.conditional:
                doomed = sorted(self.created)  # created-only: these and no others are ours
            else:
                doomed = [storage._key(self.name, f) for f in self.files]
            ops.delete(doomed)
            ops.delete([storage._key(self.marker)])
        except Exception as e:  # noqa: BLE001 - the marker stays: cleanup finishes it
            storage._orphans.add((self.marker, self.name))
            log.warning("pitstop: could not remove the objects of the failed save %s (%s: %s); "
                        "the next save of this step, the next writer on this directory or "
                        "`pitstop gc` removes them", self.location, type(e).__name__, e)
