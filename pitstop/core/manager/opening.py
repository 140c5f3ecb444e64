"""The three ways a :class:`~pitstop.core.manager.CheckpointManager` opens its directory:
read-only (:func:`open_read_only`), as the writer, or the leader rank of a job
(:func:`open_writer`), as another rank of a job (:func:`open_follower`); and what a writer
starts once it holds the directory (the memory tier, the engine, its policies, the
snapshots it recovers)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import weakref
from typing import Any

from pitstop.core.arguments import wrap_os
from pitstop.core.directory.catalog import Catalog
from pitstop.core.directory.identity import (
    check_encryption,
    create_identity,
    directory_kind,
    last_seq,
    read_identity,
    resolve_naming,
)
from pitstop.core.directory.names import Naming
from pitstop.core.directory.recovery import discard, recover, recoverable_steps
from pitstop.core.directory.retention import record_retention
from pitstop.core.errors import CheckpointError, DirectoryLockedError, InvalidArgumentError
from pitstop.core.manager.options import ManagerOptions
from pitstop.core.policy import (
    AnyOf,
    AutoInterval,
    EveryNSteps,
    EverySeconds,
    OnImprovement,
    SaveContext,
    SavePolicy,
)
from pitstop.core.runtime.coordination import CoordinationError, Coordinator
from pitstop.core.runtime.lifecycle import Resources, TierFallback
from pitstop.core.runtime.preemption import Watcher
from pitstop.core.runtime.signals import SignalSaver
from pitstop.core.save import memtier as memtier_mod
from pitstop.core.save.engine import Engine
from pitstop.core.save.memtier import MemoryTier
from pitstop.core.save.snapshot import StagingPool

log = logging.getLogger("pitstop")

#: the CheckpointManager being opened (not imported here: the manager imports this module)
Manager = Any


def open_read_only(mgr: Manager, directory: Any, options: ManagerOptions) -> None:
    """A manager that only reads: the directory as a :class:`DirectoryReader` opens it, no
    lock, no engine, no signal handlers."""
    mgr._open_read_only(directory, options)
    mgr._policy = None
    mgr._signals = SignalSaver(None)
    mgr._res = Resources(mgr._owner_pid, mgr.directory)
    mgr._finalizer = weakref.finalize(mgr, Resources.release, mgr._res, True)


def open_follower(mgr: Manager, options: ManagerOptions) -> None:
    """Another rank of a distributed job: the leader (rank 0) holds the directory, names its
    checkpoints and runs retention; this rank waits for it, checks that both opened the same
    directory, then writes its part of each save."""
    coord = mgr._coord
    assert coord is not None
    encryption, on_save = options.encryption, options.on_save
    step_prefix, step_digits = options.step_prefix, options.step_digits
    retention_list = mgr.retention
    mgr._res = Resources(mgr._owner_pid, mgr.directory)
    mgr._finalizer = weakref.finalize(mgr, Resources.release, mgr._res, True)
    lead = coord.all_gather_json({}, what=f"opening {mgr.directory}", op="open")[0]
    if lead.get("error"):
        mgr._finalizer.detach()
        raise CoordinationError(f"rank 0 could not open the checkpoint directory "
                                f"{mgr.directory}: {lead['error']}")
    _exit_hook(mgr)
    try:
        mgr.naming = resolve_naming(mgr.directory, Naming(*lead["naming"]),
                                     step_prefix, step_digits)
        mgr.directory_id = lead["id"]
        mine = wrap_os(read_identity, mgr.directory, mgr.storage, required=False)
        if mine is None or mine.directory_id != lead["id"]:
            problem = (
                f"rank 0's manager is for the directory with id {lead['id']} "
                f"({lead.get('where')}), this rank's for {mgr.directory} (id "
                f"{mine.directory_id if mine else 'none'}): the ranks made their "
                "managers for different directories, or in a different order")
        else:
            problem = None
        if problem is None:
            try:
                check_encryption(mgr.directory, mine, encryption, False)
            except CheckpointError as e:
                problem = str(e)
        joined(mgr, problem)
        mgr._catalog = Catalog(mgr.storage, mgr.directory_id, retention_list,
                                read_only=True, naming=mgr.naming, on_save=on_save,
                                encryption=encryption)
        wrap_os(mgr._catalog.reconcile, mgr.directory, write=False)
        start(mgr, options)
    except BaseException:
        mgr._finalizer.detach()
        mgr._res.release(False)
        raise


def open_writer(mgr: Manager, options: ManagerOptions) -> None:
    """The writer (alone, or the leader rank of a job): takes the directory's lock, reads or
    creates its identity, removes leftovers of interrupted saves, reconciles the index,
    tells the other ranks, then starts saving."""
    coord = mgr._coord
    encryption, on_save = options.encryption, options.on_save
    step_prefix, step_digits = options.step_prefix, options.step_digits
    retention_list = mgr.retention
    try:
        lock = wrap_os(mgr.storage.lock, mgr.directory)
    except BaseException as e:
        if isinstance(e, DirectoryLockedError):
            # the steps another writer commits there are not this job's progress
            mgr._tell_supervisor("locked_out")
        announce(mgr, error=e)
        raise
    mgr._res = Resources(mgr._owner_pid, mgr.directory, lock=lock)
    mgr._finalizer = weakref.finalize(mgr, Resources.release, mgr._res, True)
    _exit_hook(mgr)
    try:
        try:
            identity = read_identity(mgr.storage, required=True)
            mgr.naming = resolve_naming(
                mgr.directory, identity.naming if identity else None, step_prefix,
                step_digits)
            kind = wrap_os(directory_kind, mgr.directory, mgr.storage,
                           mgr.naming, identity, encryption is not None)
            if identity is None and kind is not None:
                # checkpoints without an identity (their .pitstop/ lost or not
                # copied): a writer still never mixes plaintext and encrypted ones
                check_encryption(mgr.directory, kind, encryption, True)
            elif identity is not None and kind is not None and \
                    kind.encryption != identity.encryption:
                # an identity edited to record no encryption: its checkpoints' kind
                check_encryption(mgr.directory, kind, encryption, True)
                identity = kind
                wrap_os(create_identity, mgr.directory, mgr.storage, mgr.naming,
                        encryption, identity.directory_id)
            # (encrypted checkpoints are bound to their directory's id: a new
            # identity for them takes the id they name)
            mgr.directory_id = identity.directory_id if identity else \
                wrap_os(create_identity, mgr.directory, mgr.storage, mgr.naming,
                        encryption, kind.directory_id if kind and kind.encryption
                        else None)
            mgr._catalog = Catalog(mgr.storage, mgr.directory_id, retention_list,
                                    read_only=False, naming=mgr.naming,
                                    on_save=on_save, encryption=encryption)
            if check_encryption(mgr.directory, identity, encryption,
                                bool(mgr._catalog.committed_steps())):
                # a plaintext directory without checkpoints: encrypted from now on
                wrap_os(create_identity, mgr.directory, mgr.storage, mgr.naming,
                        encryption, mgr.directory_id)
            # (after the key is checked: a refused writer changes nothing)
            removed = wrap_os(mgr.storage.cleanup_incomplete, mgr.directory,
                              mgr.naming)
            if removed:
                log.warning("pitstop: removed %d leftover(s) of interrupted saves in "
                            "%s: %s", len(removed), mgr.directory, ", ".join(removed))
            wrap_os(mgr._catalog.reconcile, mgr.directory, write=True)
            try:  # what `pitstop ls` reads to say which checkpoints retention keeps
                record_retention(mgr.storage, retention_list)
            except OSError as e:  # informational: never a reason to refuse the writer
                log.warning("pitstop: could not record the retention policy in "
                            "%s/.pitstop/directory.json: %s", mgr.directory, e)
        except BaseException as e:
            announce(mgr, error=e)
            raise
        announce(mgr)
        if coord is not None:
            joined(mgr, None)
        start(mgr, options)
    except BaseException:
        mgr._finalizer.detach()
        mgr._res.release(False)
        raise


def _exit_hook(mgr: Manager) -> None:
    """In a multiprocessing worker, commit what the manager accepted at the worker's exit."""
    mp = sys.modules.get("multiprocessing")
    if mp is not None and mp.parent_process() is not None:
        # a multiprocessing worker leaves through os._exit, past atexit: its own exit
        # hook commits what this manager accepted
        mp.util.Finalize(None, Resources.release, args=(mgr._res, True),
                         exitpriority=10)


