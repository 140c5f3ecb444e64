"""How a :class:`~pitstop.core.manager.CheckpointManager` saves: the checks of a save, its
snapshot and submit to the engine, skipped periodic saves, the save a signal asks for, and
the abandoned run's checkpoints moved aside. A part of the manager (a mixin), kept apart so
that the manager's face stays short."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

from pitstop.core.arguments import check_user_metadata, clean_metrics
from pitstop.core.errors import CheckpointError, StepExistsError
from pitstop.core.manager.reader import _no_gc
from pitstop.core.runtime import preemption
from pitstop.core.runtime.preemption import Notice
from pitstop.core.runtime.signals import (
    CONTINUE_SIGNALS,
    SignalSaver,
    child_signals_held,
    signal_name,
)
from pitstop.core.save.engine import Engine, PersistJob, SaveHandle, SaveStats
from pitstop.core.tree import FlatState, flatten

log = logging.getLogger("pitstop")


class Saving:
    """The manager's saving half (see :class:`~pitstop.core.manager.CheckpointManager`)."""

    #: the staging buffer was asked for ahead of the first save (:meth:`_prepare_staging`)
    _staging_asked = False

    # ================================================================== saving
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

    def _prepare_staging(self, state: Any = None, flat: FlatState | None = None) -> None:
        """Once per manager, at the first ``step()`` that does not save or a ``restore()``
        that restored: start making the staging buffer off the training thread, so that the
        first save's stall is a copy like every later one's. Best effort: on any trouble the
        first save allocates it, as it always did."""
        engine = self._engine
        if self._staging_asked or engine is None or self._coord is not None:
            return
        self._staging_asked = True
        try:
            if flat is None:
                with _no_gc():
                    flat = flatten(state, self._resolve, self._flatten_cache)
            engine.prepare_staging(flat)
        except Exception:  # noqa: BLE001 - an optimisation; the save reports real trouble
            log.debug("pitstop: the staging buffer could not be prepared ahead", exc_info=True)

    def _first_allocation_note(self, stats: SaveStats) -> None:
        """The first save of a manager that had to make its staging buffer itself says why
        (that is most of its stall), once."""
        pool = self.pool
        why = pool.first_allocation
        if why is None or why == "prepared" or pool.first_allocation_told:
            return
        pool.first_allocation_told = True
        if stats.bytes >= 16 * 2**20:
            log.info("pitstop: the save of step %d made its %.0f MiB staging buffer itself "
                     "(%s): most of its %.2f s stall; later saves reuse it. A step() or "
                     "restore() before the first save prepares it off the training thread.",
                     stats.step, stats.bytes / 2**20, why, stats.stall_s)

    def _save(self, step: int, state: Any, metrics: Mapping[str, Any] | None, *, block: bool,
              periodic: bool, user_metadata: Mapping[str, Any] | None = None,
              notice: Notice | None = None, fast: bool = False) -> SaveHandle | None:
        engine = self._engine
        assert engine is not None
        clean = clean_metrics(metrics, self.best_metric)
        user_meta = check_user_metadata(user_metadata)
        if notice is not None:  # (a reserved key: which notice this save was for)
            user_meta[preemption.METADATA_KEY] = notice.metadata()
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
        self._first_allocation_note(stats)
        job = PersistJob(step=step, buffer=buf, values=values, structure=flat.structure,
                         metrics=clean, handle=handle, user_metadata=user_meta,
                         check_finite=self.nonfinite_guard, nonfinite_metrics=nonfinite,
                         global_shapes={k: list(flat.arrays[k].shape) for k in flat.sharded}
                         if self._coord is not None else {},
                         frameworks=self._frameworks_of(flat), layouts=flat.layouts(),
                         fast=fast)
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
    def recovered_steps(self) -> list[int]:
        """The steps this manager recovered from the memory tier at its opening that are not
        on disk yet (their persist runs in the background): newest last."""
        return [r.step for r in self._recovered_all]

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
        notice = signals.handling_notice
        expected, fits = preemption.plan(notice, self.stats) if notice else (None, None)
        if notice is not None and fits is False:
            log.warning("%s", preemption.fit_warning(notice, step, expected))
        # with the deadline out of reach: the fastest path to durable storage
        fastest = preemption.fastest_path(self._engine) if fits is False else \
            contextlib.nullcontext()
        taken = True  # False: this step's save could not even be started
        error: CheckpointError | None = None
        with fastest:
            with self._api_lock:
                handle = None
                if step not in self._catalog.index and \
                        step not in self._engine.pending_steps():
                    try:
                        handle = self._save(step, state, metrics, block=True, periodic=False,
                                            user_metadata=user_metadata, notice=notice,
                                            fast=fits is False)
                    except CheckpointError as e:
                        if name in CONTINUE_SIGNALS:
                            self._notice_saved(notice, step, expected, fits, e)
                            raise
                        taken, error = False, e
                        log.error("pitstop: the save of step %d for %s could not be taken "
                                  "(%s); exiting as the signal asks without it", step, name, e)
            if name in CONTINUE_SIGNALS:
                try:
                    self.wait()
                except CheckpointError as e:
                    self._notice_saved(notice, step, expected, fits, e)
                    raise
                self._notice_saved(notice, step, expected, fits, None)
                if notice is None or _plain(notice):
                    log.warning("pitstop: saved step %d after %s", step, name)
                return handle
            try:
                self.wait()
            except CheckpointError as e:
                # the signal is still honoured: a loop that tolerates checkpoint errors must
                # not train on after a preemption notice
                error = e
                log.error("pitstop: the save of step %d for %s failed (%s); exiting as the "
                          "signal asks without it", step, name, e)
        self._notice_saved(notice, step, expected, fits, error)
        if taken and error is None and (notice is None or _plain(notice)):
            log.warning("pitstop: saved step %d after %s", step, name)
        try:
            self.close()
        except CheckpointError as e:
            log.error("pitstop: %s", e)
        signals.exit_like(signum)
        return handle

    def _notice_saved(self, notice: Notice | None, step: int, expected: float | None,
                      fits: bool | None, error: BaseException | None) -> None:
        """After a notice's save: the line that says when it became durable (or that it
        failed), and its record in directory.json (the writer's)."""
        if notice is None:
            return
        durable = time.time() if error is None and step in self._catalog.index else None
        if durable is None and error is None:
            return  # nothing was saved for it (this step was saved before)
        preemption.report(self.storage, notice, step, expected, fits, durable,
                          say=not _plain(notice),
                          record=self._coord is None or self._coord.leader, error=error)


def _plain(notice: Notice) -> bool:
    """A signal without a deadline: it keeps its own line ("saved step N after SIGTERM")
    instead of the preemption notice's; it is recorded all the same."""
    return notice.source.startswith("SIG") and notice.deadline_unix is None
