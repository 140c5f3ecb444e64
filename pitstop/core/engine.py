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
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from . import codecs
from .dtypes import encode_dtype, is_inexact
from .errors import CheckpointError, CheckpointWriteError, UnsupportedStateError
from .hashing import new_hasher
from .manifest import ArrayEntry, Manifest, group_pieces, piece_key
from .snapshot import Layout, StagingBuffer, StagingPool
from .storage import Storage
from .tree import ArrayLeaf, FlatState, NumpyLeaf

log = logging.getLogger("pitstop")

#: states at least this big are copied on several threads during the snapshot
PARALLEL_COPY_MIN = 32 << 20
COPY_CHUNK = 16 << 20
HASH_CHUNK = 8 << 20
WRITE_CHUNK = 32 << 20
ALIGN = 4096


#: longest uninterrupted wait on the main thread (see :func:`wait_event`)
SIGNAL_POLL_S = 0.1

#: this process's pid, kept current across forks (os.getpid() is a system call, and the
#: per-step calls check it): what pitstop made belongs to the process that made it
current_pid = [os.getpid()]
os.register_at_fork(after_in_child=lambda: current_pid.__setitem__(0, os.getpid()))


def wait_event(event: threading.Event, timeout: float | None = None) -> bool:
    """``event.wait(timeout)``, in short slices on the main thread.

    Python runs signal handlers only on the main thread, between bytecodes; an untimed lock
    wait is not woken when the kernel delivers the signal to another thread (the persist or
    I/O threads), so a second Ctrl+C / SIGTERM during a save would wait for the save.
    """
    if threading.current_thread() is not threading.main_thread():
        return event.wait(timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = SIGNAL_POLL_S if deadline is None else min(SIGNAL_POLL_S,
                                                          deadline - time.monotonic())
        if left <= 0:
            return event.is_set()
        if event.wait(left):
            return True


class Workers:
    """A few daemon threads running submitted calls; their futures are standard ones.

    A ``ThreadPoolExecutor`` would do, except that interpreter shutdown stops it *before*
    ``atexit`` handlers run, and pitstop's handler must still hash and write the saves a
    script accepted without calling ``close()``.
    """

    def __init__(self, n: int, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]
                                       | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
                         for i in range(max(1, n))]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        f: Future[Any] = Future()
        self._queue.put((f, fn, args))
        return f

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        """``fn`` over ``items``; waits for *every* call before raising the first failure."""
        futures = [self.submit(fn, item) for item in items]
        wait_all(futures)
        return [f.result() for f in futures]

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            f, fn, args = item
            if not f.set_running_or_notify_cancel():
                continue
            try:
                f.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on it
                f.set_exception(e)
            del item, f, fn, args

    def owns(self, thread: threading.Thread) -> bool:
        return thread in self._threads

    def shutdown(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()


@dataclass
class SaveStats:
    """Figures of one save. Times are seconds; ``stall_s`` is what the caller waited."""

    step: int
    bytes: int = 0
    arrays: int = 0
    stall_s: float = 0.0
    persist_s: float = 0.0
    total_s: float = 0.0
    #: parts of persist_s: hashing, writing data files (with fsync), manifest + publish
    hash_s: float = 0.0
    write_s: float = 0.0
    commit_s: float = 0.0
    committed: bool = False
    skipped: str | None = None
    path: str | None = None

    @property
    def throughput(self) -> float:
        """Bytes per second of the background persist (hash, write, fsync, commit)."""
        return self.bytes / self.persist_s if self.persist_s > 0 else 0.0


class SaveHandle:
    """What ``save`` returns: "snapshot taken" as soon as it returns, "committed" later."""

    def __init__(self, step: int, stats: SaveStats) -> None:
        self.step = step
        self.stats = stats
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._owner_pid = current_pid[0]

    @property
    def snapshot_taken(self) -> bool:
        return self.stats.skipped is None

    @property
    def committed(self) -> bool:
        return self.stats.committed

    def done(self) -> bool:
        """True once the save has committed, failed or been skipped."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the commit; raises the save's error. Returns False on timeout."""
        timeout = check_timeout(timeout)
        if current_pid[0] != self._owner_pid and not self._event.is_set():
            raise CheckpointError(
                f"the save of step {self.step} belongs to process {self._owner_pid}; its "
                f"outcome cannot be waited for in the forked process {current_pid[0]}")
        if not wait_event(self._event, timeout):
            return False
        if self._error is not None:
            self._error.delivered = True  # type: ignore[attr-defined]
            raise self._error
        return True

    def result(self, timeout: float | None = None) -> SaveStats:
        """Wait for the commit and return the save's figures."""
        if not self.wait(timeout):
            raise TimeoutError(f"save of step {self.step} did not commit within {timeout} s")
        return self.stats

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._event.set()

    def __repr__(self) -> str:
        state = ("failed" if self._error else "committed" if self.committed else
                 f"skipped ({self.stats.skipped})" if self.stats.skipped else "persisting")
        return f"<SaveHandle step={self.step} {state}>"


@dataclass
class PersistJob:
    step: int
    buffer: StagingBuffer
    #: value leaves, already encoded for the manifest (see FlatState.encoded)
    values: dict[str, Any]
    structure: Any
    metrics: dict[str, Any]
    handle: SaveHandle
    user_metadata: dict[str, Any] = field(default_factory=dict)
    #: hashes already known (a memory-tier snapshot being finished after a restart)
    hashes: dict[str, str] | None = None
    check_finite: bool = False
    t_start: float = 0.0
    #: False for a recovered memory-tier buffer that restore() still has to read
    release_buffer: bool = True
    #: when save() was called (the manifest's created_unix; kept by the memory tier)
    created_unix: float = field(default_factory=time.time)


class Engine:
    """Snapshots on the caller's thread, persists on a background thread."""

    def __init__(self, storage: Storage, *, hash_algorithm: str, compression: str | None,
                 writer_threads: int, pool: StagingPool, directory_id: str,
                 on_commit: Callable[[Manifest, str, SaveStats], None],
                 tier: Any = None, name_of: Callable[[int], str],
                 copy_threads: int | None = None) -> None:
        self.storage = storage
        self.hash_algorithm = hash_algorithm
        self.compression = compression
        self.writer_threads = max(1, writer_threads)
        self.pool = pool
        self.directory_id = directory_id
        self.on_commit = on_commit
        self.tier = tier
        self.name_of = name_of
        self.hooks: dict[str, Callable[..., Any]] = {}
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
        self._thread.start()

    # ------------------------------------------------------------------ caller's thread
    def snapshot(self, flat: FlatState, step: int, block: bool) -> StagingBuffer | None:
        """Copy every array of ``flat`` into a staging buffer; None when none is free and
        ``block`` is False. This is the whole stall of an asynchronous save."""
        arrays = flat.arrays if not flat.sharded else pieces_of(flat)
        sig = [(k, leaf.shape, leaf.dtype) for k, leaf in arrays.items()]
        if sig == self._last_sig and self._last_layout is not None:
            layout = self._last_layout  # same keys, shapes, dtypes: reuse, allocate nothing
        else:
            layout = Layout.of(arrays, self.writer_threads)
            self._last_sig, self._last_layout = sig, layout
        buf = self.pool.acquire(layout, block)
        if buf is None:
            return None
        key = None
        try:
            if self.tier is not None and buf.shm_path is not None:
                self.tier.invalidate(buf)
            fences = []
            if buf.layout.total >= PARALLEL_COPY_MIN and self.copy_threads > 1:
                self._copy_parallel(arrays, buf)
            else:
                for key, leaf, view in zip(arrays, arrays.values(), buf.view_list,  # noqa: B007
                                           strict=True):
                    leaf.snapshot_into(view)
                key = None
            for leaf in arrays.values():
                fence = leaf.snapshot_fence
                if fence is not None and fence not in fences:
                    fences.append(fence)
            for fence in fences:
                fence()
        except UnsupportedStateError as e:
            self.pool.release(buf)
            if key is None or str(e).startswith("state entry "):
                raise
            raise UnsupportedStateError(f"state entry {key!r}: {e}") from e
        except CheckpointError:
            self.pool.release(buf)
            raise
        except Exception as e:
            self.pool.release(buf)
            where = f" of {key!r}" if key is not None else ""
            raise CheckpointError(
                f"the snapshot{where} for step {step} failed: {type(e).__name__}: {e}. Nothing "
                "was saved; committed checkpoints are intact.") from e
        except BaseException:
            self.pool.release(buf)
            raise
        buf.step = step
        return buf

    def _copy_parallel(self, arrays: dict[str, Any], buf: StagingBuffer) -> None:
        """The snapshot copy on ``copy_threads`` threads (this one included): large contiguous
        numpy arrays are cut into chunks, everything else is copied whole. numpy and the
        frameworks release the GIL while copying, so the stall drops below one memcpy."""
        tasks: list[tuple[int, Callable[[], None]]] = []
        for leaf, view in zip(arrays.values(), buf.view_list, strict=True):
            src = getattr(leaf, "array", None)
            if (type(leaf) is NumpyLeaf and leaf.nbytes > COPY_CHUNK and src is not None
                    and src.flags.c_contiguous and src.dtype == view.dtype):
                flat_src, flat_dst = src.reshape(-1), view.reshape(-1)
                n = max(1, COPY_CHUNK // src.dtype.itemsize)
                for a in range(0, flat_src.size, n):
                    tasks.append((n * src.dtype.itemsize, partial(
                        np.copyto, flat_dst[a:a + n], flat_src[a:a + n])))
            else:
                tasks.append((leaf.nbytes, partial(leaf.snapshot_into, view)))
        k = self.copy_threads
        buckets: list[list[Callable[[], None]]] = [[] for _ in range(k)]
        loads = [0] * k
        for size, task in sorted(tasks, key=lambda t: -t[0]):
            i = loads.index(min(loads))
            buckets[i].append(task)
            loads[i] += size

        def run(bucket: list[Callable[[], None]]) -> None:
            for task in bucket:
                task()

        futures = [self._copier.submit(run, b) for b in buckets[1:]]
        try:
            run(buckets[0])
        finally:
            wait_all(futures)
        for f in futures:
            f.result()

    def submit(self, job: PersistJob) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed; the save was not taken")
        job.t_start = time.perf_counter()
        if self.tier is not None and job.buffer.shm_path is not None and job.hashes is None:
            # the snapshot is complete in shared memory: describe it now, before save()
            # returns, so a SIGKILL from here on loses nothing of it (same host and boot: a
            # crash cannot tear a tmpfs copy that was complete)
            try:
                self.tier.describe(job.buffer, job)
            except OSError as e:  # the tier is an optimisation: the save goes on without it
                log.warning("pitstop: could not describe step %d in the memory tier (%s); "
                            "it is persisted as usual, but a crash before its commit loses "
                            "it", job.step, e)
        with self._lock:
            self._pending.append(job.handle)
        self._queue.put(job)

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

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.drain()
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
            try:
                manifest = self._persist(job, name)
            except BaseException as e:  # noqa: BLE001 - every failure must reach the caller
                err = e if isinstance(e, CheckpointWriteError) else CheckpointWriteError(
                    f"saving step {job.step} to {self.storage.path_of(name)} failed: "
                    f"{type(e).__name__}: {e}. {self._what_is_left()}",
                    step=job.step, path=self.storage.path_of(name))
                if err is not e:
                    err.__cause__ = e
                if not isinstance(e, _Skip):
                    log.error("pitstop: %s", err)
                    with self._lock:
                        self._errors.append(err)
                    error = err
                else:
                    job.handle.stats.skipped = str(e)
                    log.warning("pitstop: step %d not saved: %s", job.step, e)
                    if self.tier is not None and job.buffer.shm_path is not None:
                        # a skipped save must never come back from the memory tier
                        self._tier_call(self.tier.invalidate, job.buffer)
            finally:
                if job.release_buffer:
                    self.pool.release(job.buffer)
            if manifest is not None:
                # index and retention, only ever after the commit. Trouble there is not the
                # save's: the checkpoint is committed (the callback warns and retries later)
                try:
                    self.on_commit(manifest, name, job.handle.stats)
                except BaseException:  # noqa: BLE001
                    log.exception("pitstop: step %d is committed, but bookkeeping after the "
                                  "commit failed", job.step)
            # finish only once the buffer is free again: a caller woken by wait() must find
            # the engine idle (a periodic save right after it is never skipped as "busy")
            job.handle._finish(error)
            del job

    def _persist(self, job: PersistJob, name: str) -> Manifest:
        buf, layout = job.buffer, job.buffer.layout
        hook = self.hooks.get("before_persist")
        if hook is not None:
            hook(job.step)
        t0 = time.perf_counter()
        # 1. hash (and check finiteness) in parallel; byte-balanced groups become the data files
        groups = layout.groups()
        if job.hashes is None:
            parts = self._executor.map(lambda g: self._hash_group(buf, g, job.check_finite),
                                       groups)
            hashes: dict[str, str] = {}
            finite = True
            for h, f in parts:
                hashes.update(h)
                finite &= f
        else:
            hashes = job.hashes
            finite = not job.check_finite or buffer_is_finite(buf)
        if not finite:
            raise _Skip("an array holds NaN or Inf (non-finite guard)")
        t_hashed = time.perf_counter()
        all_finite = True if job.check_finite else None
        # 2. the memory-tier copy is now verifiable: seal it
        if self.tier is not None and buf.shm_path is not None and job.hashes is None:
            self._tier_call(self.tier.seal, buf, job, hashes, self.hash_algorithm)
        hook = self.hooks.get("before_write")
        if hook is not None:
            hook(job.step)
        # 3. write data files in parallel, then the manifest last, then publish atomically
        txn = self.storage.begin(name)
        try:
            t_write = time.perf_counter()
            results = self._map_all(
                lambda ig: self._write_group(txn, buf, ig[0], ig[1], hashes), enumerate(groups))
            t_written = time.perf_counter()
            manifest = Manifest(
                step=job.step, structure=job.structure, hash_algorithm=self.hash_algorithm,
                metrics=job.metrics, directory_id=self.directory_id, created_unix=job.created_unix,
                all_finite=all_finite, user_metadata=job.user_metadata,
                writer={"pitstop": _version(), "host": socket.gethostname(), "pid": os.getpid()},
                values=job.values,
            )
            for fname, length, entries in results:
                if fname is not None:
                    manifest.files[fname] = length
                manifest.arrays.update(entries)
            manifest.arrays = {k: manifest.arrays[k] for k in layout.keys}  # layout order
            if layout.sharded:
                manifest.arrays = group_pieces(manifest.arrays)
            hook = self.hooks.get("before_commit")
            if hook is not None:
                hook(job.step)
            verify = getattr(self.storage, "verify_held", None)
            if verify is not None:
                verify()  # the directory is still the one this writer locked
            txn.commit(manifest.to_bytes())
        except BaseException:
            txn.abort()
            raise
        t1 = time.perf_counter()
        stats = job.handle.stats
        stats.persist_s = t1 - t0
        stats.hash_s = t_hashed - t0
        stats.write_s = t_written - t_write
        stats.commit_s = t1 - t_written
        stats.total_s = t1 - job.t_start + stats.stall_s
        stats.committed = True
        stats.path = txn.location
        if self.tier is not None and buf.shm_path is not None:
            self._tier_call(self.tier.mark_committed, buf)
        log.info("pitstop: committed step %d: %.1f MiB, stall %.3f s, persist %.3f s (%.0f MiB/s)",
                 job.step, stats.bytes / 2**20, stats.stall_s, stats.persist_s,
                 stats.throughput / 2**20)
        return manifest

    def _map_all(self, fn: Callable[[Any], Any], items: Any) -> list[Any]:
        """``fn`` over ``items`` on the I/O threads; waits for *every* call before raising the
        first failure, so an abort never races writers still filling the temporary dir."""
        return self._executor.map(fn, items)

    def _hash_group(self, buf: StagingBuffer, group: list[int], check_finite: bool,
                    raw_hashes: bool = False) -> tuple[dict[str, str], bool]:
        layout = buf.layout
        out: dict[str, str] = {}
        finite = True
        for i in group:
            off, n = layout.offsets[i], layout.nbytes[i]
            raw = buf.buf[off:off + n]
            # the raw bytes' hash: the manifest's when uncompressed (compressed payloads are
            # hashed while writing), and always the memory tier's seal
            if raw_hashes or self.compression in (None, "none") or self.tier is not None:
                out[layout.keys[i]] = hash_chunks(self.hash_algorithm, raw)
            # the non-finite guard holds with or without compression
            if check_finite and finite:
                v = buf.views[layout.keys[i]]
                if is_inexact(v.dtype) and v.size and not np.isfinite(v).all():
                    finite = False
        return out, finite

    def _tier_call(self, fn: Callable[..., Any], *args: Any) -> None:
        """A memory-tier bookkeeping write: the tier is an optimisation, so its failure (a
        full /dev/shm) is a warning, never the save's failure."""
        try:
            fn(*args)
        except OSError as e:
            if not self._tier_warned:
                self._tier_warned = True
                log.warning("pitstop: the memory tier's description could not be written (%s); "
                            "saves go on, but a crash before a commit may lose that save", e)

    def _write_group(self, txn: Any, buf: StagingBuffer, index: int, group: list[int],
                     hashes: dict[str, str]) -> tuple[str | None, int, dict[str, ArrayEntry]]:
        if not group:
            return None, 0, {}
        layout = buf.layout
        fname = f"data-{index:03d}.bin"
        entries: dict[str, ArrayEntry] = {}
        raw = self.compression in (None, "none")
        w = txn.open_write(fname, direct=raw)
        try:
            if raw:
                # the group is one contiguous, page-aligned region of the staging buffer:
                # write it as is (with O_DIRECT where the file system allows: no page-cache
                # copy on the CPU); the region ends on a page boundary, so the file carries
                # a few bytes of padding after its last array
                start = layout.offsets[group[0]]
                end = layout.offsets[group[-1]] + layout.nbytes[group[-1]]
                if getattr(w, "direct", False):
                    end = min(-(-end // ALIGN) * ALIGN, buf.buf.size)
                region = buf.buf[start:end]
                for pos in range(0, end - start, WRITE_CHUNK):
                    w.write(region[pos:pos + WRITE_CHUNK])
                for i in group:
                    k = layout.keys[i]
                    entries[k] = ArrayEntry(
                        dtype=encode_dtype(layout.dtypes[i]), shape=list(layout.shapes[i]),
                        file=fname, offset=layout.offsets[i] - start, length=layout.nbytes[i],
                        hash=hashes[k])
                length = end - start
            else:
                pos = 0
                for i in group:
                    k = layout.keys[i]
                    off, n = layout.offsets[i], layout.nbytes[i]
                    codec = codecs.codec_name(self.compression, layout.dtypes[i].itemsize)
                    payload = codecs.encode(codec, buf.buf[off:off + n])
                    digest = hash_chunks(self.hash_algorithm, payload)
                    w.write(payload)
                    size = payload.nbytes
                    entries[k] = ArrayEntry(
                        dtype=encode_dtype(layout.dtypes[i]), shape=list(layout.shapes[i]),
                        file=fname, offset=pos, length=size, hash=digest, codec=codec)
                    pos += size
                length = pos
        finally:
            w.close()
        return fname, length, entries


class _Skip(CheckpointError):
    """The save was deliberately not committed (non-finite guard)."""


def pieces_of(flat: FlatState) -> dict[str, ArrayLeaf]:
    """``flat.arrays`` with every sharded leaf replaced by its distinct shards (piece keys)."""
    out: dict[str, ArrayLeaf] = {}
    for key, leaf in flat.arrays.items():
        if not leaf.sharded:
            out[key] = leaf
            continue
        for index, piece in leaf.pieces():
            out[piece_key(key, index)] = piece
    return out


def buffer_is_finite(buf: StagingBuffer) -> bool:
    """True when no floating array of ``buf`` holds NaN or Inf."""
    for v in buf.views.values():
        if is_inexact(v.dtype) and v.size and not np.isfinite(v).all():
            return False
    return True


def check_timeout(timeout: Any) -> float | None:
    """A wait's timeout: None (no limit) or a number of seconds."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        from .errors import InvalidArgumentError
        raise InvalidArgumentError(f"timeout must be a number of seconds or None, got "
                                   f"{timeout!r}")
    return float(timeout)


def hash_chunks(algorithm: str, data: Any) -> str:
    """Hash a buffer in chunks so no single call holds the GIL for long."""
    h = new_hasher(algorithm)
    view = memoryview(data).cast("B")
    for pos in range(0, len(view), HASH_CHUNK):
        h.update(view[pos:pos + HASH_CHUNK])
    return str(h.hexdigest())


def _version() -> str:
    from .._version import __version__
    return __version__