def start(mgr: Manager, options: ManagerOptions) -> None:
    """What a writer starts once it holds the directory: the memory tier, the engine, when
    to save, the signal handlers, and the snapshots it recovers from the memory tier."""
    coord = mgr._coord
    memory_tier, incremental, encryption = (options.memory_tier, options.incremental,
                                            options.encryption)
    max_in_flight, hash_algorithm, compression = (options.max_in_flight,
                                                  options.hash_algorithm, options.compression)
    writer_threads, copy_threads = options.writer_threads, options.copy_threads
    snapshot, async_save = options.snapshot, options.async_save
    # memory tier
    root = memtier_mod.default_root() if memory_tier in (None, True) else (
        os.fspath(memory_tier) if isinstance(memory_tier, (str, os.PathLike))
        else None)
    if memory_tier is True and root is None:
        raise InvalidArgumentError(
            "memory_tier=True but /dev/shm is not available; pass a directory on a "
            "tmpfs, or memory_tier=False")
    # each rank keeps its own snapshots (a rank's part of the state)
    tier = MemoryTier(root, mgr.directory, mgr.directory_id, part="" if coord is None
                      else f"rank {coord.rank} of {coord.world_size}") if root else None
    if incremental and (coord is not None or encryption is not None):
        mgr._warn_once("incremental", (
            "pitstop: incremental=True steps aside: "
            + ("this job saves with several ranks" if coord is not None else
               "the checkpoints are encrypted")
            + ", and incremental checkpoints are made by one process, unencrypted "
            "(docs/incremental.md); every save writes all its arrays. Pass "
            "incremental=False to silence this."))
    mgr.pool = StagingPool(max_in_flight, tier.prefix if tier else None, _pin_hooks(),
                            on_tier_failure=TierFallback(root) if tier else None)
    mgr._engine = Engine(
        mgr.storage, hash_algorithm=hash_algorithm, compression=compression,
        writer_threads=writer_threads or min(4, os.cpu_count() or 2), pool=mgr.pool,
        directory_id=mgr.directory_id, on_commit=mgr._catalog.committed, tier=tier,
        name_of=mgr.naming.name, copy_threads=copy_threads, coordinator=coord,
        encryption=encryption, incremental=incremental,
        lazy=snapshot == "lazy" and async_save, hash_in_copy=options.hash_in_copy)
    if encryption is not None and not mgr.read_only and (coord is None or
                                                          coord.leader):
        # each encrypted save records its place in the directory's order of saves
        mgr._engine.last_seq = wrap_os(last_seq, mgr.directory, mgr.storage,
                                        mgr.naming)
    # a checkpoint leaving the directory is never referenced by the next save
    mgr._catalog.on_removed = mgr._engine.forget_previous
    mgr._engine.forget_step = mgr._catalog.forget  # (the leader's retention)
    mgr.hooks = mgr._engine.hooks
    mgr._catalog.hooks = mgr.hooks  # one dict: the engine's and retention's hooks
    mgr._res.engine, mgr._res.pool, mgr._res.tier = mgr._engine, mgr.pool, tier
    _start_saving(mgr, options, tier)


