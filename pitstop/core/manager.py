"""CheckpointManager: the face that joins policy, engine, storage and reader.

What it does beside tying those together lives in rooms of its own: signal handling
(:mod:`.signals`), the directory's index, retention and checkpoints moved aside
(:mod:`.catalog`), memory-tier recovery (:mod:`.recovery`), the restore itself
(:mod:`.restore`), what the manager holds and how it is released (:mod:`.lifecycle`), and
the checks of its arguments (:mod:`.arguments`).

A manager belongs to the process that created it. In a forked child every call but
``close()`` (a no-op there) raises, and nothing the child does, garbage collection and exit
included, touches the parent's buffers, tier files, lock or directory. A manager that is
dropped or still open when the interpreter exits commits the saves it accepted and
releases what it holds.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from typing import Any

import numpy as np

from pitstop.core.arguments import (
    DEFAULT_SNAPSHOT,
    check_arguments,
    check_callables,
    check_incremental,
    check_naming,
    check_permissions,
    check_snapshot,
    check_user_metadata,
    clean_metrics,
    open_directory,
    step_arg,
    wrap_os,
)
from pitstop.core.arguments import check_encryption as check_encryption_arg
from pitstop.core.directory.catalog import Catalog
from pitstop.core.directory.identity import (
    check_encryption,
    create_identity,
    directory_kind,
    last_seq,
    read_identity,
    resolve_naming,
)
from pitstop.core.directory.names import Naming, step_name
from pitstop.core.directory.recovery import Recovered, discard, recover, recoverable_steps
from pitstop.core.directory.retention import record_retention
from pitstop.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DirectoryLockedError,
    IncompatibleTargetError,
    InvalidArgumentError,
    StepExistsError,
    UnsupportedFormatError,
)
from pitstop.core.format.crypto import ENV, Encryption
from pitstop.core.format.hashing import DEFAULT
from pitstop.core.format.schema import Manifest
from pitstop.core.policy import (
    AnyOf,
    AutoInterval,
    EveryNSteps,
    EverySeconds,
    KeepBest,
    KeepEverySteps,
    KeepLast,
    OnImprovement,
    RetentionPolicy,
    SaveContext,
    SavePolicy,
)
from pitstop.core.restore.read import CheckpointReader
from pitstop.core.restore.report import RestoredStep, RestoreReport
from pitstop.core.runtime import supervised
from pitstop.core.runtime.coordination import CoordinationError, Coordinator
from pitstop.core.runtime.lifecycle import Resources, TierFallback, lost_signal_message
from pitstop.core.runtime.signals import (
    CONTINUE_SIGNALS,
    DEFAULT_SIGNALS,
    SignalSaver,
    check_signals,
    child_signals_held,
    signal_name,
)
from pitstop.core.save import memtier as memtier_mod
from pitstop.core.save.engine import Engine
from pitstop.core.save.handles import SaveHandle, SaveStats, check_timeout
from pitstop.core.save.lazy import fence_all
from pitstop.core.save.memtier import MemoryTier
from pitstop.core.save.persist import PersistJob
from pitstop.core.save.skips import SkippedSaves
from pitstop.core.save.snapshot import StagingPool
from pitstop.core.storage import Storage
from pitstop.core.storage.staged import StagedStorage
from pitstop.core.tree import FlatState, FlattenCache, flatten

log = logging.getLogger("pitstop")

#: this process's pid, kept current across forks (os.getpid() is a system call; step() is
#: called every training step)
_pid = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))

__all__ = ["CheckpointManager", "step_name", "DEFAULT_SIGNALS", "CONTINUE_SIGNALS"]


def _resolver() -> Callable[[Any], Any]:
    from pitstop.core.adapter import resolve
    return resolve


#: said once by a manager's first ``step()`` when no policy can ever make it save: a loop
#: that calls ``step()`` every step and trusts it to save must not find out after a crash
NO_POLICY = ("pitstop: step() of the manager of {directory} saves only on a signal: it was "
             "given no save_every_steps, save_every_seconds, mtbf_seconds, keep_best or "
             "save_policy. Pass save_every_steps=N to save every N steps (Orbax saves every "
             "step by default: save_every_steps=1), or call save(step, state) to save now.")


class CheckpointManager:
    """Saves and restores training state in a directory of step checkpoints.

    ``save`` blocks only for an in-memory snapshot; hashing, writing, fsync, the atomic
    commit and retention run in the background (``async_save=False`` does it all inline).
    ``step`` is the per-training-step call: it saves when a policy says so. ``restore``
    puts the newest valid checkpoint back into live objects, in place. ``naming`` says how
    the directory names its checkpoints (``step_prefix`` / ``step_digits`` when it was
    created; ``step_`` + 10 digits by default).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | Storage,
        *,
        keep_last: int | None = None,
        keep_every_steps: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        save_every_steps: int | None = None,
        save_every_seconds: float | None = None,
        save_policy: SavePolicy | None = None,
        retention: Iterable[RetentionPolicy] | None = None,
        save_on_signals: Iterable[str | int] | None = DEFAULT_SIGNALS,
        mtbf_seconds: float | None = None,
        async_save: bool = True,
        max_in_flight: int = 1,
        on_busy: str = "skip",
        memory_tier: bool | str | None = None,
        nonfinite_guard: bool = False,
        hash_algorithm: str = DEFAULT,
        compression: str | None = None,
        writer_threads: int | None = None,
        copy_threads: int | None = None,
        durable: bool = True,
        read_only: bool = False,
        on_save: Callable[[SaveStats], None] | None = None,
        step_prefix: str | None = None,
        step_digits: int | None = None,
        distributed: Any = "auto",
        storage_options: Mapping[str, Any] | None = None,
        permissions: int | None = 0o700,
        encryption: Any = None,
        incremental: bool = False,
        snapshot: str = DEFAULT_SNAPSHOT,
    ) -> None:
        self._owner_pid = os.getpid()
        self._closed = False
        self._engine: Engine | None = None
        #: snapshots recovered from the memory tier at construction, oldest first
        self._recovered_all: list[Recovered] = []
        check_arguments(directory, hash_algorithm, on_busy, keep_best, best_metric, best_mode,
                         compression, max_in_flight, memory_tier, writer_threads, copy_threads)
        check_callables(save_policy, retention, on_save)
        #: "eager" or "lazy" (see :mod:`pitstop.core.save.lazy`); a synchronous manager waits for
        #: the whole save anyway, so it copies eagerly
        self.snapshot_mode = check_snapshot(snapshot)
        check_encryption_arg(encryption)
        check_incremental(incremental)
        #: encryption at rest (:class:`pitstop.Encryption`); None: plaintext checkpoints
        self.encryption = encryption
        check_naming(step_prefix, step_digits)
        check_permissions(permissions)
        check_signals(save_on_signals)  # all of them, before anything is installed or written
        #: the ranks of the distributed job this manager saves with (None: one process)
        self._coord: Coordinator | None = None if read_only else _coordinator(distributed)
        self._distributed = distributed
        #: (rank, ranks) of this process in its distributed job; (0, 1) alone. A read-only
        #: manager has no coordinator, but restores its own rank's part all the same
        self._rank_world = (self._coord.rank, self._coord.world_size) if self._coord else \
            _ambient_rank() if distributed is not False else (0, 1)
        leader = self._coord is None or self._coord.leader
        self.storage = open_directory(
            directory, durable=durable, create=not read_only and leader,
            permissions=permissions,
            **({} if storage_options is None else {"storage_options": storage_options}))
        self.directory = self.storage.location
        self.read_only = read_only
        self.async_save = async_save
        self.on_busy = on_busy
        self.nonfinite_guard = nonfinite_guard
        self.best_metric, self.best_mode = best_metric, best_mode
        self.on_save = on_save
        self.stats: list[SaveStats] = []
        #: periodic saves skipped because the previous one was still persisting
        self._skips = SkippedSaves()
        self._resolve = _resolver()
        #: a run continued from this older step: the newer checkpoints of the abandoned run
        #: are moved aside at its first save
        self._rolled_back_to: int | None = None
        #: ... and those newer checkpoints, hidden from this manager until they are moved
        self._abandoned: set[int] = set()
        self._warned: set[str] = set()
        #: the leaves of the last save's big dicts of arrays, reused while they hold the
        #: same arrays (many small tensors: see tree.FlattenCache)
        self._flatten_cache = FlattenCache()
        #: the adapters of a save -> the frameworks (and versions) they record
        self._frameworks: dict[frozenset[Any], dict[str, str]] = {}
        #: one save (its checks, snapshot and submit) or close at a time, across threads
        self._api_lock = threading.RLock()

        retention_list: list[RetentionPolicy] = list(retention or [])
        if keep_last is not None:
            retention_list.append(KeepLast(keep_last))
        if keep_every_steps is not None:
            retention_list.append(KeepEverySteps(keep_every_steps))
        if keep_best is not None:
            retention_list.append(KeepBest(keep_best, best_metric or "", best_mode))
        self.retention = retention_list

        if read_only:
            identity = read_identity(self.storage, required=False)
            self.directory_id = identity.directory_id if identity else ""
            #: how this directory names its checkpoints (recorded in .pitstop/directory.json)
            self.naming: Naming = resolve_naming(
                self.directory, identity.naming if identity else None, step_prefix, step_digits)
            # no identity (its .pitstop/ not copied along): what the checkpoints say; with a
            # key at hand, an encrypted checkpoint makes the directory encrypted whatever its
            # identity says (that file is anyone's to edit)
            kind = wrap_os(directory_kind, self.directory, self.storage, self.naming, identity,
                           encryption is not None or bool(os.environ.get(ENV)))
            if kind is not None and not self.directory_id:
                self.directory_id = kind.directory_id  # (its checkpoints' one id)
            if encryption is None and kind is not None and kind.encryption and \
                    os.environ.get(ENV):
                # reading only (the export helpers, the CLI): the key from its variable
                encryption = self.encryption = Encryption()
            plain = encryption is not None and kind is not None and not kind.encryption \
                and any(self.naming.parse(n) is not None
                        for n in wrap_os(self.storage.list_checkpoints, self.directory))
            check_encryption(self.directory, kind, encryption, plain, writing=False)
            self._catalog = Catalog(self.storage, self.directory_id, retention_list,
                                    read_only=True, naming=self.naming, encryption=encryption)
            wrap_os(self._catalog.reconcile, self.directory, write=False)
            self._policy: SavePolicy | None = None
            self._signals = SignalSaver(None)
            self._res = Resources(self._owner_pid, self.directory)
            self._finalizer = weakref.finalize(self, Resources.release, self._res, True)
            self._tell_supervisor("open")
            return

        coord = self._coord
        if coord is not None and not coord.leader:
            # another rank of a distributed job: the leader (rank 0) holds the directory,
            # names its checkpoints and runs retention; this rank writes its part of each
            self._res = Resources(self._owner_pid, self.directory)
            self._finalizer = weakref.finalize(self, Resources.release, self._res, True)
            lead = coord.all_gather_json({}, what=f"opening {self.directory}", op="open")[0]
            if lead.get("error"):
                self._finalizer.detach()
                raise CoordinationError(f"rank 0 could not open the checkpoint directory "
                                        f"{self.directory}: {lead['error']}")
        else:
            try:
                lock = wrap_os(self.storage.lock, self.directory)
            except BaseException as e:
                if isinstance(e, DirectoryLockedError):
                    # the steps another writer commits there are not this job's progress
                    self._tell_supervisor("locked_out")
                self._announce(error=e)
                raise
            self._res = Resources(self._owner_pid, self.directory, lock=lock)
            self._finalizer = weakref.finalize(self, Resources.release, self._res, True)
        mp = sys.modules.get("multiprocessing")
        if mp is not None and mp.parent_process() is not None:
            # a multiprocessing worker leaves through os._exit, past atexit: its own exit
            # hook commits what this manager accepted
            mp.util.Finalize(None, Resources.release, args=(self._res, True),
                             exitpriority=10)
        try:
            if coord is not None and not coord.leader:
                self.naming = resolve_naming(self.directory, Naming(*lead["naming"]),
                                             step_prefix, step_digits)
                self.directory_id = lead["id"]
                mine = wrap_os(read_identity, self.directory, self.storage, required=False)
                if mine is None or mine.directory_id != lead["id"]:
                    problem = (
                        f"rank 0's manager is for the directory with id {lead['id']} "
                        f"({lead.get('where')}), this rank's for {self.directory} (id "
                        f"{mine.directory_id if mine else 'none'}): the ranks made their "
                        "managers for different directories, or in a different order")
                else:
                    problem = None
                if problem is None:
                    try:
                        check_encryption(self.directory, mine, encryption, False)
                    except CheckpointError as e:
                        problem = str(e)
                self._joined(problem)
                self._catalog = Catalog(self.storage, self.directory_id, retention_list,
                                        read_only=True, naming=self.naming, on_save=on_save,
                                        encryption=encryption)
                wrap_os(self._catalog.reconcile, self.directory, write=False)
            else:
                try:
                    identity = read_identity(self.storage, required=True)
                    self.naming = resolve_naming(
                        self.directory, identity.naming if identity else None, step_prefix,
                        step_digits)
                    kind = wrap_os(directory_kind, self.directory, self.storage,
                                   self.naming, identity, encryption is not None)
                    if identity is None and kind is not None:
                        # checkpoints without an identity (their .pitstop/ lost or not
                        # copied): a writer still never mixes plaintext and encrypted ones
                        check_encryption(self.directory, kind, encryption, True)
                    elif identity is not None and kind is not None and \
                            kind.encryption != identity.encryption:
                        # an identity edited to record no encryption: its checkpoints' kind
                        check_encryption(self.directory, kind, encryption, True)
                        identity = kind
                        wrap_os(create_identity, self.directory, self.storage, self.naming,
                                encryption, identity.directory_id)
                    # (encrypted checkpoints are bound to their directory's id: a new
                    # identity for them takes the id they name)
                    self.directory_id = identity.directory_id if identity else \
                        wrap_os(create_identity, self.directory, self.storage, self.naming,
                                encryption, kind.directory_id if kind and kind.encryption
                                else None)
                    self._catalog = Catalog(self.storage, self.directory_id, retention_list,
                                            read_only=False, naming=self.naming,
                                            on_save=on_save, encryption=encryption)
                    if check_encryption(self.directory, identity, encryption,
                                        bool(self._catalog.committed_steps())):
                        # a plaintext directory without checkpoints: encrypted from now on
                        wrap_os(create_identity, self.directory, self.storage, self.naming,
                                encryption, self.directory_id)
                    # (after the key is checked: a refused writer changes nothing)
                    removed = wrap_os(self.storage.cleanup_incomplete, self.directory,
                                      self.naming)
                    if removed:
                        log.warning("pitstop: removed %d leftover(s) of interrupted saves in "
                                    "%s: %s", len(removed), self.directory, ", ".join(removed))
                    wrap_os(self._catalog.reconcile, self.directory, write=True)
                    try:  # what `pitstop ls` reads to say which checkpoints retention keeps
                        record_retention(self.storage, retention_list)
                    except OSError as e:  # informational: never a reason to refuse the writer
                        log.warning("pitstop: could not record the retention policy in "
                                    "%s/.pitstop/directory.json: %s", self.directory, e)
                except BaseException as e:
                    self._announce(error=e)
                    raise
                self._announce()
                if coord is not None:
                    self._joined(None)

            # memory tier
            root = memtier_mod.default_root() if memory_tier in (None, True) else (
                os.fspath(memory_tier) if isinstance(memory_tier, (str, os.PathLike))
                else None)
            if memory_tier is True and root is None:
                raise InvalidArgumentError(
                    "memory_tier=True but /dev/shm is not available; pass a directory on a "
                    "tmpfs, or memory_tier=False")
            # each rank keeps its own snapshots (a rank's part of the state)
            tier = MemoryTier(root, self.directory, self.directory_id, part="" if coord is None
                              else f"rank {coord.rank} of {coord.world_size}") if root else None
            if incremental and (coord is not None or encryption is not None):
                self._warn_once("incremental", (
                    "pitstop: incremental=True steps aside: "
                    + ("this job saves with several ranks" if coord is not None else
                       "the checkpoints are encrypted")
                    + ", and incremental checkpoints are made by one process, unencrypted "
                    "(docs/incremental.md); every save writes all its arrays. Pass "
                    "incremental=False to silence this."))
            self.pool = StagingPool(max_in_flight, tier.prefix if tier else None, _pin_hooks(),
                                    on_tier_failure=TierFallback(root) if tier else None)
            self._engine = Engine(
                self.storage, hash_algorithm=hash_algorithm, compression=compression,
                writer_threads=writer_threads or min(4, os.cpu_count() or 2), pool=self.pool,
                directory_id=self.directory_id, on_commit=self._catalog.committed, tier=tier,
                name_of=self.naming.name, copy_threads=copy_threads, coordinator=coord,
                encryption=encryption, incremental=incremental,
                lazy=snapshot == "lazy" and async_save)
            if encryption is not None and not self.read_only and (coord is None or
                                                                  coord.leader):
                # each encrypted save records its place in the directory's order of saves
                self._engine.last_seq = wrap_os(last_seq, self.directory, self.storage,
                                                self.naming)
            # a checkpoint leaving the directory is never referenced by the next save
            self._catalog.on_removed = self._engine.forget_previous
            self._engine.forget_step = self._catalog.forget  # (the leader's retention)
            self.hooks = self._engine.hooks
            self._catalog.hooks = self.hooks  # one dict: the engine's and retention's hooks
            self._res.engine, self._res.pool, self._res.tier = self._engine, self.pool, tier

            # when to save
            policies: list[SavePolicy] = []
            if save_every_steps is not None:
                policies.append(EveryNSteps(save_every_steps))
            if save_every_seconds is not None:
                policies.append(EverySeconds(save_every_seconds))
            self._auto = AutoInterval(mtbf_seconds) if mtbf_seconds else None
            if self._auto is not None:
                policies.append(self._auto)
            if keep_best is not None and best_metric:
                policies.append(OnImprovement(best_metric, best_mode, self._catalog.best_so_far(
                    best_metric, best_mode)))
            if save_policy is not None:
                policies.append(save_policy)
            self._policy = AnyOf(*policies) if policies else None

            self._signals = SignalSaver(save_on_signals)
            self._res.signals = self._signals
            if coord is not None:
                # every rank recovers the same snapshots (their persists are saves of all
                # ranks together): those that all of them still hold
                committed = self._catalog.committed_steps()
                newest = committed[-1] if committed else None
                mine = sorted(recoverable_steps(tier, newest)) if tier is not None else []
                held = coord.all_gather_json(mine, op="recover", what=f"{self.directory}: finding the "
                                             "snapshots every rank holds in memory")
                common = set.intersection(*(set(h) for h in held))
                if tier is not None:
                    self._recovered_all = recover(tier, self.pool, self._engine, newest,
                                                  only=common)
                    self._res.recovered = self._recovered_all
            elif tier is not None:
                committed = self._catalog.committed_steps()
                self._recovered_all = recover(tier, self.pool, self._engine,
                                              committed[-1] if committed else None)
                self._res.recovered = self._recovered_all
            elif memory_tier is False and (shm := memtier_mod.default_root()) is not None:
                # a killed job's snapshots would stay in /dev/shm for ever
                committed = self._catalog.committed_steps()
                discard(MemoryTier(shm, self.directory, self.directory_id,
                                   part="" if coord is None else
                                   f"rank {coord.rank} of {coord.world_size}"),
                        committed[-1] if committed else None)
            self._ctx = SaveContext(last_save_step=self.latest_step())
        except BaseException:
            self._finalizer.detach()
            self._res.release(False)
            raise
        self._tell_supervisor("open")

    # ================================================================== public API
    def step(self, step: int, state: Any, metrics: Mapping[str, Any] | None = None
             ) -> SaveHandle | None:
        """Call once per training step, at its end; saves when a policy (or a signal) says so.

        Returns the save's handle, or None on the (almost free) steps that do not save.
        """
        engine = self._writer()
        step = step_arg(step)
        fence_all()  # a lazy copy still running: done before anything else (one list check)
        engine.raise_pending()
        clean = clean_metrics(metrics, self.best_metric) if metrics is not None else None
        if self._rolled_back_to is not None:
            self._abandon_newer_than(self._rolled_back_to)  # training goes on from there
        if self._policy is None:
            self._warn_once("no-policy", NO_POLICY.format(directory=self.directory))
        if self._coord is not None:
            return self._step_world(engine, step, state, metrics, clean)
        if self._signals.pending is not None:
            return self._handle_signal(step, state, metrics)
        policy = self._policy
        if policy is None:
            return None
        ctx = self._ctx
        ctx.now = time.monotonic()
        ctx.metrics = clean or None
        if not policy.should_save(step, ctx):
            return None
        with self._api_lock:
            if step in self._catalog.index or step in engine.pending_steps():
                self._warn_once(
                    f"exists:{step}",
                    f"pitstop: step {step} already has a checkpoint in {self.directory}; it is "
                    "not overwritten and this step is not saved. A run that continues from an "
                    "older step should restore() or rollback() it through the manager, which "
                    "then moves the abandoned run's newer checkpoints aside.")
                return None
            return self._save(step, state, metrics, block=self.on_busy == "wait",
                              periodic=True)

    def _step_world(self, engine: Engine, step: int, state: Any,
                    metrics: Mapping[str, Any] | None, clean: dict[str, Any] | None
                    ) -> SaveHandle | None:
        """``step()`` of one rank: the ranks decide together, so all save the same steps."""
        want = False
        if self._policy is not None:
            ctx = self._ctx
            ctx.now = time.monotonic()
            ctx.metrics = clean or None
            want = self._policy.should_save(step, ctx)
        exists = step in self._catalog.index or step in engine.pending_steps()
        busy = want and self.on_busy != "wait" and not self.pool.can_acquire()
        # (bit 1: the step exists on a rank; bit 2: a rank's buffers are all persisting)
        want, problem, signal = self._agree(step, want, int(exists) | 2 * int(busy), "step")
        if signal:  # (one that arrives after the exchange is acted on at the next step)
            return self._handle_signal(step, state, metrics)
        if not want:
            return None
        if problem & 1:
            log.info("pitstop: step %d not saved: it exists already on a rank", step)
            return None
        if problem:  # every rank skips it together, and says so
            self._skipped(step, world=True)
            return None
        with self._api_lock:
            return self._save(step, state, metrics, block=True, periodic=True)

    def save(self, step: int, state: Any, metrics: Mapping[str, Any] | None = None, *,
             user_metadata: Mapping[str, Any] | None = None) -> SaveHandle:
        """Save now. Blocks for the snapshot only (and for a free staging buffer); the
        returned handle's ``wait()`` / ``result()`` wait for the commit. A save is a step
        boundary too: a pending SIGTERM/SIGINT is acted on right after it."""
        engine = self._writer()
        step = step_arg(step)
        fence_all()
        try:
            engine.raise_pending()
        except CheckpointError as earlier:
            # an earlier save failed: it is reported here, and this save is still attempted
            # (a loop that catches the error and goes on must not lose every other save)
            try:
                handle = self._save_now(engine, step, state, metrics, user_metadata)
            except CheckpointError as own:
                earlier.add_note(f"pitstop: step {step} was not saved either ({own}); call "
                                 f"save({step}, ...) again once the cause is fixed")
                raise earlier  # noqa: B904 (the earlier failure is what this call reports)
            earlier.handle = handle  # type: ignore[attr-defined]
            earlier.add_note(f"pitstop: this save() reports that earlier failure; its own "
                             f"step {step} was accepted all the same (its handle is the "
                             "error's .handle)")
            raise
        return self._save_now(engine, step, state, metrics, user_metadata)

    def _save_now(self, engine: Engine, step: int, state: Any,
                  metrics: Mapping[str, Any] | None,
                  user_metadata: Mapping[str, Any] | None) -> SaveHandle:
        """:meth:`save` once the earlier failures are reported."""
        if self._rolled_back_to is not None:
            self._abandon_newer_than(self._rolled_back_to)
        agreed = 0
        if self._coord is not None:
            _want, exists, agreed = self._agree(step, True, step in self._catalog.index or
                                                step in engine.pending_steps(), "save")
            if exists:
                raise StepExistsError(
                    f"{self._path(step)} already exists or is being saved (on at least one "
                    "rank); pitstop never overwrites a committed checkpoint. Save under a "
                    "new step on every rank.")
        with self._api_lock:
            if step in self._catalog.index:
                raise StepExistsError(
                    f"{self._path(step)} already exists; pitstop never "
                    "overwrites a committed checkpoint. Save under a new step, or delete it "
                    "first.")
            if step in engine.pending_steps():
                raise StepExistsError(
                    f"step {step} is already being saved to "
                    f"{self._path(step)} (by an earlier save or step() "
                    "call); pitstop never saves a step twice. mgr.wait() waits for it; to save "
                    "the final state of a run, check mgr.latest_step() != step first.")
            if (self._signals.pending is not None) if self._coord is None else agreed:
                handle = self._handle_signal(step, state, metrics, user_metadata=user_metadata)
            else:
                handle = self._save(step, state, metrics, block=True, periodic=False,
                                    user_metadata=user_metadata)
        assert handle is not None
        return handle

    def restore(self, state: Any, step: int | None = None, *, strict: bool = True
                ) -> RestoredStep | None:
        """Restore the newest valid checkpoint (or ``step``) into ``state`` in place.

        Returns the restored step (an int that also lists missing/unexpected/mismatched keys
        under ``strict=False``), or None when there is nothing to restore. Everything that
        can be checked without the data is checked before a byte reaches ``state``; a
        refused restore leaves it as it was. A corrupt newest checkpoint is reported and the
        previous valid one used; an explicit ``step`` raises.
        """
        self._check_usable()
        step = None if step is None else step_arg(step)
        if step is not None and step in self._abandoned:
            # asked for by number: this run goes on from there after all
            self._abandoned, self._rolled_back_to = set(), None
        restored, report, _flat = self._restore_into(state, step, strict, detached=False)
        self._tell_supervisor("restore", step=restored)
        if restored is None:
            return None
        assert report is not None
        self._restored(restored, explicit=step is not None)
        return RestoredStep(restored, report)

    def _restore_into(self, state: Any, step: int | None, strict: bool, *, detached: bool
                      ) -> tuple[int | None, RestoreReport | None, FlatState]:
        """The newest valid checkpoint (or ``step``) put into ``state``: from the memory tier
        when its snapshot is the one asked for, else from disk. ``detached``: a state made
        for ``load(target=...)``, whose root may be replaced (the new one: ``flat.root``)."""
        fence_all()  # a lazy copy must read the state before the restore writes it
        recovered = self._recovered_at(step)
        from_memory = recovered is not None
        engine = self._engine
        if engine is not None and not from_memory:
            engine.drain()  # a save still persisting may be the newest
        # the cyclic GC would rescan a large heap again and again while the restore
        # allocates a few objects per array
        with _no_gc():
            flat = wrap_os(flatten, self.directory, state, self._resolve)
            flat.detached = detached
            restored: int | None = None
            report: RestoreReport | None = None
            if from_memory:
                # straight from the verified shared-memory copy, while its persist to disk
                # goes on in the background: no waiting for the disk
                assert recovered is not None
                restored, report = self._restore_recovered(recovered, flat, strict)
            if restored is None:
                if engine is not None and from_memory:
                    engine.drain()
                if self._coord is not None:
                    restored, report = self._restore_world(flat, step, strict, self._coord)
                else:
                    restored, report = self._restore_from_disk(flat, step, strict)
        return restored, report, flat

    def rollback(self, state: Any) -> RestoredStep | None:
        """Restore the newest checkpoint whose arrays were all finite (non-finite guard)."""
        self._check_usable()
        if self._engine is not None:
            self._engine.drain()  # a save still persisting may be the newest finite one
        finite = [s for s in self._catalog.finite_steps() if s in set(self._committed())]
        if not finite:
            if self._committed():
                raise CheckpointNotFoundError(
                    f"rollback() found no checkpoint in {self.directory} known to hold only "
                    "finite values: only saves made with nonfinite_guard=True are checked. "
                    "Use restore(state, step=N) to go back to a step you choose.")
            return None
        return self.restore(state, step=finite[-1])

    def load(self, step: int | None = None, *, target: Any = None) -> Any:
        """The newest valid checkpoint (or ``step``) as a new object.

        Without ``target``: a fresh nested dict of numpy arrays and values. With ``target``
        (a state of the saved structure, e.g. a JAX pytree or a tree of
        ``jax.ShapeDtypeStruct``): a new object of that structure, each array made as the
        target's says (type, device, sharding); ``target`` itself is left as it is, except
        objects an adapter restores in place (a torch module)."""
        self._check_usable()
        step = None if step is None else step_arg(step)
        if target is not None:
            fresh = _skeleton(target, self._resolve)
            restored, _report, flat = self._restore_into(fresh, step, True, detached=True)
            self._tell_supervisor("restore", step=restored)
            if restored is None:
                raise CheckpointNotFoundError(f"no checkpoint in {self.directory}")
            return flat.root
        fence_all()
        recovered = self._recovered_at(step)
        if recovered is not None and (step is not None or self.latest_step() == recovered.step):
            loaded = recovered.reader.load()
            self._tell_supervisor("restore", step=recovered.step)
            return loaded
        if self._engine is not None:
            self._engine.drain()
        steps = self._committed(hidden=step is not None)
        if step is not None and step not in steps:
            raise CheckpointNotFoundError(
                f"no checkpoint of step {step} in {self.directory} (have: {steps[-10:]})")
        last: Exception | None = None
        vanished: list[int] = []
        for s in [step] if step is not None else self._newest_first(vanished):
            try:
                with self.storage.read_lease(self.naming.name(s)), _no_gc():
                    reader = CheckpointReader(self.storage, self.naming.name(s),
                                              naming=self.naming, encryption=self.encryption,
                                              directory_id=self.directory_id)
                    if step is None:  # the newest: never one of an abandoned run put back
                        self._catalog.check_replay(reader.manifest, reader.where)
                    self._use_rank(reader)
                    loaded = reader.load()
                self._tell_supervisor("restore", step=s)
                return loaded
            except (CorruptCheckpointError, UnsupportedFormatError) as e:
                if isinstance(e, CorruptCheckpointError):
                    self._distrust_previous()
                if step is not None:
                    gone = self._gone(step, e)
                    if gone is None:
                        raise
                    raise gone from e
                if s not in self._committed():
                    vanished.append(s)  # deleted meanwhile (another writer's retention)
                    continue
                warnings.warn(f"pitstop: skipping unreadable checkpoint: {e}", stacklevel=2)
                last = e
            except OSError as e:
                raise CheckpointError(f"cannot read {self._path(s)}: "
                                      f"{e}") from e
        if isinstance(last, UnsupportedFormatError):
            raise last
        if last is not None:
            raise CheckpointNotFoundError(
                f"no valid checkpoint in {self.directory}: every one failed to load (the "
                f"oldest tried: {last})") from last
        raise CheckpointNotFoundError(f"no checkpoint in {self.directory}")

    def latest_step(self) -> int | None:
        """The step ``restore()`` / ``load()`` would return: the newest committed step, or a
        newer one still being saved (they wait for it) or recovered from the memory tier."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """Committed steps, and steps being saved or recovered from memory, oldest first."""
        self._check_usable()
        # saves under way first: one that commits meanwhile is then on disk when listed
        steps = self._engine.pending_steps() if self._engine is not None else set()
        steps |= set(self._committed())
        steps.update(r.step for r in self._recovered_all)
        return sorted(steps)

    def delete(self, step: int) -> None:
        """Delete the committed checkpoint of ``step`` (waiting for it if it is being saved),
        e.g. to write that step again; only checkpoints this directory's runs wrote."""
        engine = self._writer()
        step = step_arg(step)
        with self._api_lock:
            if step in engine.pending_steps() or engine.incremental:
                # (incremental: a save in flight may reference the checkpoint to delete)
                engine.drain()
            if self._coord is not None:
                self._delete_world(step, self._coord)
                return
            if step not in self._committed(hidden=True):
                raise CheckpointNotFoundError(f"no checkpoint of step {step} in {self.directory}")
            self._catalog.delete(step)
            self._recovered_all = self._res.recovered = [
                r for r in self._recovered_all if r.step != step]

    def _delete_world(self, step: int, coord: Coordinator) -> None:
        """``delete(step)`` on every rank: the leader deletes, the others forget the step."""
        where = f"delete({step}) in {self.directory}"
        steps = coord.all_gather_json(step, what=where, op="delete")
        if len(set(steps)) > 1:
            raise CoordinationError(
                f"delete() was called for different steps on the ranks ({steps}); nothing "
                "was deleted")
        error: CheckpointError | None = None
        if coord.leader:
            try:
                if step not in self._committed(hidden=True):
                    raise CheckpointNotFoundError(
                        f"no checkpoint of step {step} in {self.directory}")
                self._catalog.delete(step)
            except CheckpointError as e:
                error = e
        lead = coord.all_gather_json(None if error is None else str(error), what=where,
                                     op="deleted")[0]
        if error is not None:
            raise error
        if lead:
            raise CheckpointError(f"rank 0 could not delete step {step}: {lead}")
        if not coord.leader:
            self._catalog.forget(step)
        self._recovered_all = self._res.recovered = [
            r for r in self._recovered_all if r.step != step]

    def metadata(self, step: int) -> Manifest:
        """The parsed manifest of one checkpoint (metrics, user metadata, arrays)."""
        self._check_usable()
        step = step_arg(step)
        recovered = self._recovered_at(step)
        if recovered is not None and step not in self._catalog.index:
            return recovered.reader.manifest
        if self._engine is not None and step in self._engine.pending_steps():
            self._engine.drain()
        if step not in self._committed(hidden=True):
            raise CheckpointNotFoundError(f"no checkpoint of step {step} in {self.directory}")
        try:
            return CheckpointReader(self.storage, self.naming.name(step), naming=self.naming,
                                    encryption=self.encryption,
                                    directory_id=self.directory_id).manifest
        except CorruptCheckpointError as e:
            gone = self._gone(step, e)
            if gone is None:
                raise
            raise gone from e

    def _gone(self, step: int, e: CheckpointError) -> CheckpointNotFoundError | None:
        """A checkpoint asked for by number that vanished before a byte of it was read
        (another process's retention or ``delete()`` between the listing and the read): not
        found, rather than "corrupt"; None when it is still there (or the target changed)."""
        if not isinstance(e, CorruptCheckpointError) or e.overwritten or \
                step in self._committed(hidden=True):
            return None
        return CheckpointNotFoundError(
            f"the checkpoint of step {step} in {self.directory} was deleted while it was "
            "being opened (by the writer's retention or delete(), in another process); "
            f"have: {self._committed(hidden=True)[-10:]}")

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every pending save to commit; raises a background failure not yet
        reported (each is reported once)."""
        self._check_usable()
        timeout = check_timeout(timeout)
        fence_all()
        if self._engine is not None:
            self._engine.drain(timeout)
            self._engine.raise_pending()

    # ------------------------------------------------------------ the names Orbax users call
    def wait_until_finished(self) -> None:
        """Orbax's name for :meth:`wait`: block until every save accepted is committed."""
        self.wait()

    def should_save(self, step: int, metrics: Mapping[str, Any] | None = None) -> bool:
        """Whether ``step(step, state, metrics)`` would save at this step (Orbax's
        ``should_save``): a save policy says so, or a signal was received, and the step has
        no checkpoint yet. It decides nothing and asks no other rank (``step()`` decides
        with them); a manager without ``save_every_steps`` / ``save_every_seconds`` /
        ``mtbf_seconds`` / ``keep_best`` / ``save_policy`` says False but on a signal.

        In a job of several ranks every rank calls it at the same step, as Orbax's (a sync
        point of all processes): the ranks answer together, True when any rank's policy or
        signal says so, so ``if mgr.should_save(s): mgr.save(s, state)`` saves on all."""
        self._check_usable()
        step = step_arg(step)
        engine = self._engine
        if engine is None or self._closed:
            return False  # read-only (as Orbax's read_only manager) or closed
        exists = step in self._catalog.index or step in engine.pending_steps()
        want = self._signals.pending is not None
        if not exists and not want and self._policy is not None:
            ctx = self._ctx
            clean = clean_metrics(metrics, self.best_metric) if metrics is not None else None
            probe = SaveContext(last_save_step=ctx.last_save_step,
                                last_save_time=ctx.last_save_time, now=time.monotonic(),
                                metrics=clean or None, save_cost_s=ctx.save_cost_s)
            want = bool(self._policy.should_save(step, probe))
        if self._coord is not None:
            any_want, problem, signal = self._agree(step, want, int(exists), "should_save")
            return (any_want or bool(signal)) and not problem & 1
        return want and not exists

    def best_step(self) -> int | None:
        """The checkpoint with the best ``best_metric`` (``best_mode``; the newest of equal
        ones), as Orbax's ``best_step`` ranks by ``best_fn``: the steps retention keeps, saves
        in flight waited for. Without ``best_metric``: :meth:`latest_step`, as Orbax without
        ``best_fn``. None when no checkpoint has a number for the metric."""
        self._check_usable()
        metric = self.best_metric
        if not metric:
            return self.latest_step()
        if self._engine is not None:
            self._engine.drain()  # a save in flight counts, as in Orbax
        index = self._catalog.index
        scored = []
        for s in self._committed():
            info = index.get(s)
            v = None if info is None else info.metrics.get(metric)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                scored.append(((v if self.best_mode == "min" else -v), -s, s))
        for r in self._recovered_all:  # recovered from the memory tier, not yet on disk
            v = r.reader.manifest.metrics.get(metric)
            if r.step not in index and isinstance(v, (int, float)) and \
                    not isinstance(v, bool) and math.isfinite(v):
                scored.append(((v if self.best_mode == "min" else -v), -r.step, r.step))
        return min(scored)[2] if scored else None

    def reached_preemption(self, step: int) -> bool:
        """True when a terminating signal (SIGTERM, SIGINT: a preemption notice) was received
        and not yet acted on: the next ``step()`` or ``save()`` saves this step, waits for
        its commit and exits as the signal asks (Orbax's ``reached_preemption``, tied to
        pitstop's ``save_on_signals``). In a job of several ranks every rank must call it
        at the same step, as Orbax's sync point: a signal any rank received is every rank's
        answer (and every rank's save at the next step boundary)."""
        self._check_usable()
        step = step_arg(step)
        if self._coord is not None and self._engine is not None and not self._closed:
            self._agree(step, False, False, "reached_preemption")
        pending = self._signals.pending
        return pending is not None and signal_name(pending) not in CONTINUE_SIGNALS

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (also after a terminating signal's save)."""
        return self._closed

    def close(self) -> None:
        """Wait for pending saves, release the directory and the memory tier.

        In a forked child this does nothing: the manager and all it holds are the parent's.
        """
        if os.getpid() != self._owner_pid:
            return
        with self._api_lock:  # a save under way on another thread submits first
            if self._closed:
                return
            self._closed = True
        fence_all()
        self._flatten_cache.clear()  # (it references the last save's arrays)
        if self._skips.count:
            if self._engine is not None:
                self._engine.drain()
            self._skips.closing(self.directory)
            if self._coord is None or self._coord.leader:
                self._skips.record(self.storage)
        self._finalizer.detach()
        error = self._res.release(False)
        if self._coord is not None and not isinstance(self._distributed, Coordinator):
            self._coord.close()  # the groups this manager made
        # a terminating signal that arrived after the last step() or while the saves above
        # were committed: pitstop only deferred it
        pending = self._signals.pending
        self._signals.pending = None
        if pending is not None and signal_name(pending) not in CONTINUE_SIGNALS:
            if error is not None:
                log.error("pitstop: %s", error)
            log.warning("pitstop: %s received after the last step; pending saves are "
                        "committed, acting on it now", signal_name(pending))
            self._signals.exit_like(pending)
        if error is not None:
            raise error

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if os.getpid() != self._owner_pid:
            return  # a forked child leaving `with mgr:` touches nothing of the parent's
        if self._signals.abandoned:
            # a second Ctrl+C while the signal's save persisted: the user wants out now.
            # Do not wait for it; close() can still be called later to wait and release.
            saving = sorted(self._engine.pending_steps()) if self._engine else []
            if saving:
                log.warning("pitstop: interrupted twice; not waiting for the save of step(s) "
                            "%s (its snapshot stays in the memory tier when that is on)",
                            saving)
            else:
                log.warning("pitstop: interrupted twice before the next step boundary; "
                            "exiting without a save (the newest committed step is %s)",
                            self.latest_step())
            return
        if exc_type is not None and self._engine is not None:
            # the last consistent state is the last snapshot taken at a step boundary:
            # make sure it is committed before the exception propagates
            self._engine.drain()
            pending = self._signals.pending
            if pending is not None:
                log.error("pitstop: %s", lost_signal_message(pending, self._signals, exc,
                                                               self._committed()))
                self._signals.pending = None
            elif not isinstance(exc, (KeyboardInterrupt, CheckpointError)):
                log.warning("pitstop: leaving the `with` block on %s; the newest committed "
                            "step is %s", exc_type.__name__, self.latest_step())
            try:
                self.close()
            except CheckpointError as e:
                log.error("pitstop: %s", e)
            return
        self.close()

    # ================================================================== saving
    def _save(self, step: int, state: Any, metrics: Mapping[str, Any] | None, *, block: bool,
              periodic: bool, user_metadata: Mapping[str, Any] | None = None
              ) -> SaveHandle | None:
        engine = self._engine
        assert engine is not None
        clean = clean_metrics(metrics, self.best_metric)
        user_meta = check_user_metadata(user_metadata)
        if self._recovered_all:  # first save after a recovery
            # the recovered snapshots may still be persisting from those very buffers: let
            # them commit before a new snapshot may overwrite one
            engine.drain()
            for r in self._recovered_all:
                self.pool.release(r.buffer)
            self._recovered_all = self._res.recovered = []
        if self._rolled_back_to is not None:
            self._abandon_newer_than(self._rolled_back_to)
        stats = SaveStats(step=step)
        handle = SaveHandle(step, stats)
        nonfinite = self.nonfinite_guard and any(
            isinstance(v, float) and not math.isfinite(v) for v in clean.values())
        if nonfinite and self._coord is None:
            stats.skipped = "non-finite metrics (non-finite guard)"
            log.warning("pitstop: step %d not saved: %s", step, stats.skipped)
            handle._finish()
            return handle
        t0 = time.perf_counter()
        try:
            with _no_gc():  # the cyclic GC would rescan the heap while we allocate leaves
                flat = flatten(state, self._resolve, self._flatten_cache)
                if flat.caveats:
                    self._warn_caveats(flat)
                values = flat.encoded  # made now: later changes to the state are not saved
                buf = engine.snapshot(flat, step, block=block or not periodic)
        except BaseException as e:
            if self._coord is not None:
                # the other ranks are saving this step: tell them it failed here, rather
                # than let them wait for this rank until their timeout
                engine.submit(PersistJob(step=step, buffer=None, values={}, structure=None,
                                         metrics={}, handle=SaveHandle(step, stats),
                                         failed=f"{type(e).__name__}: {e}"))
            raise
        if buf is None:
            stats.skipped = "previous save still persisting (on_busy='skip')"
            self._skipped(step)
            handle._finish()
            return None if periodic else handle
        stats.skipped_before = self._skips.saved()
        stats.stall_s = time.perf_counter() - t0
        stats.bytes = buf.layout.total
        stats.arrays = len(flat.arrays)
        job = PersistJob(step=step, buffer=buf, values=values, structure=flat.structure,
                         metrics=clean, handle=handle, user_metadata=user_meta,
                         check_finite=self.nonfinite_guard, nonfinite_metrics=nonfinite,
                         global_shapes={k: list(flat.arrays[k].shape) for k in flat.sharded}
                         if self._coord is not None else {},
                         frameworks=self._frameworks_of(flat), layouts=flat.layouts())
        # recorded before the persist starts: on_save must find these figures, not blanks
        self.stats.append(stats)
        if len(self.stats) > 1000:
            del self.stats[:500]
        try:
            engine.submit(job)
        except BaseException:
            engine.release_snapshot(buf)
            raise
        ctx = self._ctx
        ctx.last_save_step = step
        ctx.last_save_time = time.monotonic()
        if self._policy is not None:
            ctx.metrics = clean
            saved = getattr(self._policy, "saved", None)
            if saved is not None:
                saved(step, ctx)
        if self._auto is not None:
            # a lazy save's cost is mostly its background copy (it competes with training
            # and the next optimizer step may wait for it): the last finished one's duration
            lazy_s = next((s.lazy_copy_s for s in reversed(self.stats[-8:]) if s.lazy_copy_s),
                          0.0) if engine.lazy else 0.0
            self._auto.update(stats.stall_s + lazy_s)
        if not self.async_save:
            handle.wait()  # raises the failure right here (and only here)
        return handle

    def _skipped(self, step: int, *, world: bool = False) -> None:
        """A periodic save of ``step`` dropped as busy: counted, warned (rate-limited) and
        recorded by the leader in directory.json after the next commit."""
        self._skips.note(step, self.directory, world=world)
        if self._coord is None or self._coord.leader:
            self._catalog.skips = self._skips

    @property
    def skipped_saves(self) -> int:
        """Periodic saves this manager skipped because the previous one was still
        persisting (``on_busy="skip"``); each one was warned about (rate-limited)."""
        return self._skips.count

    @property
    def skipped_steps(self) -> list[int]:
        """The steps of those skipped saves, oldest first (the newest 1000)."""
        return list(self._skips.steps)

    def _frameworks_of(self, flat: FlatState) -> dict[str, str]:
        """The frameworks that captured ``flat`` (the manifest's writer["frameworks"]),
        looked up once per distinct set of adapters."""
        key = frozenset(flat.used)
        known = self._frameworks.get(key)
        if known is None:
            from pitstop.core.adapter import frameworks_of
            known = self._frameworks[key] = frameworks_of(key)
        return known

    def _warn_caveats(self, flat: FlatState) -> None:
        """What an adapter cannot capture exactly is said once, at the first save showing it."""
        for text in flat.caveats:
            self._warn_once(f"caveat:{text}", f"pitstop: {text}")

    def _warn_once(self, key: str, text: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        log.warning("%s", text)
        warnings.warn(text, stacklevel=4)

    def _abandon_newer_than(self, restored: int) -> None:
        """The run continues from ``restored``: move the abandoned run's newer checkpoints
        aside (never deleted), so none of them comes back as the newest."""
        assert self._engine is not None
        self._engine.drain()
        self._rolled_back_to = None
        self._abandoned = set()
        if self._coord is not None and not self._coord.leader:
            for s in [s for s in self._catalog.index if s > restored]:
                self._catalog.forget(s)  # the leader moves them aside
            return
        newer = [s for s in self._committed() if s > restored]
        moved = []
        # newest first: one that references an older one's data never outlives it
        for s in sorted(newer, reverse=True):
            new = self._catalog.move_aside(s, "abandoned")
            if new is not None:
                moved.append(f"{self.naming.name(s)} -> {new}")
        moved.reverse()
        if moved:
            self._warn_once(
                f"abandoned:{restored}:{newer}",
                f"pitstop: this run continues from step {restored}, so the checkpoints of the "
                f"run it abandoned were moved aside in {self.directory}: {', '.join(moved)}. "
                "pitstop keeps them (they are no longer restored); delete them when you no "
                "longer need them.")

    # ================================================================== restoring
    def _restored(self, restored: int, *, explicit: bool) -> None:
        if self._engine is None:
            return
        self._ctx.last_save_step = restored
        self._ctx.last_save_time = time.monotonic()
        if not explicit:
            return  # the newest valid one: newer ones are corrupt (moved aside) or unreadable
        # the newer checkpoints belong to a run this one abandons: from now on this manager
        # names and restores none of them, and the run's first step or save moves them aside
        # (the index too: another rank's leader may already be moving them aside)
        newer = sorted(s for s in set(self._committed(hidden=True)) | set(self._catalog.index)
                       if s > restored)
        self._rolled_back_to = restored if newer else None
        self._abandoned = set(newer)

    def _recovered_at(self, step: int | None) -> Recovered | None:
        """The recovered snapshot of ``step`` (the newest one for None), if any."""
        if not self._recovered_all:
            return None
        if step is None:
            return self._recovered_all[-1]
        return next((r for r in self._recovered_all if r.step == step), None)

    def _restore_recovered(self, recovered: Recovered, flat: FlatState, strict: bool
                           ) -> tuple[int | None, RestoreReport | None]:
        committed = self._committed()
        if committed and committed[-1] > recovered.step:
            return None, None
        report = recovered.reader.restore_into(flat, strict)
        log.warning("pitstop: restored step %d from the memory tier", recovered.step)
        # the buffer stays held (its persist may still be reading it) until the next save
        # or close() releases it
        return recovered.step, report

    def _restore_from_disk(self, flat: FlatState, step: int | None, strict: bool
                           ) -> tuple[int | None, RestoreReport | None]:
        if step is not None:
            steps = self._committed(hidden=True)
            if step not in steps:
                raise CheckpointNotFoundError(
                    f"no checkpoint of step {step} in {self.directory} (have: {steps[-10:]})")
            try:
                return step, self._restore_one(step, flat, strict)
            except CorruptCheckpointError as e:
                gone = self._gone(step, e)
                if gone is None:
                    raise
                raise gone from e
        newer: UnsupportedFormatError | None = None
        corrupt: list[CorruptCheckpointError] = []
        vanished: list[int] = []
        for s in self._newest_first(vanished):
            try:
                report = self._restore_one(s, flat, strict, newest=True)
            except CorruptCheckpointError as e:
                if not e.overwritten and s not in self._committed():
                    vanished.append(s)  # deleted meanwhile (another writer's retention)
                    continue
                msg = (f"pitstop: checkpoint {self._path(s)} is corrupt "
                       f"({e}); falling back to the previous one")
                log.error(msg)
                warnings.warn(msg, stacklevel=3)
                corrupt.append(e)
                if not e.linked:
                    self._quarantine(s)
                continue
            except UnsupportedFormatError as e:
                # written by a newer pitstop: not corrupt, so never moved aside
                msg = (f"pitstop: cannot read checkpoint {self._path(s)} "
                       f"({e}); falling back to the previous one")
                log.error(msg)
                warnings.warn(msg, stacklevel=3)
                newer = newer or e
                continue
            except IncompatibleTargetError as e:
                if corrupt and any(c.overwritten for c in corrupt):
                    # the target is no longer as it was: not an "unchanged" refusal
                    why = "\n".join(str(e).splitlines()[1:-1]) or str(e)
                    err = CorruptCheckpointError(
                        f"{corrupt[0]}\nThe previous checkpoint, step {s}, cannot complete the "
                        f"restore:\n{why}", checkpoint=corrupt[0].checkpoint,
                        key=corrupt[0].key, file=corrupt[0].file)
                    err.overwritten = sorted({k for c in corrupt for k in c.overwritten})
                    raise err from e
                raise
            leftover = sorted({k for c in corrupt for k in c.overwritten} - set(report.written))
            if leftover:
                err = CorruptCheckpointError(
                    f"restored step {s} after newer checkpoints failed verification, but these "
                    f"entries of the target still hold bytes of a corrupt checkpoint, as step {s} "
                    f"has no value for them: {_overwritten_keys(leftover)}. Restore into a "
                    "state that matches the saved one.", checkpoint=self.directory)
                err.overwritten = leftover
                raise err
            if corrupt and any(c.overwritten for c in corrupt):
                log.warning("pitstop: step %d overwrote everything the corrupt newer "
                            "checkpoint had written", s)
            return s, report
        if newer is not None:
            raise newer  # nothing older to use: never start from scratch silently
        if corrupt:
            # checkpoints existed but none is valid: starting from scratch must be the user's
            # decision, not a silent one
            written = _overwritten(corrupt)
            kept = sum(c.linked for c in corrupt)
            err = CorruptCheckpointError(
                f"no valid checkpoint in {self.directory}: all {len(corrupt)} failed "
                f"verification ({'; '.join(str(c) for c in corrupt[:3])}). " + (
                    f"They were moved aside as {self.naming.prefix}*.corrupt-*; restore() "
                    "again starts from scratch." if not kept else
                    f"{kept} of them hold a file with a second name (a hard link): left in "
                    "place, not moved aside. Break the links (remove the linked copy, or "
                    "replace it with one made by cp -a) and restore() again; the others "
                    f"were moved aside as {self.naming.prefix}*.corrupt-*.")
                + (f" The target already holds bytes of a corrupt checkpoint in: {written}; "
                   "rebuild it before training from scratch." if written else ""),
                checkpoint=self.directory)
            err.overwritten = sorted({k for c in corrupt for k in c.overwritten})
            raise err
        return None, None

    def _newest_first(self, vanished: list[int]) -> Iterator[int]:
        """Committed steps, newest first, for a restore or load of the newest. When the
        caller finds the step it tried deleted meanwhile (``vanished`` grows: another
        process's retention, after committing a newer one), the directory is listed again,
        so a reader never concludes there is nothing (or only an older step) to read."""
        tried: set[int] = set()
        again = 2
        while True:
            seen = len(vanished)
            new = False
            for s in reversed(self._committed()):
                if s in tried:
                    continue
                new = True
                tried.add(s)
                yield s
                if len(vanished) != seen:
                    break  # list again: newer steps may have been committed
            else:
                if new or not again:
                    return
                # nothing (new) listed: a listing is not atomic (the entries, then each
                # manifest), so one made while retention deleted the step it saw, after
                # committing one it did not see yet, comes back short; the next one sees it
                again -= 1

    def _restore_world(self, flat: FlatState, step: int | None, strict: bool,
                       coord: Coordinator) -> tuple[int | None, RestoreReport | None]:
        """The restore of one rank: every rank restores the same step. A checkpoint that any
        rank finds corrupt (or unreadable) is given up by all of them, which then take the
        previous one together; any other refusal stops every rank."""
        asked = coord.all_gather_json([step, self._committed(hidden=step is not None)],
                                      what=f"restoring from {self.directory}", op="restore")
        if len({json.dumps(a[0]) for a in asked}) > 1:
            wanted = ", ".join(f"rank {r}: {'the newest' if a[0] is None else f'step {a[0]}'}"
                               for r, a in enumerate(asked))
            raise CoordinationError(
                f"restore() from {self.directory} asked for different steps on the ranks "
                f"({wanted}); nothing was restored. Every rank must resume from the same step")
        lead = asked[0][1]
        if step is not None and step not in lead:
            raise CheckpointNotFoundError(
                f"no checkpoint of step {step} in {self.directory} (have: {lead[-10:]})")
        corrupt = linked = 0
        for s in [step] if step is not None else reversed(lead):
            outcome, report = "ok", None
            error: CheckpointError | None = None
            told: list[bool] = [False]

            def checked(problem: CheckpointError | None, s: int = s,
                        told: list[bool] = told) -> None:
                """Every rank's checks done: a refusal anywhere stops all before a byte is
                written."""
                told[0] = True
                said = coord.all_gather_json(
                    None if problem is None else [_kind_of(problem), str(problem)],
                    op="restore-check", what=f"restoring step {s} from {self.directory}")
                others = [(r, p) for r, p in enumerate(said) if p and r != coord.rank]
                if problem is None and others:
                    err = CoordinationError(
                        f"restoring step {s} from {self.directory}: nothing was restored, "
                        "because " + "; ".join(f"rank {r}: {p[1]}" for r, p in others))
                    err.other_rank = True  # type: ignore[attr-defined]
                    raise err

            try:
                try:
                    report = self._restore_one(s, flat, strict, checked, newest=True)
                except CheckpointError as e:
                    if not told[0]:
                        checked(e)  # failed before its checks: the others learn it there
                    raise
            except CoordinationError as e:
                outcome, error = "skipped" if getattr(e, "other_rank", False) else "refused", e
            except CorruptCheckpointError as e:
                outcome, error = "linked" if e.linked else "corrupt", e
            except UnsupportedFormatError as e:
                outcome, error = "newer", e
            except CheckpointError as e:
                outcome, error = "refused", e
            said = coord.all_gather_json([outcome, None if error is None else str(error)],
                                         op="restore-step",
                                         what=f"restoring step {s} from {self.directory}")
            bad = [(r, o, why) for r, (o, why) in enumerate(said) if o not in ("ok", "skipped")]
            if not bad:
                return s, report
            text = "; ".join(f"rank {r}: {why}" for r, _o, why in bad)
            if step is not None or any(o == "refused" for _r, o, _w in bad):
                if error is not None:
                    raise error
                raise CoordinationError(
                    f"the restore of step {s} from {self.directory} failed on other ranks "
                    f"({text}); every rank of a job must resume from the same step")
            msg = (f"pitstop: checkpoint {self._path(s)} could not be restored on every rank "
                   f"({text}); all ranks fall back to the previous one")
            log.error(msg)
            warnings.warn(msg, stacklevel=4)
            if any(o == "linked" for _r, o, _w in bad):
                linked += 1  # a file with a second name: refused, left in place
            elif any(o == "corrupt" for _r, o, _w in bad):
                corrupt += 1
                if coord.leader:
                    self._quarantine(s)
                else:
                    self._catalog.forget(s)  # the leader moves it aside
        if corrupt or linked:
            raise CorruptCheckpointError(
                f"no valid checkpoint in {self.directory}: {corrupt + linked} failed "
                "verification on a rank" + (
                    f"; {linked} hold a file with a second name (a hard link): left in place, "
                    "not moved aside. Break the links (remove the linked copy, or replace it "
                    "with one made by cp -a) and restore() again" if linked else
                    " (moved aside); restore() again starts from scratch"),
                checkpoint=self.directory)
        return None, None

    def _restore_one(self, step: int, flat: FlatState, strict: bool,
                     checked: Callable[[CheckpointError | None], None] | None = None,
                     newest: bool = False) -> RestoreReport:
        name = self.naming.name(step)

        def read(storage: Any) -> RestoreReport:
            with self.storage.read_lease(name):
                reader = CheckpointReader(storage, name, naming=self.naming,
                                          encryption=self.encryption,
                                          directory_id=self.directory_id)
                if newest:  # never a checkpoint of an abandoned run put back in place
                    self._catalog.check_replay(reader.manifest, reader.where)
                self._use_rank(reader)
                return reader.restore_into(flat, strict, checked)

        staged = self._engine.hold_staged(name) if self._engine is not None else None
        if staged is not None:
            # written from a staging buffer no save has taken since: read the data from it
            # (hash-verified against the committed manifest like any read); from disk if
            # that fails in any way
            buf, files = staged
            try:
                return read(StagedStorage(self.storage, name, buf.buf, files))
            except CorruptCheckpointError as e:
                log.warning("pitstop: the staging buffer step %d was written from no longer "
                            "matches the checkpoint (%s); reading it from %s instead",
                            step, e, self._path(step))
            except OSError:
                pass  # the same read from disk says what is wrong, below
            finally:
                self.pool.release(buf)
        try:
            return read(self.storage)
        except CorruptCheckpointError:
            self._distrust_previous()
            raise
        except OSError as e:
            raise CheckpointError(f"cannot read {self.storage.path_of(name)}: "
                                  f"{type(e).__name__}: {e}") from e

    def _tell_supervisor(self, event: str, **fields: Any) -> None:
        """Tell ``pitstop run`` (when the job runs under it) what this manager did; never
        raises (see :mod:`.supervised`)."""
        if os.environ.get(supervised.ENV):
            supervised.report(event, dir=self.directory, read_only=self.read_only,
                              rank=self._rank_world[0], **fields)

    def report_restored(self, step: int | None) -> None:
        """Tell ``pitstop run`` (when the job runs under it) the step this job resumed from,
        None for a fresh start: for a face that restores by its own means (tf.train's
        ``CheckpointManager``, Keras's ``BackupAndRestore``). Never raises."""
        self._tell_supervisor("restore", step=step)

    def _distrust_previous(self) -> None:
        """A read found damaged bytes (in a checkpoint or in a holder it references): an
        incremental save must not reference the last commit's bytes any more, which may be
        those very bytes; the next save writes every array again."""
        if self._engine is not None:
            self._engine.forget_previous()

    def _quarantine(self, step: int) -> None:
        """Move a corrupt checkpoint aside (never deleted) so later saves can reuse its step."""
        name = self.naming.name(step)
        new = self._catalog.move_aside(step, "corrupt")
        if new is None:
            if not self.read_only:
                log.warning("pitstop: corrupt checkpoint %s stays in place", name)
            return
        log.warning("pitstop: moved corrupt checkpoint %s aside to %s", name, new)

    # ================================================================== signals
    def _handle_signal(self, step: int, state: Any, metrics: Mapping[str, Any] | None, *,
                       user_metadata: Mapping[str, Any] | None = None) -> SaveHandle | None:
        signals = self._signals
        signum = signals.take()
        assert signum is not None and self._engine is not None
        name = signal_name(signum)
        try:
            # a group signal kills a plain DataLoader's workers during this save: torch's
            # SIGCHLD handler must not fail it
            with child_signals_held():
                return self._save_for_signal(signals, signum, name, step, state, metrics,
                                             user_metadata)
        finally:
            signals.handling = None

    def _save_for_signal(self, signals: SignalSaver, signum: int, name: str, step: int,
                         state: Any, metrics: Mapping[str, Any] | None,
                         user_metadata: Mapping[str, Any] | None) -> SaveHandle | None:
        assert self._engine is not None
        taken = True  # False: this step's save could not even be started
        with self._api_lock:
            handle = None
            if step not in self._catalog.index and step not in self._engine.pending_steps():
                try:
                    handle = self._save(step, state, metrics, block=True, periodic=False,
                                        user_metadata=user_metadata)
                except CheckpointError as e:
                    if name in CONTINUE_SIGNALS:
                        raise
                    taken = False
                    log.error("pitstop: the save of step %d for %s could not be taken "
                              "(%s); exiting as the signal asks without it", step, name, e)
        if name in CONTINUE_SIGNALS:
            self.wait()
            log.warning("pitstop: saved step %d after %s", step, name)
            return handle
        try:
            self.wait()
            if taken:
                log.warning("pitstop: saved step %d after %s", step, name)
        except CheckpointError as e:
            # the signal is still honoured: a loop that tolerates checkpoint errors must
            # not train on after a preemption notice
            log.error("pitstop: the save of step %d for %s failed (%s); exiting as the "
                      "signal asks without it", step, name, e)
        try:
            self.close()
        except CheckpointError as e:
            log.error("pitstop: %s", e)
        signals.exit_like(signum)
        return handle

    # ================================================================== several ranks
    def _announce(self, error: BaseException | None = None) -> None:
        """The leader tells the other ranks how the directory is (or why it could not be)
        opened; they wait for it in their constructors."""
        coord = self._coord
        if coord is None:
            return
        if error is not None:
            with contextlib.suppress(CheckpointError):
                coord.all_gather_json({"error": f"{type(error).__name__}: {error}"},
                                      what=f"opening {self.directory}", op="open")
            return
        coord.all_gather_json({"id": self.directory_id, "where": self.directory,
                               "naming": [self.naming.prefix, self.naming.digits]},
                              what=f"opening {self.directory}", op="open")

    def _joined(self, problem: str | None) -> None:
        """Every rank says whether it opened the leader's directory: a mismatch (managers
        made in another order) fails every rank's constructor, not their first save."""
        coord = self._coord
        assert coord is not None
        said = coord.all_gather_json(problem, what=f"opening {self.directory}", op="joined")
        bad = [(r, p) for r, p in enumerate(said) if p]
        if bad:
            raise CoordinationError("; ".join(f"rank {r}: {p}" for r, p in bad))

    def _agree(self, step: int, want: bool, problem: int, call: str
               ) -> tuple[bool, int, int]:
        """Every rank's view of this step boundary: whether any wants to save, the problems
        of any rank (bits OR-ed: 1 the step exists, 2 its buffers are busy; 0: none), and
        the signal to act on now (0: none): one any rank had
        received when it called, which becomes every rank's, so all of them save at this
        step and then act on it."""
        coord = self._coord
        assert coord is not None
        signal = self._signals.pending or 0
        said = coord.all_gather_ints([step, int(want), signal, int(problem)],
                                     what=f"{call}({step}) in {self.directory}")
        steps = [a[0] for a in said]
        if len(set(steps)) > 1:
            raise CoordinationError(
                f"{call}() was called with different steps on the ranks ("
                + ", ".join(f"rank {r}: {x}" for r, x in enumerate(steps))
                + f") in {self.directory}; every rank must call it with the same step, in "
                "the same order")
        signal = max(a[2] for a in said)
        if signal and self._signals.pending is None:
            self._signals.pending = signal  # received by another rank: acted on here too
        problems = 0
        for a in said:
            problems |= a[3]
        return any(a[1] for a in said), problems, signal

    # ================================================================== helpers
    def _use_rank(self, reader: CheckpointReader) -> None:
        """Read a checkpoint written by several ranks as this rank's part of it: its own
        when the job has as many ranks; on another number of ranks, sharded arrays are
        resharded and replicated state is the same everywhere, and what differed between
        the saving ranks comes from saved rank ``rank % saved`` (said once, by name)."""
        m = reader.manifest
        if m.world == 1:
            return
        rank, world = self._rank_world
        src = rank if m.world == world else rank % m.world
        if m.world != world:
            specific = m.rank_specific()
            if specific:
                self._warn_once(
                    f"world:{m.step}:{world}",
                    f"pitstop: {reader.where} was saved by {m.world} ranks and is restored by "
                    f"{world}: sharded arrays are resharded and replicated ones are the same on "
                    f"every rank, but these entries differed between the saving ranks, and "
                    f"rank {rank} gets saved rank {src}'s: {_some_keys(specific)}")
        reader.manifest = m.view(src)

    def _check_usable(self) -> None:
        if _pid[0] != self._owner_pid:
            raise CheckpointError(
                f"this CheckpointManager ({self.directory}) belongs to process "
                f"{self._owner_pid}; it cannot be used in the forked process {os.getpid()}. "
                "Open a CheckpointManager of the child's own (read_only=True to restore or "
                "load from the same directory), or save from the parent.")

    def _writer(self) -> Engine:
        self._check_usable()
        if self._engine is None:
            raise CheckpointError(f"this CheckpointManager ({self.directory}) is read_only")
        if self._closed:
            raise CheckpointError(f"this CheckpointManager ({self.directory}) is closed")
        return self._engine

    def _path(self, step: int) -> str:
        """Where the checkpoint of ``step`` is (or would be)."""
        return self.storage.path_of(self.naming.name(step))

    def _committed(self, *, hidden: bool = False) -> list[int]:
        """Committed steps on disk; the abandoned run's ones (after a restore of an older
        step) only with ``hidden``, until the run's first step or save moves them aside."""
        steps = wrap_os(self._catalog.committed_steps, self.directory)
        if self._abandoned and not hidden:
            steps = [s for s in steps if s not in self._abandoned]
        return steps


def _kind_of(e: CheckpointError) -> str:
    return "corrupt" if isinstance(e, CorruptCheckpointError) else \
        "newer" if isinstance(e, UnsupportedFormatError) else "refused"


def _ambient_rank() -> tuple[int, int]:
    from pitstop.core.adapter import ambient_rank
    return ambient_rank()


def _coordinator(distributed: Any) -> Coordinator | None:
    """The ranks a manager saves with: ``"auto"`` finds the distributed job this process is
    a rank of (``torch.distributed`` initialized with several ranks, or JAX's distributed
    runtime); False: this process alone; a :class:`Coordinator`: those ranks."""
    if isinstance(distributed, Coordinator):
        return distributed if distributed.world_size > 1 else None
    if distributed is False:
        return None
    if distributed == "auto" or distributed is True:
        from pitstop.core.adapter import ambient_coordinator
        coord = ambient_coordinator()
        if coord is None and distributed is True:
            raise InvalidArgumentError(
                "distributed=True, but this process is not a rank of a distributed job with "
                "several ranks (torch.distributed.init_process_group or "
                "jax.distributed.initialize first)")
        return coord
    raise InvalidArgumentError(
        f"distributed must be 'auto', True, False or a pitstop Coordinator, got {distributed!r}")


def _skeleton(target: Any, resolve: Callable[[Any], Any]) -> Any:
    """A copy of ``target``'s containers (dicts, lists, tuples) and numpy arrays, for
    ``load(target=...)`` to fill without touching the target. An object an adapter handles
    is copied by the adapter's ``skeleton(obj, copy)`` where it has one (a JAX pytree node
    with numpy arrays inside, a mutable Flax NNX module), else shared (immutable ones are
    rebuilt anyway)."""
    def copy(x: Any) -> Any:
        if isinstance(x, np.ndarray):
            return np.empty_like(x)
        if type(x) is dict:
            return {k: copy(v) for k, v in x.items()}
        if type(x) is list:
            return [copy(v) for v in x]
        if type(x) is tuple:
            return tuple(copy(v) for v in x)
        if isinstance(x, tuple) and callable(getattr(type(x), "_make", None)):
            return type(x)._make(copy(v) for v in x)  # type: ignore[attr-defined]
        if isinstance(x, (*_PLAIN_VALUES, np.generic)):
            return x
        adapter = resolve(x)
        own = adapter.skeleton(x, copy) if adapter is not None else None
        if own is not None:
            return own  # a pytree node (a Flax nnx.State too) rebuilt by its adapter
        if isinstance(x, MutableMapping):  # OrderedDict, defaultdict ...
            items = {k: copy(v) for k, v in x.items()}
            try:
                factory = getattr(x, "default_factory", _NONE)
                cls: Any = type(x)
                return cls(items) if factory is _NONE else cls(factory, items)
            except Exception:  # noqa: BLE001 - a mapping built otherwise: shared
                return x
        return x

    return copy(target)


_PLAIN_VALUES = (bool, int, float, str, bytes, type(None))
_NONE = object()


def _some_keys(keys: list[str]) -> str:
    return ", ".join(map(repr, keys[:10])) + (f" (+{len(keys) - 10} more)"
                                              if len(keys) > 10 else "")


def _overwritten(errors: list[CorruptCheckpointError]) -> str:
    return _overwritten_keys(sorted({k for e in errors for k in e.overwritten}))


def _overwritten_keys(keys: list[str]) -> str:
    return ", ".join(map(repr, keys[:10])) + (f" (+{len(keys) - 10} more)"
                                              if len(keys) > 10 else "")


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector (reference counting goes on) for a short burst of
    allocations, so a large heap is not rescanned in the middle of a snapshot."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _pin_hooks() -> list[Any]:
    from pitstop.core.adapter import staging_hooks
    return staging_hooks  # the live list: adapters imported later add their hooks to it

