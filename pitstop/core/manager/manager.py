"""CheckpointManager: the face that joins policy, engine, storage and reader.

Its parts live in rooms of their own beside it: its options (:mod:`.options`), the three
ways it opens a directory (:mod:`.opening`), the reading it shares with every reader of a
directory (:mod:`.reader`), saving and signals (:mod:`.saving`), and the agreement of the
ranks of a job (:mod:`.ranks`); further away, signal handling (:mod:`.signals`), the
directory's index and retention (:mod:`.catalog`), memory-tier recovery (:mod:`.recovery`),
what the manager holds and how it is released (:mod:`.lifecycle`), and the checks of its
arguments (:mod:`.arguments`).

A manager belongs to the process that created it. In a forked child every call but
``close()`` (a no-op there) raises, and nothing the child does, garbage collection and exit
included, touches the parent's buffers, tier files, lock or directory. A manager that is
dropped or still open when the interpreter exits commits the saves it accepted and
releases what it holds.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pitstop.core.arguments import DEFAULT_SNAPSHOT, clean_metrics, step_arg, wrap_os
from pitstop.core.directory.recovery import Recovered
from pitstop.core.errors import CheckpointError, CheckpointNotFoundError
from pitstop.core.format.hashing import DEFAULT
from pitstop.core.format.schema import Manifest
from pitstop.core.manager.opening import (
    _coordinator,
    open_follower,
    open_read_only,
    open_writer,
)
from pitstop.core.manager.options import ManagerOptions
from pitstop.core.manager.ranks import Ranks
from pitstop.core.manager.reader import DirectoryReader, _no_gc
from pitstop.core.manager.saving import Saving
from pitstop.core.policy import RetentionPolicy, SaveContext, SavePolicy
from pitstop.core.restore.read import RestoreReport
from pitstop.core.restore.report import RestoredStep
from pitstop.core.runtime.coordination import Coordinator
from pitstop.core.runtime.lifecycle import lost_signal_message
from pitstop.core.runtime.signals import CONTINUE_SIGNALS, DEFAULT_SIGNALS, signal_name
from pitstop.core.save.engine import Engine, SaveHandle, SaveStats
from pitstop.core.save.handles import check_timeout
from pitstop.core.save.lazy import fence_all
from pitstop.core.save.skips import SkippedSaves
from pitstop.core.storage import Storage
from pitstop.core.tree import FlatState, FlattenCache, flatten

log = logging.getLogger("pitstop")

#: this process's pid, kept current across forks (os.getpid() is a system call; step() is
#: called every training step)
_pid = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))

__all__ = ["CheckpointManager"]

#: said once by a manager's first ``step()`` when no policy can ever make it save: a loop
#: that calls ``step()`` every step and trusts it to save must not find out after a crash
NO_POLICY = ("pitstop: step() of the manager of {directory} saves only on a signal: it was "
             "given no save_every_steps, save_every_seconds, mtbf_seconds, keep_best or "
             "save_policy. Pass save_every_steps=N to save every N steps (Orbax saves every "
             "step by default: save_every_steps=1), or call save(step, state) to save now.")


class CheckpointManager(Saving, Ranks, DirectoryReader):
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
        hash_in_copy: bool = False,
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
        preemption: str | Iterable[str] | None = None,
        preemption_exit: bool = False,
        grace_seconds: float | None = None,
    ) -> None:
        options = ManagerOptions(
            keep_last=keep_last, keep_every_steps=keep_every_steps, keep_best=keep_best,
            best_metric=best_metric, best_mode=best_mode, save_every_steps=save_every_steps,
            save_every_seconds=save_every_seconds, save_policy=save_policy, retention=retention,
            save_on_signals=save_on_signals, mtbf_seconds=mtbf_seconds, async_save=async_save,
            max_in_flight=max_in_flight, on_busy=on_busy, memory_tier=memory_tier,
            nonfinite_guard=nonfinite_guard, hash_algorithm=hash_algorithm,
            compression=compression, writer_threads=writer_threads, copy_threads=copy_threads,
            hash_in_copy=hash_in_copy, durable=durable, read_only=read_only, on_save=on_save, step_prefix=step_prefix,
            step_digits=step_digits, distributed=distributed, storage_options=storage_options,
            permissions=permissions, encryption=encryption, incremental=incremental,
            snapshot=snapshot, preemption=preemption, preemption_exit=preemption_exit,
            grace_seconds=grace_seconds)
        self._owner_pid = os.getpid()
        self._closed = False
        self._engine: Engine | None = None
        #: snapshots recovered from the memory tier at construction, oldest first
        self._recovered_all: list[Recovered] = []
        options.check(directory)
        #: the options this manager was made with (its keywords, checked)
        self._options = options
        #: "eager" or "lazy" (see :mod:`pitstop.core.save.lazy`); a synchronous manager waits for
        #: the whole save anyway, so it copies eagerly
        self.snapshot_mode = snapshot
        #: the ranks of the distributed job this manager saves with (None: one process)
        self._coord: Coordinator | None = None if read_only else _coordinator(distributed)
        self._distributed = distributed
        leader = self._coord is None or self._coord.leader
        self._open_storage(directory, options, self._coord, create=not read_only and leader)
        self.async_save = async_save
        self.on_busy = on_busy
        self.nonfinite_guard = nonfinite_guard
        self.best_metric, self.best_mode = best_metric, best_mode
        self.on_save = on_save
        self.stats: list[SaveStats] = []
        #: periodic saves skipped because the previous one was still persisting
        self._skips = SkippedSaves()
        #: a run continued from this older step: the newer checkpoints of the abandoned run
        #: are moved aside at its first save
        self._rolled_back_to: int | None = None
        #: the leaves of the last save's big dicts of arrays, reused while they hold the
        #: same arrays (many small tensors: see tree.FlattenCache)
        self._flatten_cache = FlattenCache()
        #: the adapters of a save -> the frameworks (and versions) they record
        self._frameworks: dict[frozenset[Any], dict[str, str]] = {}
        #: one save (its checks, snapshot and submit) or close at a time, across threads
        self._api_lock = threading.RLock()
        if read_only:
            open_read_only(self, directory, options)
        elif not leader:
            open_follower(self, options)
        else:
            open_writer(self, options)
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
            self._prepare_staging(state)  # once: the first save then finds its memory ready
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
        self._prepare_staging(flat=_flat)
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
            return self._load_into(step, target)
        fence_all()
        recovered = self._recovered_at(step)
        if recovered is not None and (step is not None or self.latest_step() == recovered.step):
            loaded = recovered.reader.load()
            self._tell_supervisor("restore", step=recovered.step)
            return loaded
        if self._engine is not None:
            self._engine.drain()
        return self._load_from_disk(step)

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

    def metadata(self, step: int) -> Manifest:
        """The parsed manifest of one checkpoint (metrics, user metadata, arrays)."""
        self._check_usable()
        step = step_arg(step)
        recovered = self._recovered_at(step)
        if recovered is not None and step not in self._catalog.index:
            return recovered.reader.manifest
        if self._engine is not None and step in self._engine.pending_steps():
            self._engine.drain()
        return self._manifest_of(step)

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
        """True when a terminating signal (SIGTERM, SIGINT) is pending: the next ``step()`` or
        ``save()`` saves this step, waits for its commit and exits (Orbax's
        ``reached_preemption``). With several ranks every rank calls it at the same step:
        a signal any rank received is every rank's answer (and save)."""
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

    def _hold_staged(self, name: str) -> tuple[Any, Any] | None:
        """The staging buffer ``name`` was written from, unchanged since (read from it)."""
        return self._engine.hold_staged(name) if self._engine is not None else None

    def _release_staged(self, buf: Any) -> None:
        self.pool.release(buf)

    def _distrust_previous(self) -> None:
        """A read found damaged bytes (in a checkpoint or in a holder it references): an
        incremental save must not reference the last commit's bytes any more, which may be
        those very bytes; the next save writes every array again."""
        if self._engine is not None:
            self._engine.forget_previous()

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
