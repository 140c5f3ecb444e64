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
import math
import os
import queue
import secrets
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

from pitstop.core.errors import CheckpointError, CheckpointWriteError, UnsupportedStateError
from pitstop.core.format import codecs
from pitstop.core.format.dtypes import encode_dtype, is_inexact
from pitstop.core.format.hashing import new_hasher
from pitstop.core.format.schema import (
    SHARD_MARK,
    ArrayEntry,
    Manifest,
    RankView,
    group_pieces,
    piece_key,
)
from pitstop.core.format.validate import parse
from pitstop.core.runtime.coordination import CoordinationError, Coordinator, Holding, plan
from pitstop.core.save.lazy import LAZY_MIN_BYTES, LazyCopy, LazyVersionError
from pitstop.core.save.snapshot import Layout, StagingBuffer, StagingPool
from pitstop.core.storage import Storage
from pitstop.core.tree import ArrayLeaf, FlatState, NumpyLeaf

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
    #: bytes of arrays unchanged since the previous save, referenced instead of written
    #: (incremental checkpoints)
    reused_bytes: int = 0
    #: snapshot="lazy": bytes copied in the background after save() returned, how long that
    #: copy took from save(), and how long fences (the next optimizer step, the manager's
    #: next call, a fork) waited for it on the caller's thread
    lazy_bytes: int = 0
    lazy_copy_s: float = 0.0
    fence_wait_s: float = 0.0
    committed: bool = False
    skipped: str | None = None
    #: periodic saves this manager skipped since its previous snapshot because that one was
    #: still persisting (``on_busy="skip"``): the steps this save is the first after
    skipped_before: int = 0
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
    buffer: StagingBuffer | None
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
    #: global shape of each sharded array of this rank's state (multi-rank saves check
    #: that the ranks' shards cover them)
    global_shapes: dict[str, list[int]] = field(default_factory=dict)
    #: the metrics were not finite (non-finite guard): a multi-rank save skips on every rank
    nonfinite_metrics: bool = False
    #: this rank's snapshot failed (no buffer): its part of a multi-rank save only says so
    failed: str | None = None
    #: seconds since the save before it was submitted (negative: the first of this engine)
    gap_s: float = -1.0
    #: snapshot="lazy": the part of the copy still running on the copy threads (the persist
    #: waits for it before hashing; the memory tier describes the buffer only then)
    lazy: LazyCopy | None = None
    #: the frameworks (name -> version) whose adapters captured the state, numpy included:
    #: the manifest's writer["frameworks"] (empty: not known; a recovered snapshot's are
    #: those its memory-tier description recorded)
    frameworks: dict[str, str] = field(default_factory=dict)
    #: a multi-rank save whose leader ran ``on_commit`` (index, retention) before it told
    #: the other ranks of the commit: their ``wait()`` then lists the directory as retention
    #: left it, as the leader's does
    bookkept: bool = False
    #: the manifest's ``layouts`` (array key -> the framework's layout of it)
    layouts: dict[str, Any] = field(default_factory=dict)


