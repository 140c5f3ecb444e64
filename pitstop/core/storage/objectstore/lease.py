"""The writer lock of an object-store directory: a lease object renewed by a thread (S3),
or a lock held in this process (memory:// and stores without conditional writes)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
import weakref
from typing import Any

from pitstop.core.errors import DirectoryLockedError
from pitstop.core.runtime.host import boot_id
from pitstop.core.storage.objectstore.ops import LOCK, META_DIR, _Conflict, log
from pitstop.core.storage.objectstore.s3 import _S3Ops

_leases: weakref.WeakSet[_Lease] = weakref.WeakSet()
#: locations locked by this process (memory:// and every store without conditional writes)
_local_locks: dict[str, _Lease] = {}
_local_guard = threading.Lock()
_warned: set[str] = set()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, another user's
    return True


class _Lease:
    """The writer lock of one directory: ``release()`` and ``_forget()`` as LocalStorage's.

    On S3 it is the object ``.pitstop/lock``, renewed by a daemon thread; elsewhere it is
    held in this process (exact for memory://, which no other process can see)."""

    def __init__(self, storage: Any, token: str, etag: str | None,
                 shared: bool) -> None:
        self.storage = storage
        self.key = storage._key(META_DIR, LOCK)
        self.url = storage._ops.url_of(self.key)
        self.token = token
        self.etag = etag
        #: the lock is an object in the store (S3); False: held in this process only
        self.shared = shared
        self.lost: str | None = None
        self.released = False
        self.forgotten = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._since = time.time()
        _leases.add(self)

    def body(self, probe: bool = False) -> bytes:
        doc = {"token": self.token, "host": socket.gethostname(), "pid": os.getpid(),
               "boot_id": boot_id(), "since": self._since, "renewed": time.time(),
               "ttl_s": self.storage.opts.lock_ttl}
        if probe:
            doc["probe"] = True  # differs from what is there: a store that took it ignored
        return json.dumps(doc).encode()

    # ------------------------------------------------------------------ taking it
    @classmethod
    def acquire(cls, storage: Any) -> _Lease:
        if not isinstance(storage._ops, _S3Ops):
            return cls._acquire_local(storage)
        ops = storage._ops
        lease = cls(storage, uuid.uuid4().hex, None, shared=True)
        for _ in range(5):
            try:
                lease.etag = ops.put(lease.key, lease.body(), create_only=True)
            except FileExistsError:
                try:
                    data, etag, age = ops.get_lease(lease.key)
                except FileNotFoundError:
                    continue  # released meanwhile: try again
                why = cls._stale(data, age, storage.opts.lock_ttl)
                if why is None:
                    raise DirectoryLockedError(cls._busy(storage, data, age)) from None
                try:
                    lease.etag = ops.put_if_match(lease.key, lease.body(), etag)
                except _Conflict:
                    continue  # someone else was quicker
                log.warning("pitstop: took over the writer lock of %s: %s", storage.location,
                            why)
            break
        else:
            raise DirectoryLockedError(
                f"checkpoint directory {storage.location}: could not take the writer lock "
                f"({lease.url}); other writers keep taking it. Use one CheckpointManager per "
                "directory, or open it with read_only=True to only restore.")
        if ops.conditional:
            # does this endpoint honour If-None-Match? A second create must be refused
            try:
                again = ops.put(lease.key, lease.body(probe=True), create_only=True)
            except FileExistsError:
                pass
            else:
                lease.etag = again
                ops._no_conditions()
        lease._start()
        return lease

    @classmethod
    def _acquire_local(cls, storage: Any) -> _Lease:
        with _local_guard:
            held = _local_locks.get(storage.location)
            if held is not None and not held.released and not held.forgotten:
                raise DirectoryLockedError(
                    f"checkpoint directory {storage.location} is in use by another writer "
                    f"(this process, pid {os.getpid()}). Use one CheckpointManager per "
                    "directory, or open it with read_only=True to only restore.")
            lease = cls(storage, uuid.uuid4().hex, None, shared=False)
            _local_locks[storage.location] = lease
        if storage.protocol != "memory" and storage.protocol not in _warned:
            _warned.add(storage.protocol)
            log.warning("pitstop: %s:// offers no conditional writes through fsspec, so "
                        "pitstop cannot keep a writer in another process out of %s; use one "
                        "writer per directory", storage.protocol, storage.location)
        return lease

    @staticmethod
    def _stale(data: bytes, age: float | None, ttl: float) -> str | None:
        """Why the lock in ``data`` may be taken over, or None while its holder may live."""
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            doc = None
        if not isinstance(doc, dict):
            doc = {}
        host, pid, boot = doc.get("host"), doc.get("pid"), doc.get("boot_id")
        if host == socket.gethostname() and boot and boot == boot_id() and \
                isinstance(pid, int) and not isinstance(pid, bool):
            if not _pid_alive(pid):
                return f"its holder, pid {pid} on this host, is dead"
            if pid == os.getpid() and not any(
                    lease.token == doc.get("token") and not lease.released and not
                    lease.forgotten for lease in list(_leases)):
                return "its holder was an earlier writer of this process that is gone"
        recorded = doc.get("ttl_s")
        limit = max(float(recorded) if isinstance(recorded, (int, float)) else ttl, 1.0)
        if age is not None and age >= limit:
            return f"not renewed for {age:.0f} s (its holder renews it every {limit / 4:.0f} s)"
        return None

    @staticmethod
    def _busy(storage: Any, data: bytes, age: float | None) -> str:
        try:
            doc = json.loads(data)
            holder = f"pid {doc.get('pid')} on {doc.get('host')}"
            ttl = float(doc.get("ttl_s") or storage.opts.lock_ttl)
        except (ValueError, TypeError, AttributeError, UnicodeDecodeError, RecursionError):
            holder, ttl = "an unknown holder", storage.opts.lock_ttl
        renewed = f", renewed {age:.0f} s ago" if age is not None else ""
        return (f"checkpoint directory {storage.location} is in use by another writer "
                f"({holder}{renewed}). Use one CheckpointManager per directory, or open it "
                "with read_only=True to only restore. If that writer is gone, its lock "
                f"({storage.location}/{META_DIR}/{LOCK}) is taken over at once on its own host, "
                f"and anywhere {ttl:.0f} s after its last renewal.")

    # ------------------------------------------------------------------ holding it
    def _start(self) -> None:
        self._thread = threading.Thread(target=self._renew, name="pitstop-lock", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        ops = self.storage._ops
        interval = self.storage.opts.lock_ttl / 4
        failing = False
        while not self._stop.wait(interval):
            try:
                self.etag = ops.put_if_match(self.key, self.body(), self.etag)
            except _Conflict:
                self.lost = (f"checkpoint directory {self.storage.location}: another writer "
                             f"took over its lock ({self.url}) after this one could not renew "
                             "it in time; nothing more is committed by this manager")
                log.error("pitstop: %s", self.lost)
                return
            except Exception as e:  # noqa: BLE001 - retried; verify() decides at commit
                if not failing:
                    log.warning("pitstop: could not renew the writer lock %s (%s); retrying",
                                self.url, e)
                failing = True
                continue
            if failing:
                log.info("pitstop: renewed the writer lock %s again", self.url)
            failing = False

    def verify(self) -> None:
        """Raise DirectoryLockedError unless the store still names this writer the holder."""
        if self.released or self.forgotten or not self.shared:
            return
        if self.lost is not None:
            raise DirectoryLockedError(self.lost)
        try:
            data = self.storage._ops.get(self.key)
        except FileNotFoundError:
            raise DirectoryLockedError(
                f"checkpoint directory {self.storage.location}: its lock {self.url} was "
                "deleted while this writer held it; nothing more is committed by this "
                "manager") from None
        try:
            token = json.loads(data).get("token")
        except (ValueError, AttributeError, UnicodeDecodeError, RecursionError):
            token = None
        if token != self.token:
            self.lost = (f"checkpoint directory {self.storage.location}: another writer holds "
                         f"its lock now ({self.url}); nothing more is committed by this "
                         "manager, so it cannot mix with that writer's checkpoints")
            raise DirectoryLockedError(self.lost)

    def release(self) -> None:
        """Stop renewing and delete the lock object if it is still this writer's."""
        if self.released or self.forgotten:
            return
        self.released = True
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)  # a renewal under way; it cannot take the lock back
        if not self.shared:
            with _local_guard:
                if _local_locks.get(self.storage.location) is self:
                    del _local_locks[self.storage.location]
            return
        if self.lost is None:
            try:
                self.storage._ops.delete_if_match(self.key, self.etag)
            except _Conflict:
                pass  # another writer's now
            except Exception as e:  # noqa: BLE001 - it expires by itself
                log.warning("pitstop: could not release the writer lock %s (%s); it expires "
                            "%.0f s after its last renewal", self.url, e,
                            self.storage.opts.lock_ttl)

    def _forget(self) -> None:
        # in a forked child: the lock is the parent's; never renew or delete it from here
        self.forgotten = True


def _after_fork_in_child() -> None:
    for lease in list(_leases):
        lease._forget()


os.register_at_fork(after_in_child=_after_fork_in_child)
