"""The asynchronous snapshot -> persist -> commit pipeline.

The training thread pays only for :meth:`Engine.snapshot` (a copy into a reusable staging
buffer). One background thread takes snapshots in order and persists each: hash every array
(in parallel, releasing the GIL), seal the memory-tier copy, write the data files in large
sequential chunks on ``writer_threads`` threads, fsync, write the manifest last, publish
atomically, then run the ``on_commit`` callback (index, retention). Failures are logged at
once and reach the caller exactly once: through the save's handle (``wait``/``result``), or,
if nobody waited on it, at the manager's next call that saves or waits.

The engine's threads are its own daemon threads (:class:`Workers`), not a
``ThreadPoolExecutor``: at interpreter exit the executors refuse new work before ``atexit``
runs, and pitstop commits the saves it accepted from ``atexit`` (see the manager).

This module holds the engine's lifecycle (queue, persist thread, errors, close); its parts
live beside it: the snapshot copy in :mod:`~pitstop.core.save.copying`, the persist stages in
:mod:`~pitstop.core.save.persist` (data files: :mod:`~pitstop.core.save.writing`, incremental
references: :mod:`~pitstop.core.save.incremental`, multi-rank: :mod:`~pitstop.core.save.world`).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from pitstop.core.errors import CheckpointError, CheckpointWriteError
from pitstop.core.format.schema import Manifest
from pitstop.core.runtime.coordination import CoordinationError, Coordinator
from pitstop.core.save.copying import FAST_HASHES, Snapshots
from pitstop.core.save.handles import SaveHandle, SaveStats
from pitstop.core.save.incremental import Previous
from pitstop.core.save.lazy import LazyCopy
from pitstop.core.save.persist import PersistJob, SaveSkipped
from pitstop.core.save.snapshot import Layout, StagingBuffer, StagingPool
from pitstop.core.save.threads import Workers, wait_event
from pitstop.core.save.world import WorldPersist
from pitstop.core.storage import Storage

log = logging.getLogger("pitstop")

#: CPU seconds per GiB that reading a checkpoint back into the page cache costs the process:
#: the read-back (POSIX_FADV_WILLNEED allocates the pages: 0.18-0.29 s) and their release
#: when retention deletes the checkpoint (0.13-0.20 s), measured on a 2-core VM, ext4
WARM_CPU_S_PER_GIB = 0.35
#: the share of the time between saves that warming each one at commit may cost
WARM_SHARE = 0.01


def warm_gap_s(nbytes: int) -> float:
    """How far apart saves must be for each to be read back into the page cache at commit
    at no more than WARM_SHARE of the time between them (1 GiB: 35 s)."""
    return WARM_CPU_S_PER_GIB * nbytes / 2**30 / WARM_SHARE


class Engine(WorldPersist, Snapshots):
    """Snapshots on the caller's thread, persists on a background thread."""

    def __init__(self, storage: Storage, *, hash_algorithm: str, compression: str | None,
                 writer_threads: int, pool: StagingPool, directory_id: str,
                 on_commit: Callable[[Manifest, str, SaveStats], list[int] | None],
                 tier: Any = None, name_of: Callable[[int], str],
                 copy_threads: int | None = None, coordinator: Coordinator | None = None,
                 encryption: Any = None, incremental: bool = False,
                 lazy: bool = False, hash_in_copy: bool = False) -> None:
        self.storage = storage
        #: incremental checkpoints: arrays unchanged since this engine's last commit are
        #: referenced, not written (the manager turns it off for multi-rank and encrypted saves)
        self.incremental = incremental and coordinator is None and encryption is None
        #: what the last commit holds, for incremental saves (None: nothing known yet)
        self._previous: Previous | None = None
        #: a :class:`~pitstop.core.format.crypto.Encryption`: every data file and manifest encrypted
        self.encryption = encryption
        #: the ``seq`` of the last encrypted save in the directory (set by the manager from
        #: its checkpoints): each save records the next, so a checkpoint of an abandoned run
        #: put back in place is told apart from one saved after it (docs/encryption.md)
        self.last_seq = 0
        self._seq_lock = threading.Lock()
        #: the ranks this engine saves with (None: one process)
        self.coordinator = coordinator
        self.hash_algorithm = hash_algorithm
        self.compression = compression
        #: asked for, and the raw bytes' hashes are wanted (plain files, the memory tier's
        #: seal, incremental comparisons, several ranks): large host arrays are hashed in the
        #: snapshot copy (a longer stall for less background work, see docs/performance.md)
        self.hash_in_copy = hash_in_copy and hash_algorithm in FAST_HASHES and (
            coordinator is not None or tier is not None or self.incremental
            or (compression in (None, "none") and encryption is None))
        self.writer_threads = max(1, writer_threads)
        self.pool = pool
        self.directory_id = directory_id
        self.on_commit = on_commit
        #: another rank than the leader: drops a step the leader's retention deleted from
        #: this rank's index (set by the manager)
        self.forget_step: Callable[[int], None] | None = None
        self.tier = tier
        self.name_of = name_of
        #: test hooks, each called with the step on the thread doing that part:
        #: before_snapshot (buffer acquired, nothing copied), before_persist, before_write,
        #: before_commit, after_commit (one-process saves); the catalog's before_delete
        #: before_lazy_copy (on a copy thread, before a lazy copy starts), lazy_fence (on the
        #: fencing thread, when a fence finds the copy unfinished)
        self.hooks: dict[str, Callable[..., Any]] = {}
        #: snapshot="lazy": copy the leaves adapters mark ``lazy_safe`` after save() returns
        self.lazy = lazy
        #: lazy copies started by snapshot() and not yet submitted, by id of their buffer
        self._deferred: dict[int, LazyCopy] = {}
        self._last_sig: list[Any] | None = None
        self._last_layout: Layout | None = None
        #: background failures nobody has been told of yet, oldest first
        self._errors: list[CheckpointWriteError] = []
        self._queue: queue.Queue[PersistJob | None] = queue.Queue()
        self._pending: list[SaveHandle] = []
        self._lock = threading.Lock()
        self._executor = Workers(self.writer_threads, "pitstop-io")
        # the snapshot's own helpers: never queued behind a persist's hashing or writing
        self.copy_threads = max(1, copy_threads if copy_threads is not None
                                else min(4, os.cpu_count() or 1))
        self._copier = Workers(max(1, self.copy_threads - 1), "pitstop-copy")
        self._thread = threading.Thread(target=self._run, name="pitstop-persist", daemon=True)
        self._closed = False
        self._tier_warned = False
        #: the newest one-process checkpoint written plainly from a staging buffer: (name,
        #: buffer, the buffer's generation then, {data file: (offset in buffer, length)})
        self.staged: tuple[str, StagingBuffer, int, dict[str, tuple[int, int, Any]]] | None = \
            None
        #: read the newest checkpoint back into the page cache (see :meth:`warm_newest`)
        self.warm_cache = True
        #: the newest committed checkpoint not yet warmed (name, data files)
        self._unwarmed: tuple[str, list[str]] | None = None
        #: when the last save was submitted
        self._last_submit = math.inf
        self._thread.start()


    def submit(self, job: PersistJob) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed; the save was not taken")
        job.t_start = time.perf_counter()
        job.gap_s, self._last_submit = job.t_start - self._last_submit, job.t_start
        if job.buffer is not None and job.lazy is None:
            job.lazy = self._deferred.pop(id(job.buffer), None)
        if job.lazy is not None:
            job.lazy.stats = job.handle.stats
            job.handle.stats.lazy_bytes = job.lazy.nbytes
            if job.lazy.done.is_set():
                job.handle.stats.lazy_copy_s = job.lazy.copy_s
        if job.fast and self.tier is not None and job.buffer is not None and \
                job.buffer.shm_path is not None:
            # the fastest path skips the tier: no older description of this buffer may stay
            self._tier_call(self.tier.invalidate, job.buffer)
        elif self.tier is not None and job.buffer is not None and job.lazy is None and \
                job.buffer.shm_path is not None and job.hashes is None:
            # the snapshot is complete in shared memory: describe it now, before save()
            # returns, so a SIGKILL from here on loses nothing of it (same host and boot: a
            # crash cannot tear a tmpfs copy that was complete)
            try:
                self.tier.describe(job.buffer, job)
            except OSError as e:  # the tier is an optimisation: the save goes on without it
                self._tier_trouble(e, f"description of step {job.step} could not be written")
        with self._lock:
            self._pending.append(job.handle)
        self._queue.put(job)
        if job.lazy is not None and job.hashes is None:
            job.lazy.launch(self._copier.submit, self.copy_threads - 1 or 1)

    def in_flight(self) -> int:
        with self._lock:
            self._pending = [h for h in self._pending if not h.done()]
            return len(self._pending)

    def on_own_thread(self) -> bool:
        """True on one of the engine's threads (where waiting for its saves would wait for
        oneself: e.g. a finalizer the garbage collector happens to run there)."""
        me = threading.current_thread()
        return me is self._thread or self._executor.owns(me) or self._copier.owns(me)

    def pending_steps(self) -> set[int]:
        """Steps submitted and not yet finished (committed, failed or skipped)."""
        with self._lock:
            self._pending = [h for h in self._pending if not h.done()]
            return {h.step for h in self._pending}

    def hash_all(self, buf: StagingBuffer) -> dict[str, str]:
        """Every array's hash in ``buf``, groups in parallel (a recovered, unsealed snapshot)."""
        hashes: dict[str, str] = {}
        for h, _finite in self._executor.map(lambda g: self._hash_group(buf, g, False, True),
                                             buf.layout.groups()):
            hashes.update(h)
        return hashes

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every submitted save has committed or failed."""
        with self._lock:
            handles = list(self._pending)
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            wait_event(h._event, left)

    @property
    def error(self) -> CheckpointWriteError | None:
        """The oldest background failure not yet reported to the caller."""
        with self._lock:
            self._errors = [e for e in self._errors if not getattr(e, "delivered", False)]
            return self._errors[0] if self._errors else None

    def raise_pending(self) -> None:
        """Raise the background failures nobody was told of yet (each reaches the caller
        once: a failure already raised by its handle's ``wait`` is not raised again)."""
        if not self._errors:  # the per-step fast path: no lock, no allocation
            return
        with self._lock:
            errors = [e for e in self._errors if not getattr(e, "delivered", False)]
            self._errors = []
            for e in errors:
                e.delivered = True  # type: ignore[attr-defined]
        if not errors:
            return
        first = errors[0]
        if len(errors) > 1:
            later = ", ".join(str(e.step) for e in errors[1:])
            note = getattr(first, "add_note", None)
            if note is not None:  # Python 3.11+
                note(f"pitstop: the saves of step(s) {later} failed too (see the log)")
        raise first

    def warm_newest(self) -> None:
        """Ask the storage to read the newest committed checkpoint back into the page cache.

        Data files are written with O_DIRECT (no CPU copy into the page cache while training
        runs), so without this the commonest restart of all (Ctrl+C, fix, run again on the
        same machine) would read from disk, where ``torch.load`` of a file written a minute
        ago reads from memory. Best effort: the kernel reads in the background."""
        newest, self._unwarmed = self._unwarmed, None
        warm = getattr(self.storage, "warm_cache", None)
        if newest is None or warm is None or not self.warm_cache:
            return
        try:
            warm(*newest)
        except Exception:  # noqa: BLE001 - an optimisation: never the save's error
            log.debug("pitstop: page-cache warm-up of %s failed", newest[0], exc_info=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.drain()
        self.warm_newest()
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._executor.shutdown()
        self._copier.shutdown()

    # ------------------------------------------------------------------ background
    def _what_is_left(self) -> str:
        """The end of a failed save's message: what the user still has."""
        location = getattr(self.storage, "location", "")
        if location and "://" not in location and not os.path.isdir(location):
            return (f"The checkpoint directory {location} no longer exists (deleted or moved "
                    "while this manager had it open), so nothing more can be committed there; "
                    "open a new CheckpointManager to start a run directory again.")
        return "Committed checkpoints are intact."

    # ------------------------------------------------------------------ background
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            name = self.name_of(job.step)
            error: BaseException | None = None
            manifest = None
            t_job = job.t_start
            try:
                if self.coordinator is not None:
                    manifest = self._persist_world(job, name, self.coordinator)
                else:
                    manifest = self._persist(job, name)
            except BaseException as e:  # noqa: BLE001 - every failure must reach the caller
                err = e if isinstance(e, CheckpointWriteError) else CheckpointWriteError(
                    f"{e}. The step is not committed; committed checkpoints are intact."
                    if isinstance(e, CoordinationError) else
                    f"saving step {job.step} to {self.storage.path_of(name)} failed: "
                    f"{type(e).__name__}: {e}. {self._what_is_left()}",
                    step=job.step, path=self.storage.path_of(name))
                if err is not e:
                    err.__cause__ = e
                if job.failed is not None:
                    # this rank's snapshot failed: its caller has that error already; the
                    # other ranks were told
                    log.info("pitstop: step %d: the other ranks were told that this rank's "
                             "snapshot failed", job.step)
                elif not isinstance(e, SaveSkipped):
                    log.error("pitstop: %s", err)
                    with self._lock:
                        self._errors.append(err)
                    error = err
                else:
                    job.handle.stats.skipped = str(e)
                    log.warning("pitstop: step %d not saved: %s", job.step, e)
                    if self.tier is not None and job.buffer is not None and \
                            job.buffer.shm_path is not None:
                        # a skipped save must never come back from the memory tier
                        self._tier_call(self.tier.invalidate, job.buffer)
            finally:
                if job.lazy is not None:
                    job.lazy.done.wait()  # never hand out a buffer a copy still writes
                    job.lazy.retire()
                if job.release_buffer and job.buffer is not None:
                    self.pool.release(job.buffer)
            if manifest is not None and not job.bookkept:
                self._bookkeep(job, manifest, name)
            # finish only once the buffer is free again: a caller woken by wait() must find
            # the engine idle (a periodic save right after it is never skipped as "busy")
            job.handle._finish(error)
            gap_s = job.gap_s
            del job
            if manifest is not None:
                self._unwarmed = (name, list(manifest.files))
                # only saves far apart are warmed at commit (close() warms the last one): the
                # read-back and the release of those pages when retention deletes the
                # checkpoint cost the training CPU, and back to back the read-back slows the
                # next save's writes
                size = sum(manifest.files.values())
                if self._queue.empty() and gap_s > max(4 * (time.perf_counter() - t_job),
                                                       warm_gap_s(size)):
                    self.warm_newest()


    def hold_staged(self, name: str) -> tuple[StagingBuffer, dict[str, tuple[int, int]]] | None:
        """The staging buffer that checkpoint ``name`` was written from, held for reading
        (give it back with ``pool.release``), when no save has taken it since; else None.
        Values: per data file, its offset in the buffer and its length."""
        staged = self.staged
        if staged is None or staged[0] != name:
            return None
        stamp = getattr(self.storage, "file_stamp", None)
        try:
            # the files as they were written: one changed since (replaced, edited, damaged
            # by hand) is read from disk, so the restore finds out what it holds
            if stamp is None or any(stamp(name, f) != v[2] for f, v in staged[3].items()):
                return None
        except OSError:
            return None
        if not self.pool.hold(staged[1], staged[2]):
            return None
        return staged[1], {f: (v[0], v[1]) for f, v in staged[3].items()}