def _start_saving(mgr: Manager, options: ManagerOptions, tier: MemoryTier | None
                  ) -> None:
    """When to save, the signal handlers, and the snapshots recovered from the memory tier."""
    coord = mgr._coord
    save_every_steps, save_every_seconds = options.save_every_steps, options.save_every_seconds
    mtbf_seconds, save_policy, save_on_signals = (options.mtbf_seconds, options.save_policy,
                                                  options.save_on_signals)
    keep_best, best_metric, best_mode = options.keep_best, options.best_metric, options.best_mode
    memory_tier = options.memory_tier
    # when to save
    policies: list[SavePolicy] = []
    if save_every_steps is not None:
        policies.append(EveryNSteps(save_every_steps))
    if save_every_seconds is not None:
        policies.append(EverySeconds(save_every_seconds))
    mgr._auto = AutoInterval(mtbf_seconds) if mtbf_seconds else None
    if mgr._auto is not None:
        policies.append(mgr._auto)
    if keep_best is not None and best_metric:
        policies.append(OnImprovement(best_metric, best_mode, mgr._catalog.best_so_far(
            best_metric, best_mode)))
    if save_policy is not None:
        policies.append(save_policy)
    mgr._policy = AnyOf(*policies) if policies else None

    mgr._signals = SignalSaver(save_on_signals)
    mgr._res.signals = mgr._signals
    _watch_preemption(mgr, options)
    if coord is not None:
        # every rank recovers the same snapshots (their persists are saves of all
        # ranks together): those that all of them still hold
        committed = mgr._catalog.committed_steps()
        newest = committed[-1] if committed else None
        mine = sorted(recoverable_steps(tier, newest)) if tier is not None else []
        held = coord.all_gather_json(mine, op="recover", what=f"{mgr.directory}: finding the "
                                     "snapshots every rank holds in memory")
        common = set.intersection(*(set(h) for h in held))
        if tier is not None:
            mgr._recovered_all = recover(tier, mgr.pool, mgr._engine, newest,
                                          only=common)
            mgr._res.recovered = mgr._recovered_all
    elif tier is not None:
        committed = mgr._catalog.committed_steps()
        mgr._recovered_all = recover(tier, mgr.pool, mgr._engine,
                                      committed[-1] if committed else None)
        mgr._res.recovered = mgr._recovered_all
    elif memory_tier is False and (shm := memtier_mod.default_root()) is not None:
        # a killed job's snapshots would stay in /dev/shm for ever
        committed = mgr._catalog.committed_steps()
        discard(MemoryTier(shm, mgr.directory, mgr.directory_id,
                           part="" if coord is None else
                           f"rank {coord.rank} of {coord.world_size}"),
                committed[-1] if committed else None)
    mgr._ctx = SaveContext(last_save_step=mgr.latest_step())


