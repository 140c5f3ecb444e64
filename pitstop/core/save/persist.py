"""The background persist of one save: hash -> write the data files -> manifest -> commit,
as stages that the one-process save (:meth:`Persist._persist`) and the multi-rank save
(:mod:`pitstop.core.save.world`) run in the same order.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pitstop.core.errors import CheckpointError
from pitstop.core.format.dtypes import is_inexact
from pitstop.core.format.schema import ArrayEntry, Manifest, group_pieces
from pitstop.core.save.handles import SaveHandle, SaveStats
from pitstop.core.save.incremental import Incremental
from pitstop.core.save.lazy import LazyCopy, LazyVersionError
from pitstop.core.save.snapshot import StagingBuffer, StagingPool
from pitstop.core.save.threads import Workers
from pitstop.core.save.writing import DataFiles, runs_of
from pitstop.core.storage import Storage

log = logging.getLogger("pitstop")


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
    #: a preemption notice's save that does not fit before its deadline: no memory-tier
    #: description or seal (the tier is no help when the machine goes away), hashed while
    #: written (see :mod:`pitstop.core.runtime.preemption`)
    fast: bool = False



@dataclass
class Times:
    """When the stages of one persist began and ended (``time.perf_counter``): the parts of
    its :class:`~pitstop.core.save.handles.SaveStats`."""

    start: float = field(default_factory=time.perf_counter)
    hashed: float = 0.0
    write: float = 0.0
    written: float = 0.0


class SaveSkipped(CheckpointError):
    """The save was deliberately not committed (non-finite guard)."""



class Persist(DataFiles, Incremental):
    """The engine's persist stages (see :class:`pitstop.core.save.engine.Engine`)."""

    storage: Storage
    hash_algorithm: str
    directory_id: str
    pool: StagingPool
    hooks: dict[str, Callable[..., Any]]
    coordinator: Any
    lazy: bool
    on_commit: Callable[[Manifest, str, SaveStats], list[int] | None]
    staged: tuple[str, StagingBuffer, int, dict[str, tuple[int, int, Any]]] | None
    last_seq: int
    _seq_lock: threading.Lock
    _executor: Workers
    _tier_warned: bool

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
        """One process's save: hash (or hash while writing), reference what is unchanged,
        write, manifest, publish, committed."""
        buf = job.buffer
        assert buf is not None
        layout = buf.layout
        hook = self.hooks.get("before_persist")
        if hook is not None:
            hook(job.step)
        times = Times()
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
                raise SaveSkipped("an array holds NaN or Inf (non-finite guard)")
            hashes: dict[str, str] = {}
            hook = self.hooks.get("before_write")
            if hook is not None:
                hook(job.step)
        else:
            hashes, finite = self._hash_and_seal(job)
            if not finite:
                raise SaveSkipped("an array holds NaN or Inf (non-finite guard)")
            # 2. incremental: arrays unchanged since the last commit are referenced, not
            # written
            same = self._unchanged(job.step, layout, hashes) if self.incremental else {}
            if same:
                groups = [[i for i in g if layout.keys[i] not in same] for g in groups]
        times.hashed = time.perf_counter()
        # 3. write data files in parallel, then the manifest last, then publish atomically
        txn = self.storage.begin(name)
        try:
            times.write = time.perf_counter()
            record, cipher = self._new_cipher(job.step)
            results = self._write_all(txn, buf, groups, hashes, cipher, fused=fused)
            times.written = time.perf_counter()
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
            self._publish(txn, job, manifest.to_bytes(self.encryption), check_lazy=True)
        except BaseException:
            txn.abort()
            raise
        if self.incremental:
            self._remember(name, job.step, layout, hashes, pieces, manifest)
        hook = self.hooks.get("after_commit")
        if hook is not None:
            hook(job.step)
        self._keep_staged(job, name, groups, results)
        self._committed(job, txn.location, times)
        return manifest

    def _keep_staged(self, job: PersistJob, name: str, groups: list[list[int]],
                     results: list[tuple[str | None, int, dict[str, ArrayEntry]]]) -> None:
        """After a one-process commit: remember the staging buffer it was written from,
        when each data file is a plain copy of one region of it (see ``hold_staged``)."""
        buf = job.buffer
        assert buf is not None
        layout = buf.layout
        if self.compression in (None, "none") and self.encryption is None and \
                job.release_buffer and not layout.sharded and \
                all(len(runs_of(g)) == 1 for g in groups if g):
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

    # --------------------------------------------- stages both persists run, in this order
    def _new_cipher(self, step: int, save_id: str | None = None, numbered: bool = True
                    ) -> tuple[dict[str, Any] | None, Any]:
        """The encryption record and cipher of a new save, (None, None) when unencrypted;
        a multi-rank save passes rank 0's ``save_id``, and only its leader numbers it."""
        if self.encryption is None:
            return None, None
        return self.encryption.new_save(self.directory_id, step, save_id,
                                        self._next_seq() if numbered else None)

    def _write_all(self, txn: Any, buf: StagingBuffer, groups: list[list[int]],
                   hashes: dict[str, str], cipher: Any, prefix: str = "", fused: bool = False
                   ) -> list[tuple[str | None, int, dict[str, ArrayEntry]]]:
        """Each group as one data file, the groups in parallel (see ``_write_group``)."""
        return self._map_all(lambda ig: self._write_group(
            txn, buf, ig[0], ig[1], hashes, prefix=prefix, cipher=cipher,
            hash_while_writing=fused), enumerate(groups))

    def _publish(self, txn: Any, job: PersistJob, data: bytes, check_lazy: bool) -> None:
        """The manifest ``data`` written and the checkpoint published, after the
        ``before_commit`` hook, the lazy copy's last check (``check_lazy``; a multi-rank
        save checks it before it tells the others what it wrote) and the check that the
        directory is still the one this writer locked."""
        hook = self.hooks.get("before_commit")
        if hook is not None:
            hook(job.step)
        if check_lazy:
            self._lazy_check(job)
        verify = getattr(self.storage, "verify_held", None)
        if verify is not None:
            verify()  # the directory is still the one this writer locked
        txn.commit(data)


    def _next_seq(self) -> int:
        with self._seq_lock:
            self.last_seq += 1
            return self.last_seq

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
        return (job.hashes is None and buf is not None and (buf.shm_path is None or job.fast)
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
        if finite and self.tier is not None and buf.shm_path is not None and \
                job.hashes is None and not job.fast:
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
                job.hashes is None and not job.fast:
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

    def _committed(self, job: PersistJob, location: str, times: Times) -> None:
        """The save's figures and the memory tier told: the last stage of either persist."""
        buf = job.buffer
        assert buf is not None
        t1 = time.perf_counter()
        stats = job.handle.stats
        stats.persist_s = t1 - times.start
        stats.hash_s = times.hashed - times.start
        stats.write_s = times.written - times.write
        stats.commit_s = t1 - times.written
        stats.total_s = t1 - job.t_start + stats.stall_s
        stats.committed = True
        stats.path = location
        if job.lazy is not None:
            stats.lazy_copy_s, stats.fence_wait_s = job.lazy.copy_s, job.lazy.fence_wait_s
        if self.tier is not None and buf.shm_path is not None and not job.fast:
            self._tier_call(self.tier.mark_committed, buf)
        log.info("pitstop: committed step %d: %.1f MiB, stall %.3f s, persist %.3f s (%.0f MiB/s)",
                 job.step, stats.bytes / 2**20, stats.stall_s, stats.persist_s,
                 stats.throughput / 2**20)

    def _map_all(self, fn: Callable[[Any], Any], items: Any) -> list[Any]:
        """``fn`` over ``items`` on the I/O threads; waits for *every* call before raising the
        first failure, so an abort never races writers still filling the temporary dir."""
        return self._executor.map(fn, items)


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



def buffer_is_finite(buf: StagingBuffer) -> bool:
    """True when no floating array of ``buf`` holds NaN or Inf."""
    for v in buf.views.values():
        if is_inexact(v.dtype) and v.size and not np.isfinite(v).all():
            return False
    return True



def _version() -> str:
    from pitstop._version import __version__
    return __version__