class Engine:
    """Snapshots on the caller's thread, persists on a background thread."""

    def __init__(self, storage: Storage, *, hash_algorithm: str, compression: str | None,
                 writer_threads: int, pool: StagingPool, directory_id: str,
                 on_commit: Callable[[Manifest, str, SaveStats], list[int] | None],
                 tier: Any = None, name_of: Callable[[int], str],
                 copy_threads: int | None = None, coordinator: Coordinator | None = None,
                 encryption: Any = None, incremental: bool = False,
                 lazy: bool = False) -> None:
        self.storage = storage
        #: incremental checkpoints: arrays unchanged since this engine's last commit are
        #: referenced, not written (the manager turns it off for multi-rank and encrypted saves)
        self.incremental = incremental and coordinator is None and encryption is None
        #: what the last commit holds, for incremental saves (None: nothing known yet)
        self._previous: _Previous | None = None
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

    # ------------------------------------------------------------------ caller's thread
    def snapshot(self, flat: FlatState, step: int, block: bool) -> StagingBuffer | None:
        """Copy every array of ``flat`` into a staging buffer; None when none is free and
        ``block`` is False. This is the whole stall of an asynchronous save."""
        arrays = flat.arrays if not flat.sharded else pieces_of(flat, self.coordinator is None)
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
            hook = self.hooks.get("before_snapshot")
            if hook is not None:
                hook(step)
            if self.tier is not None and buf.shm_path is not None:
                self.tier.invalidate(buf)
            fences = []
            deferred: list[tuple[str, ArrayLeaf, np.ndarray]] = []
            if self.lazy:
                # copied now: what the next forward pass may write (buffers), numpy arrays,
                # small arrays; the rest after save() returns (see pitstop.core.save.lazy)
                eager: list[tuple[str, ArrayLeaf, np.ndarray]] = []
                for k, leaf, view in zip(arrays, arrays.values(), buf.view_list, strict=True):
                    later = leaf.lazy_safe and leaf.lazy_guard is not None and \
                        leaf.nbytes >= LAZY_MIN_BYTES
                    (deferred if later else eager).append((k, leaf, view))
                leaves: Iterable[ArrayLeaf] = [leaf for _k, leaf, _v in eager]
                views: Iterable[np.ndarray] = [v for _k, _leaf, v in eager]
                keys: Iterable[str] = [k for k, _leaf, _v in eager]
                now = sum(leaf.nbytes for _k, leaf, _v in eager)
            else:
                leaves, views, keys = arrays.values(), buf.view_list, arrays
                now = buf.layout.total
            if now >= PARALLEL_COPY_MIN and self.copy_threads > 1:
                self._copy_parallel(leaves, views)
            else:
                for key, leaf, view in zip(keys, leaves, views, strict=True):  # noqa: B007
                    leaf.snapshot_into(view)
                key = None
            for leaf in leaves:
                fence = leaf.snapshot_fence
                if fence is not None and fence not in fences:
                    fences.append(fence)
            for fence in fences:
                fence()
            if deferred:
                self._start_lazy(step, deferred, buf)
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

    def _copy_parallel(self, leaves: Iterable[ArrayLeaf], views: Iterable[np.ndarray]) -> None:
        """The snapshot copy on ``copy_threads`` threads (this one included): large contiguous
        numpy arrays are cut into chunks, everything else is copied whole. numpy and the
        frameworks release the GIL while copying, so the stall drops below one memcpy."""
        tasks: list[tuple[int, Callable[[], None]]] = []
        leaves, views = list(leaves), list(views)
        big = [i for i, leaf in enumerate(leaves) if leaf.nbytes >= SMALL_COPY]
        for i in big:  # the small ones: see copy_small
            leaf, view = leaves[i], views[i]
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
            if len(big) < len(leaves):
                copy_small(leaves, views)
        finally:
            wait_all(futures)
        for f in futures:
            f.result()

    def _start_lazy(self, step: int, deferred: list[tuple[str, ArrayLeaf, np.ndarray]],
                    buf: StagingBuffer) -> None:
        """Start the copy of ``deferred`` on the copy threads (see :mod:`pitstop.core.save.lazy`):
        contiguous host arrays in chunks, so several threads (and a fence that finds the copy
        unfinished) share one large tensor; each adapter's guard installs its fence."""
        tasks: list[Callable[[], None]] = []
        for key, leaf, view in deferred:
            src = leaf.host_view()
            if src is not None and leaf.nbytes > COPY_CHUNK and src.dtype == view.dtype:
                flat_src, flat_dst = src.reshape(-1), view.reshape(-1)
                n = max(1, COPY_CHUNK // src.dtype.itemsize)
                for a in range(0, flat_src.size, n):
                    tasks.append(partial(_lazy_task, key, step, np.copyto,
                                         flat_dst[a:a + n], flat_src[a:a + n]))
            else:
                tasks.append(partial(_lazy_task, key, step, leaf.snapshot_into, view))
        guards: list[Callable[[], None]] = []
        for _k, leaf, _v in deferred:
            guard = leaf.lazy_guard
            if guard is not None and guard not in guards:
                guards.append(guard)
        try:
            for guard in guards:
                guard()  # before the copy starts: the next mutation waits for it
        except Exception as e:  # noqa: BLE001 - an optimisation never fails a save
            if self.lazy:
                self.lazy = False
                log.warning("pitstop: snapshot='lazy' steps aside: its fence could not be "
                            "installed (%s: %s); this manager copies the whole state inside "
                            "save() (snapshot='eager' silences this)", type(e).__name__, e)
            for _k, leaf, view in deferred:
                leaf.snapshot_into(view)
            for leaf in {id(leaf): leaf for _k, leaf, _v in deferred}.values():
                if leaf.snapshot_fence is not None:
                    leaf.snapshot_fence()
            return
        copy = LazyCopy(step, tasks, [leaf for _k, leaf, _v in deferred],
                        [k for k, _leaf, _v in deferred], hooks=self.hooks)
        copy.register()
        self._deferred[id(buf)] = copy  # launched by submit()

    def release_snapshot(self, buf: StagingBuffer) -> None:
        """Give back a snapshot that will not be submitted (its lazy copy finished first)."""
        copy = self._deferred.pop(id(buf), None)
        if copy is not None:
            copy.started.set()  # never launched: this thread copies (a test hook or not)
            copy.fence()
            copy.retire()
        self.pool.release(buf)

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
        if self.tier is not None and job.buffer is not None and job.lazy is None and \
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
                elif not isinstance(e, _Skip):
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
                # saves far apart (the usual case): warm now. Saves back to back: the
                # read-back would slow the next save's writes; close() warms the last one
                if self._queue.empty() and gap_s > 4 * (time.perf_counter() - t_job):
                    self.warm_newest()

    def _bookkeep(self, job: PersistJob, manifest: Manifest, name: str) -> list[int]:
        """Index and retention (``on_commit``), only ever after the commit; the steps
        retention deleted. Trouble there is not the save's: the checkpoint is committed (the
        callback warns and retries later)."""
        job.bookkept = True
        try:
            return list(self.on_commit(manifest, name, job.handle.stats) or [])
        except BaseException:  # noqa: BLE001
            log.exception("pitstop: step %d is committed, but bookkeeping after the "
                          "commit failed", job.step)
            return []

    def _persist(self, job: PersistJob, name: str) -> Manifest:
        buf = job.buffer
        assert buf is not None
        layout = buf.layout
        hook = self.hooks.get("before_persist")
        if hook is not None:
            hook(job.step)
        t0 = time.perf_counter()
        # 1. hash (and check finiteness) in parallel; byte-balanced groups become the data files
        groups = layout.groups()
        # plain bytes without a memory-tier copy to seal first: each array is hashed while
        # its group is written, chunk by chunk (the hashing runs at the pace of the disk, on
        # the I/O threads, instead of as a burst before the writes start)
        fused = self._fused(job)
        same: dict[str, tuple[ArrayEntry, int]] = {}
        if fused:
            self._lazy_done(job)  # (a lazy copy completes first)
            if job.check_finite and not buffer_is_finite(buf):
                raise _Skip("an array holds NaN or Inf (non-finite guard)")
            hashes: dict[str, str] = {}
            hook = self.hooks.get("before_write")
            if hook is not None:
                hook(job.step)
        else:
            hashes, finite = self._hash_and_seal(job)
            if not finite:
                raise _Skip("an array holds NaN or Inf (non-finite guard)")
            # 2. incremental: arrays unchanged since the last commit are referenced, not
            # written
            same = self._unchanged(job.step, layout, hashes) if self.incremental else {}
            if same:
                groups = [[i for i in g if layout.keys[i] not in same] for g in groups]
        t_hashed = time.perf_counter()
        # 3. write data files in parallel, then the manifest last, then publish atomically
        txn = self.storage.begin(name)
        try:
            t_write = time.perf_counter()
            record, cipher = self.encryption.new_save(self.directory_id, job.step,
                                                      seq=self._next_seq()) \
                if self.encryption is not None else (None, None)
            results = self._map_all(
                lambda ig: self._write_group(txn, buf, ig[0], ig[1], hashes, cipher=cipher,
                                             hash_while_writing=fused),
                enumerate(groups))
            t_written = time.perf_counter()
            manifest = self._manifest(job, job.structure, job.values)
            manifest.encryption = record
            for fname, length, entries in results:
                if fname is not None:
                    manifest.files[fname] = length
                manifest.arrays.update(entries)
            if same:
                self._reference(manifest, same, job.handle.stats)
            manifest.arrays = {k: manifest.arrays[k] for k in layout.keys}  # layout order
            pieces = manifest.arrays
            if layout.sharded:
                manifest.arrays = group_pieces(manifest.arrays)
            hook = self.hooks.get("before_commit")
            if hook is not None:
                hook(job.step)
            self._lazy_check(job)
            verify = getattr(self.storage, "verify_held", None)
            if verify is not None:
                verify()  # the directory is still the one this writer locked
            txn.commit(manifest.to_bytes(self.encryption))
        except BaseException:
            txn.abort()
            raise
        if self.incremental:
            self._remember(name, job.step, layout, hashes, pieces, manifest)
        hook = self.hooks.get("after_commit")
        if hook is not None:
            hook(job.step)
        if self.compression in (None, "none") and self.encryption is None and \
                job.release_buffer and not layout.sharded and \
                all(len(_runs(g)) == 1 for g in groups if g):
            # each data file is a copy of one region of the staging buffer: until a save
            # takes the buffer again (or the files change), a restore of this step can read
            # it from memory
            self.staged = None
            stamp = getattr(self.storage, "file_stamp", None)
            if stamp is not None:
                try:
                    self.staged = (name, buf, buf.generation, {
                        fname: (layout.offsets[g[0]], length, stamp(name, fname))
                        for (fname, length, _e), g in zip(results, groups, strict=True)
                        if fname})
                except OSError:
                    pass  # (an optimisation: restores read from disk)
        self._committed(job, txn.location, t0, t_hashed, t_write, t_written)
        return manifest

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

    # ------------------------------------------------------------------ incremental
    def _unchanged(self, step: int, layout: Layout, hashes: dict[str, str]
                   ) -> dict[str, tuple[ArrayEntry, int]]:
        """The arrays whose raw bytes, dtype, shape and codec setting equal those of the same
        key in this engine's last commit, each with an entry referencing the checkpoint that
        holds its bytes (never a chain: a referenced entry's own holder) and the length of
        the holder's file."""
        prev = self._previous
        if prev is None or step <= prev.step or prev.compression != self.compression:
            return {}
        out: dict[str, tuple[ArrayEntry, int]] = {}
        for i, k in enumerate(layout.keys):
            held = prev.arrays.get(k)
            if held is None or not layout.nbytes[i] or hashes.get(k) != held[0]:
                continue
            entry = held[1]
            if entry.shape == list(layout.shapes[i]) and \
                    entry.dtype == encode_dtype(layout.dtypes[i]):
                out[k] = entry, prev.files[(entry.ref or "", entry.file)]
        return out

    @staticmethod
    def _reference(manifest: Manifest, same: dict[str, tuple[ArrayEntry, int]],
                   stats: SaveStats) -> None:
        """Put the referencing entries ``same`` into ``manifest``, with the files they read
        (each with its length)."""
        for k, (e, length) in same.items():
            assert e.ref is not None
            manifest.arrays[k] = e
            manifest.refs.setdefault(e.ref, {})[e.file] = length
            stats.reused_bytes += e.length

    def _remember(self, name: str, step: int, layout: Layout, hashes: dict[str, str],
                  entries: dict[str, ArrayEntry], manifest: Manifest) -> None:
        """After a commit: what it holds, for the next save to compare against."""
        files = {(name, f): n for f, n in manifest.files.items()}
        for holder, held in manifest.refs.items():
            files.update({(holder, f): n for f, n in held.items()})
        arrays: dict[str, tuple[str, ArrayEntry]] = {}
        for k in layout.keys:
            e = entries[k]
            if e.ref is None:
                e = ArrayEntry(dtype=e.dtype, shape=e.shape, file=e.file, offset=e.offset,
                               length=e.length, hash=e.hash, codec=e.codec, ref=name)
            arrays[k] = (hashes[k], e)
        self._previous = _Previous(step, self.compression, arrays, files)

    def forget_previous(self, name: str | None = None) -> None:
        """The last commit (or any checkpoint it references: ``name``) left the directory
        (deleted, moved aside): the next save writes every array again."""
        prev = self._previous
        if prev is not None and (name is None or any(h == name for h, _f in prev.files)):
            self._previous = None

    def _persist_world(self, job: PersistJob, name: str, coord: Coordinator) -> Manifest:
        """One multi-rank save (see :mod:`pitstop.core.runtime.coordination`): three exchanges that
        every rank makes whatever happens locally, so no rank waits for one that gave up."""
        buf = job.buffer
        layout = buf.layout if buf is not None else Layout((), (), (), (), (), 0)
        where = f"saving step {job.step} to {self.storage.path_of(name)}"
        txn: Any = None
        failure: BaseException | None = None

        def exchange(doc: dict[str, Any], what: str) -> list[Any]:
            try:
                return coord.all_gather_json(doc, what=f"{where}: {what}", channel="persist")
            except BaseException:
                if txn is not None:
                    txn.abort()
                raise

        def fail_if(answers: list[Any], what: str) -> None:
            bad = [(r, a["error"]) for r, a in enumerate(answers) if a.get("error")]
            if not bad:
                return
            if txn is not None:
                txn.abort()
            text = "; ".join(f"rank {r}: {e}" for r, e in bad)
            err = CheckpointWriteError(
                f"{where} failed {what} ({text}). The step is not committed; committed "
                f"checkpoints are intact.", step=job.step, path=self.storage.path_of(name))
            raise err from failure

        hook = self.hooks.get("before_persist")
        t0 = time.perf_counter()
        hashes: dict[str, str] = {}
        finite = True
        try:
            if job.failed is not None:
                raise CheckpointError(f"its snapshot failed: {job.failed}")
            if hook is not None:
                hook(job.step)
            hashes, finite = self._hash_and_seal(job)
            finite = finite and not job.nonfinite_metrics
            if coord.leader and finite:
                txn = self.storage.begin(name)
        except BaseException as e:  # noqa: BLE001 - told to every rank, raised below
            failure = e
        t_hashed = time.perf_counter()
        # 1. what each rank holds; everyone plans the same writes from the answers
        held = [[k, n, hashes.get(k, "")] for k, n in zip(layout.keys, layout.nbytes,
                                                             strict=True)]
        enc = self.encryption
        answers = exchange({"step": job.step, "finite": finite, "held": held,
                            "token": getattr(txn, "token", None),
                            "key_id": None if enc is None else enc.key_id,
                            "save_id": None if enc is None else secrets.token_hex(16),
                            "error": None if failure is None else _why(failure)},
                           "exchanging what each rank holds")
        steps = sorted({a["step"] for a in answers})
        if len(steps) > 1:
            if txn is not None:
                txn.abort()
            said = ", ".join(f"rank {r}: {a['step']}" for r, a in enumerate(answers))
            raise CoordinationError(
                f"{where}: the ranks saved different steps ({said}); every rank must call "
                "save() / step() with the same step, in the same order")
        fail_if(answers, "before writing")
        keys = [a.get("key_id") for a in answers]
        if len(set(keys)) > 1:
            if txn is not None:
                txn.abort()
            raise CheckpointWriteError(
                f"{where}: the ranks encrypt with different keys (key ids {keys}; None: no "
                "encryption); give every rank the same key (the same environment variable). "
                "The step is not committed", step=job.step, path=self.storage.path_of(name))
        record, cipher = enc.new_save(self.directory_id, job.step, answers[0]["save_id"],
                                      self._next_seq() if coord.leader else None) \
            if enc is not None else (None, None)
        if not all(a["finite"] for a in answers):
            if txn is not None:
                txn.abort()
            bad = [r for r, a in enumerate(answers) if not a["finite"]]
            raise _Skip(f"an array holds NaN or Inf on rank(s) {bad} (non-finite guard)")
        writes, writer = plan([[Holding(k, n, h) for k, n, h in a["held"]] for a in answers])
        mine = writes[coord.rank]
        assert buf is not None  # a rank without a snapshot said so, and fail_if raised
        # 2. every rank writes its part into the leader's temporary checkpoint
        t_write = time.perf_counter()
        results: list[Any] = []
        try:
            if not coord.leader:
                txn = self.storage.join(name, answers[0]["token"])
            groups = [[i for i in g if layout.keys[i] in mine] for g in layout.groups()]
            results = self._map_all(lambda ig: self._write_group(
                txn, buf, ig[0], ig[1], hashes, prefix=f"r{coord.rank:05d}-", cipher=cipher),
                enumerate(groups))
            self._lazy_check(job)
        except BaseException as e:  # noqa: BLE001
            failure = e
        t_written = time.perf_counter()
        files = {f: n for f, n, _e in results if f is not None}
        entries = {k: _entry_json(e) for _f, _n, es in results for k, e in es.items()}
        answers_b = exchange({"files": files, "entries": entries, "values": job.values,
                              "structure": job.structure, "shapes": job.global_shapes,
                              "error": None if failure is None else _why(failure)},
                             "collecting what each rank wrote")
        fail_if(answers_b, "while writing")
        # 3. the leader checks the whole, writes the manifest and publishes
        manifest: Manifest | None = None
        if coord.leader:
            try:
                manifest = self._world_manifest(job, name, answers, answers_b, writer)
                manifest.encryption = record
                data = manifest.to_bytes(enc)
                parse(data, where, enc)  # every entry checked (shards cover) before the commit
                hook = self.hooks.get("before_commit")
                if hook is not None:
                    hook(job.step)
                verify = getattr(self.storage, "verify_held", None)
                if verify is not None:
                    verify()
                txn.commit(data)
            except BaseException as e:  # noqa: BLE001
                txn.abort()
                failure = e
        removed: list[int] = []
        if coord.leader:
            txn = None  # committed, or aborted: nothing more to undo
            if failure is None and manifest is not None:
                # committed: index and retention now, before the other ranks hear of it, so
                # that every rank's wait() returns to the same directory
                self._committed(job, self.storage.path_of(name), t0, t_hashed, t_write,
                                t_written)
                removed = self._bookkeep(job, manifest, name)
        # (no abort if this exchange fails: the leader may have committed, and a part of
        # an uncommitted save left behind is removed by the next writer's cleanup)
        outcome = coord.all_gather_json({"error": None if failure is None else _why(failure),
                                         "removed": removed},
                                        what=f"{where}: publishing the checkpoint",
                                        channel="persist")
        fail_if(outcome, "at the commit")  # (another rank aborts its own part there)
        if txn is not None:
            txn.done()
        if manifest is None:  # a follower: what its bookkeeping needs of the manifest
            manifest = self._manifest(job, job.structure, job.values)
            manifest.world = coord.world_size
        if not coord.leader:
            forget = self.forget_step
            for s in outcome[0].get("removed") or []:
                if forget is not None:
                    forget(int(s))  # deleted by the leader's retention
            self._committed(job, self.storage.path_of(name), t0, t_hashed, t_write, t_written)
        return manifest

    def _next_seq(self) -> int:
        with self._seq_lock:
            self.last_seq += 1
            return self.last_seq

    def _world_manifest(self, job: PersistJob, name: str, held: list[Any], wrote: list[Any],
                        writer: dict[tuple[str, str], int]) -> Manifest:
        """The manifest of a multi-rank save: rank 0's whole view at the top level, the
        other ranks' differences in ``world``; sharded arrays assembled from every rank."""
        where = self.storage.path_of(name)
        stored: dict[tuple[str, str], ArrayEntry] = {}
        files: dict[str, int] = {}
        for r, doc in enumerate(wrote):
            files.update(doc["files"])
            hash_of = {k: h for k, _n, h in held[r]["held"]}
            for k, e in doc["entries"].items():
                stored[(k, hash_of[k])] = _entry_of(e)
        # every shard of every sharded array, once (the lowest rank's bytes where replicas
        # of one shard differ)
        pieces: dict[str, ArrayEntry] = {}
        diverged: list[str] = []
        for r, doc in enumerate(held):
            for k, _n, h in doc["held"]:
                if SHARD_MARK not in k:
                    continue
                if k in pieces:
                    if pieces[k].hash != stored[(k, h)].hash:
                        diverged.append(f"{k} (rank {r})")
                    continue
                pieces[k] = stored[(k, h)]
        if diverged:
            log.warning("pitstop: %s: replicas of these shards differ between ranks; the "
                        "lowest rank's bytes were saved: %s", where, ", ".join(diverged[:10]))
        sharded = group_pieces(pieces)
        shapes: dict[str, list[int]] = {}
        for r, doc in enumerate(wrote):
            for k, shape in doc["shapes"].items():
                got = sharded.get(k)
                if got is None or got.shape != shape or shapes.setdefault(k, shape) != shape:
                    raise CheckpointError(
                        f"{where}: array {k!r} has global shape {shape} on rank {r}, but the "
                        f"ranks' shards make {got.shape if got else 'nothing'} (a rank's "
                        "shard is missing, or the ranks disagree on the array)")

        def view(r: int) -> dict[str, ArrayEntry]:
            out: dict[str, ArrayEntry] = {}
            for k, _n, h in held[r]["held"]:
                base, mark, _ = k.partition(SHARD_MARK)
                if mark:
                    if base not in out:
                        out[base] = sharded[base]
                else:
                    out[k] = stored[(k, h)]
            for k in wrote[r]["shapes"]:
                out.setdefault(k, sharded[k])  # a sharded array of which it holds no shard
            return out

        top = view(0)
        manifest = self._manifest(job, wrote[0]["structure"], wrote[0]["values"])
        manifest.files = files
        manifest.arrays = top
        manifest.world = len(held)
        for r in range(1, len(held)):
            mine = view(r)
            rv = RankView(
                arrays={k: e for k, e in mine.items() if top.get(k) is not e},
                absent=[k for k in top if k not in mine])
            if wrote[r]["values"] != wrote[0]["values"]:
                rv.values = wrote[r]["values"]
            if wrote[r]["structure"] != wrote[0]["structure"]:
                rv.structure = wrote[r]["structure"]
            manifest.ranks.append(rv)
        return manifest

    def _manifest(self, job: PersistJob, structure: Any, values: dict[str, Any]) -> Manifest:
        return Manifest(
            step=job.step, structure=structure, hash_algorithm=self.hash_algorithm,
            metrics=job.metrics, directory_id=self.directory_id, created_unix=job.created_unix,
            all_finite=True if job.check_finite else None, user_metadata=job.user_metadata,
            writer={"pitstop": _version(), "host": socket.gethostname(), "pid": os.getpid(),
                    **({"frameworks": job.frameworks} if job.frameworks else {})},
            values=values, layouts=job.layouts,
        )

    def _fused(self, job: PersistJob) -> bool:
        """Whether ``job`` hashes its arrays while writing them (see ``_persist``): plain
        bytes, hashes not known yet, and no memory-tier copy, whose seal must be written
        before the data files are (a crash while writing then finds it sealed)."""
        buf = job.buffer
        return (job.hashes is None and buf is not None and buf.shm_path is None
                and self.compression in (None, "none") and self.encryption is None
                and not self.incremental)  # (which compares hashes before writing)

    def _hash_and_seal(self, job: PersistJob) -> tuple[dict[str, str], bool]:
        """Every array's hash (in parallel) and whether all are finite (when the guard is
        on); then the memory-tier copy is verifiable: it is sealed."""
        buf = job.buffer
        assert buf is not None
        self._lazy_done(job)
        if job.hashes is None:
            # several ranks compare raw hashes to write replicated state once
            world = self.coordinator is not None
            parts = self._executor.map(
                lambda g: self._hash_group(buf, g, job.check_finite, world), buf.layout.groups())
            hashes: dict[str, str] = {}
            finite = True
            for h, f in parts:
                hashes.update(h)
                finite &= f
        else:
            hashes = job.hashes
            finite = not job.check_finite or buffer_is_finite(buf)
        if finite and self.tier is not None and buf.shm_path is not None and job.hashes is None:
            self._tier_call(self.tier.seal, buf, job, hashes, self.hash_algorithm)
        hook = self.hooks.get("before_write")
        if finite and hook is not None:
            hook(job.step)
        return hashes, finite

    def _lazy_done(self, job: PersistJob) -> None:
        """Wait for the save's lazy copy; raise its failure. The memory tier describes the
        snapshot only now that it is complete (a crash before this loses that save)."""
        copy = job.lazy
        if copy is None:
            return
        copy.done.wait()
        job.handle.stats.lazy_copy_s = copy.copy_s
        if copy.error is not None:
            if isinstance(copy.error, LazyVersionError):
                self._lazy_off()
            raise copy.error
        buf = job.buffer
        if self.tier is not None and buf is not None and buf.shm_path is not None and \
                job.hashes is None:
            self._tier_call(self.tier.describe, buf, job)

    def _lazy_check(self, job: PersistJob) -> None:
        """Before the commit: no lazily copied array was written in place before the first
        fence after its save (see :mod:`pitstop.core.save.lazy`)."""
        if job.lazy is not None:
            try:
                job.lazy.check_final()
            except LazyVersionError:
                self._lazy_off()
                buf = job.buffer
                if self.tier is not None and buf is not None and buf.shm_path is not None:
                    # described and sealed there once the copy ended: bytes that might mix
                    # old and new values must never come back from shared memory either
                    self._tier_call(self.tier.invalidate, buf)
                raise

    def _lazy_off(self) -> None:
        self.lazy = False  # (the save's error says so: one message, not two)

    def _committed(self, job: PersistJob, location: str, t0: float, t_hashed: float,
                   t_write: float, t_written: float) -> None:
        buf = job.buffer
        assert buf is not None
        t1 = time.perf_counter()
        stats = job.handle.stats
        stats.persist_s = t1 - t0
        stats.hash_s = t_hashed - t0
        stats.write_s = t_written - t_write
        stats.commit_s = t1 - t_written
        stats.total_s = t1 - job.t_start + stats.stall_s
        stats.committed = True
        stats.path = location
        if job.lazy is not None:
            stats.lazy_copy_s, stats.fence_wait_s = job.lazy.copy_s, job.lazy.fence_wait_s
        if self.tier is not None and buf.shm_path is not None:
            self._tier_call(self.tier.mark_committed, buf)
        log.info("pitstop: committed step %d: %.1f MiB, stall %.3f s, persist %.3f s (%.0f MiB/s)",
                 job.step, stats.bytes / 2**20, stats.stall_s, stats.persist_s,
                 stats.throughput / 2**20)

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
            # hashed while writing), and always the memory tier's seal and what incremental
            # saves compare
            if raw_hashes or self.tier is not None or self.incremental or (
                    self.compression in (None, "none") and self.encryption is None):
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
            self._tier_trouble(e, "description could not be written")

    def _tier_trouble(self, e: OSError, what: str) -> None:
        """One warning for a tier that steps aside, however it shows (the pool's fallback
        says it when it has one: the same warning as a tier too small for a buffer)."""
        fallback = self.pool.on_tier_failure
        trouble = getattr(fallback, "trouble", None)
        if trouble is not None:
            trouble(e, what)
        elif not self._tier_warned:
            self._tier_warned = True
            log.warning("pitstop: the memory tier %s (%s); saves go on, but a crash before a "
                        "commit may lose that save", what, e)

    def _write_group(self, txn: Any, buf: StagingBuffer, index: int, group: list[int],
                     hashes: dict[str, str], prefix: str = "", cipher: Any = None,
                     hash_while_writing: bool = False
                     ) -> tuple[str | None, int, dict[str, ArrayEntry]]:
        """Write the arrays ``group`` (indices into the layout, ascending) as one data file;
        a multi-rank save passes the part of a group this rank writes (``prefix``: its
        rank, so the ranks' file names never collide). ``cipher``: encrypt each array's
        (compressed) bytes segment by segment (see :mod:`pitstop.core.format.crypto`).
        ``hash_while_writing``: plain bytes whose hashes are not in ``hashes`` yet: each
        chunk is hashed just before it is written."""
        if not group:
            return None, 0, {}
        layout = buf.layout
        fname = f"data-{prefix}{index:03d}.bin"
        entries: dict[str, ArrayEntry] = {}
        raw = self.compression in (None, "none") and cipher is None
        runs = _runs(group)
        w = txn.open_write(fname, direct=(raw and len(runs) == 1) or cipher is not None)
        try:
            if raw:
                # each run of consecutive arrays is one contiguous, page-aligned region of
                # the staging buffer: written as is (a whole group with O_DIRECT where the
                # file system allows: no page-cache copy on the CPU; the region then ends
                # on a page boundary, so the file carries a few bytes of padding)
                pos = 0
                for run in runs:
                    start = layout.offsets[run[0]]
                    end = layout.offsets[run[-1]] + layout.nbytes[run[-1]]
                    if getattr(w, "direct", False):
                        end = min(-(-end // ALIGN) * ALIGN, buf.buf.size)
                    region = buf.buf[start:end]
                    digests = _RunHasher(self.hash_algorithm, layout, run) \
                        if hash_while_writing else None
                    for at in range(0, end - start, WRITE_CHUNK):
                        if digests is not None:
                            digests.update(start + at, start + at + WRITE_CHUNK, buf.buf)
                        w.write(region[at:at + WRITE_CHUNK])
                    if digests is not None:
                        digests.update(end, 1 << 62, buf.buf)  # arrays of no bytes at the end
                        hashes = digests.done
                    for i in run:
                        k = layout.keys[i]
                        entries[k] = ArrayEntry(
                            dtype=encode_dtype(layout.dtypes[i]), shape=list(layout.shapes[i]),
                            file=fname, offset=pos + layout.offsets[i] - start,
                            length=layout.nbytes[i], hash=hashes[k])
                    pos += end - start
                length = pos
            elif cipher is not None:
                # compressed first (when on), then encrypted segment by segment into one
                # page-aligned buffer, written in whole pages (O_DIRECT where allowed)
                from pitstop.core.format.crypto import OVERHEAD, Sink, codec_of
                # the largest segment of these arrays (compressed ones may grow a little)
                most = cipher.segment if self.compression not in (None, "none") else \
                    min(cipher.segment, max(layout.nbytes[i] for i in group))
                sink = Sink(w, most + OVERHEAD)
                pos = 0
                for i in group:
                    k = layout.keys[i]
                    off, n = layout.offsets[i], layout.nbytes[i]
                    base = codecs.codec_name(self.compression, layout.dtypes[i].itemsize)
                    payload = codecs.encode(base, buf.buf[off:off + n])
                    h = new_hasher(self.hash_algorithm)
                    size = cipher.encrypt(payload, fname, pos, sink.reserve, h)
                    entries[k] = ArrayEntry(
                        dtype=encode_dtype(layout.dtypes[i]), shape=list(layout.shapes[i]),
                        file=fname, offset=pos, length=size, hash=str(h.hexdigest()),
                        codec=codec_of(base))
                    pos += size
                length = pos + sink.close()
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


class _RunHasher:
    """Hashes the arrays of a run (consecutive layout indices) as the byte ranges of the
    staging buffer that hold them are fed in order; ``done`` maps each key to its digest."""

    def __init__(self, algorithm: str, layout: Layout, run: list[int]) -> None:
        self.algorithm = algorithm
        self.layout = layout
        self.run = run
        self.next = 0  # position in run of the first array not finished
        self.hasher: Any = None
        self.done: dict[str, str] = {}

    def update(self, lo: int, hi: int, data: np.ndarray) -> None:
        """Feed the buffer's bytes ``[lo, hi)`` (each byte exactly once, in order)."""
        layout, run = self.layout, self.run
        while self.next < len(run):
            i = run[self.next]
            a, n = layout.offsets[i], layout.nbytes[i]
            if a >= hi:
                return
            if self.hasher is None:
                self.hasher = new_hasher(self.algorithm)
            for at in range(max(a, lo), min(a + n, hi), HASH_CHUNK):
                self.hasher.update(data[at:min(at + HASH_CHUNK, a + n, hi)])
            if a + n > hi:
                return  # the array goes on in the next chunk
            self.done[layout.keys[i]] = str(self.hasher.hexdigest())
            self.hasher = None
            self.next += 1


@dataclass
class _Previous:
    """What an engine's last commit holds (incremental saves): per key, its raw bytes'
    hash and an entry referencing the checkpoint that holds them; each data file's length."""

    step: int
    compression: str | None
    arrays: dict[str, tuple[str, ArrayEntry]]
    files: dict[tuple[str, str], int]


def _lazy_task(key: str, step: int, fn: Callable[..., None], *args: Any) -> None:
    """One piece of a lazy copy; a failure names the array."""
    try:
        fn(*args)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(
            f"the background (snapshot='lazy') copy of {key!r} for step {step} failed: "
            f"{type(e).__name__}: {e}") from e


#: leaves smaller than this are copied in one plain loop on the caller's thread
SMALL_COPY = 64 << 10


def copy_small(leaves: list[ArrayLeaf], views: list[np.ndarray]) -> None:
    """Copy the leaves under :data:`SMALL_COPY` bytes into their staging views: one loop
    on this thread (a copy of a few KiB costs less than handing it to another thread, which
    would wait for the GIL anyway), a numpy leaf by plain assignment (the cheapest numpy
    copy call; it swaps a big-endian source to the view's little-endian order, as
    ``snapshot_into`` does)."""
    numpy_leaf = NumpyLeaf
    for leaf, view in zip(leaves, views, strict=True):
        if leaf.nbytes >= SMALL_COPY:
            continue
        if type(leaf) is numpy_leaf:
            view[...] = leaf.array  # type: ignore[attr-defined]
        else:
            leaf.snapshot_into(view)


class _Skip(CheckpointError):
    """The save was deliberately not committed (non-finite guard)."""


def _runs(group: list[int]) -> list[list[int]]:
    """Ascending indices cut into runs of consecutive ones."""
    if group[-1] - group[0] == len(group) - 1:
        return [group]  # a whole layout group (every one-process save): one run
    runs: list[list[int]] = []
    for i in group:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _entry_json(e: ArrayEntry) -> dict[str, Any]:
    d = {"dtype": e.dtype, "shape": e.shape, "file": e.file, "offset": e.offset,
         "length": e.length, "hash": e.hash}
    if e.codec != "none":
        d["codec"] = e.codec
    return d


def _entry_of(d: dict[str, Any]) -> ArrayEntry:
    return ArrayEntry(dtype=d["dtype"], shape=list(d["shape"]), file=d["file"],
                      offset=d["offset"], length=d["length"], hash=d["hash"],
                      codec=d.get("codec", "none"))


def _why(e: BaseException) -> str:
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


def pieces_of(flat: FlatState, whole: bool = True) -> dict[str, ArrayLeaf]:
    """``flat.arrays`` with every sharded leaf replaced by its distinct shards (piece keys).
    ``whole``: one process saves alone, so its shards must be all of each array."""
    out: dict[str, ArrayLeaf] = {}
    for key, leaf in flat.arrays.items():
        if not leaf.sharded:
            out[key] = leaf
            continue
        pieces = leaf.pieces()
        if whole:
            held = sum(math.prod(b - a for a, b in index) for index, _p in pieces)
            if held != math.prod(leaf.shape):
                raise UnsupportedStateError(
                    f"state entry {key!r}: this process holds {held} of its "
                    f"{math.prod(leaf.shape)} elements (global shape {list(leaf.shape)}); the "
                    "rest is on other ranks. Save it with every rank together (a "
                    "CheckpointManager made on every rank, distributed='auto'), or gather it "
                    "first (DTensor.full_tensor(), process_allgather)")
        for index, piece in pieces:
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
        from pitstop.core.errors import InvalidArgumentError
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
    from pitstop._version import __version__
    return __version__