def _watch_preemption(mgr: Manager, options: ManagerOptions) -> None:
    """SIGTERM's grace, and the watcher thread of the cloud notices the options name (it
    holds the signal saver, not the manager; the manager's release stops it)."""
    sources, exit_after, grace = options.preemption_settings()
    signals = mgr._signals
    signals.grace_seconds = grace
    if sources:
        mgr._res.watcher = Watcher(sources, lambda notice: signals.mark(notice, exit_after)
                                   ).start()


def announce(mgr: Manager, error: BaseException | None = None) -> None:
    """The leader tells the other ranks how the directory is (or why it could not be)
    opened; they wait for it in their constructors."""
    coord = mgr._coord
    if coord is None:
        return
    if error is not None:
        with contextlib.suppress(CheckpointError):
            coord.all_gather_json({"error": f"{type(error).__name__}: {error}"},
                                  what=f"opening {mgr.directory}", op="open")
        return
    coord.all_gather_json({"id": mgr.directory_id, "where": mgr.directory,
                           "naming": [mgr.naming.prefix, mgr.naming.digits]},
                          what=f"opening {mgr.directory}", op="open")


def joined(mgr: Manager, problem: str | None) -> None:
    """Every rank says whether it opened the leader's directory: a mismatch (managers
    made in another order) fails every rank's constructor, not their first save."""
    coord = mgr._coord
    assert coord is not None
    said = coord.all_gather_json(problem, what=f"opening {mgr.directory}", op="joined")
    bad = [(r, p) for r, p in enumerate(said) if p]
    if bad:
        raise CoordinationError("; ".join(f"rank {r}: {p}" for r, p in bad))


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


def _pin_hooks() -> list[Any]:
    from pitstop.core.adapter import staging_hooks
    return staging_hooks  # the live list: adapters imported later add their hooks to it
