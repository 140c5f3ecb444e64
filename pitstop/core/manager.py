"""CheckpointManager: policy, snapshot engine, storage, retention and restore, tied together."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import re
import signal
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from . import memtier as memtier_mod
from .engine import Engine, PersistJob, SaveHandle, SaveStats
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StepExistsError,
    UnsupportedFormatError,
)
from .hashing import ALGORITHMS, DEFAULT
from .manifest import Manifest
from .memtier import MemoryTier
from .policy import (
    AnyOf,
    AutoInterval,
    CheckpointInfo,
    EveryNSteps,
    EverySeconds,
    KeepBest,
    KeepEverySteps,
    KeepLast,
    OnImprovement,
    RetentionPolicy,
    SaveContext,
    SavePolicy,
    to_delete,
)
from .reader import CheckpointReader, RestoredStep, RestoreReport
from .snapshot import StagingPool
from .storage import Storage, open_storage
from .tree import FlatState, decode_value, flatten

log = logging.getLogger("pitstop")

_NAME = re.compile(r"^step_(\d+)$")
DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")
#: signals after whose save the process goes on training (a "checkpoint now" request)
CONTINUE_SIGNALS = {"SIGUSR1"}


def step_name(step: int) -> str:
    return f"step_{step:010d}"


def _resolver() -> Callable[[Any], Any]:
    from ..adapters.registry import resolve
    return resolve


class CheckpointManager:
    """Saves and restores training state in a directory of step checkpoints.

    ``save`` blocks only for an in-memory snapshot; hashing, writing, fsync, the atomic
    commit and retention run in the background (``async_save=False`` does it all inline).
    ``step`` is the per-training-step call: it saves when a policy says so. ``restore``
    puts the newest valid checkpoint back into live objects, in place.
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
    ) -> None:
        if hash_algorithm not in ALGORITHMS:
            raise ValueError(f"hash_algorithm must be one of {sorted(ALGORITHMS)}")
        if on_busy not in ("skip", "wait"):
            raise ValueError("on_busy must be 'skip' or 'wait'")
        if keep_best is not None and not best_metric:
            raise ValueError("keep_best needs best_metric (the metric name to rank by)")
        if best_mode not in ("min", "max"):
            raise ValueError("best_mode must be 'min' or 'max'")
        self.storage = open_storage(directory, durable=durable, create=not read_only) \
            if not isinstance(directory, Storage) else directory
        self.directory = self.storage.location
        self.read_only = read_only
        self.async_save = async_save
        self.on_busy = on_busy
        self.nonfinite_guard = nonfinite_guard
        self.best_metric, self.best_mode = best_metric, best_mode
        self.on_save = on_save
        self.stats: list[SaveStats] = []
        self._closed = False
        #: the signal whose save is under way (a repeat of it acts at once)
        self._handling_signal: int | None = None
        #: a repeated signal stopped waiting for the save: exit without waiting for it
        self._abandoned = False
        self._lock = None
        self._state_lock = threading.RLock()
        self._index: dict[int, CheckpointInfo] = {}
        self._resolve = _resolver()
        self._last_flat_structure = None
        self._recovered: tuple[Any, Any, int] | None = None

        # retention
        self.retention: list[RetentionPolicy] = list(retention or [])
        if keep_last is not None:
            self.retention.append(KeepLast(keep_last))
        if keep_every_steps is not None:
            self.retention.append(KeepEverySteps(keep_every_steps))
        if keep_best is not None:
            self.retention.append(KeepBest(keep_best, best_metric or "", best_mode))

        if read_only:
            self.directory_id = self._read_identity() or ""
            self._engine = None
            self._tier = None
            self._reconcile_index(write=False)
            self._policy: SavePolicy | None = None
            self._signals: dict[int, Any] = {}
            self._pending_signal: int | None = None
            return

        self._lock = self.storage.lock()
        try:
            self.directory_id = self._read_identity() or self._create_identity()
            removed = self.storage.cleanup_incomplete()
            if removed:
                log.warning("pitstop: removed %d leftover(s) of interrupted saves in %s: %s",
                            len(removed), self.directory, ", ".join(removed))
            self._reconcile_index(write=True)

            # memory tier
            root = memtier_mod.default_root() if memory_tier in (None, True) else (
                memory_tier if isinstance(memory_tier, str) else None)
            if memory_tier is True and root is None:
                raise ValueError("memory_tier=True but /dev/shm is not available; pass a "
                                 "directory on a tmpfs, or memory_tier=False")
            self._tier = MemoryTier(root, self.directory, self.directory_id) if root else None
            pin_hooks = _pin_hooks()
            self.pool = StagingPool(max_in_flight, self._tier.prefix if self._tier else None,
                                    pin_hooks)
            self._engine = Engine(
                self.storage, hash_algorithm=hash_algorithm, compression=compression,
                writer_threads=writer_threads or min(4, os.cpu_count() or 2), pool=self.pool,
                directory_id=self.directory_id, on_commit=self._on_commit, tier=self._tier,
                name_of=step_name, copy_threads=copy_threads)
            self.hooks = self._engine.hooks

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
                policies.append(OnImprovement(best_metric, best_mode, self._best_so_far()))
            if save_policy is not None:
                policies.append(save_policy)
            self._policy = AnyOf(*policies) if policies else None
            self._ctx = SaveContext(last_save_step=self.latest_step())

            self._signals = {}
            self._pending_signal = None
            self._install_signals(save_on_signals)
            if self._tier is not None:
                self._recover_tier()
        except BaseException:
            self._release_lock()
            raise

    # ================================================================== public API
    def step(self, step: int, state: Any, metrics: Mapping[str, Any] | None = None
             ) -> SaveHandle | None:
        """Call once per training step; saves when a policy (or a signal) says so.

        Returns the save's handle, or None on the (almost free) steps that do not save.
        """
        engine = self._engine
        if engine is None:
            raise CheckpointError("this CheckpointManager is read_only")
        if engine.error is not None:
            engine.raise_pending()
        if self._pending_signal is not None:
            return self._handle_signal(step, state, metrics)
        policy = self._policy
        if policy is None:
            return None
        ctx = self._ctx
        ctx.now = time.monotonic()
        ctx.metrics = metrics  # type: ignore[assignment]
        if not policy.should_save(step, ctx):
            return None
        if step in self._index:
            return None
        return self._save(step, state, metrics, block=self.on_busy == "wait", periodic=True)

    def save(self, step: int, state: Any, metrics: Mapping[str, Any] | None = None, *,
             user_metadata: Mapping[str, Any] | None = None) -> SaveHandle:
        """Save now. Blocks for the snapshot only (and for a free staging buffer); the
        returned handle's ``wait()`` / ``result()`` wait for the commit."""
        if self._engine is None:
            raise CheckpointError("this CheckpointManager is read_only")
        self._engine.raise_pending()
        if step in self._index:
            raise StepExistsError(
                f"{self.storage.path_of(step_name(step))} already exists; pitstop never "
                "overwrites a committed checkpoint. Save under a new step, or delete it first.")
        handle = self._save(step, state, metrics, block=True, periodic=False,
                            user_metadata=user_metadata)
        assert handle is not None
        return handle

    def restore(self, state: Any, step: int | None = None, *, strict: bool = True
                ) -> RestoredStep | None:
        """Restore the newest valid checkpoint (or ``step``) into ``state`` in place.

        Returns the restored step (an int that also lists missing/unexpected/mismatched keys
        under ``strict=False``), or None when there is nothing to restore. A corrupt newest
        checkpoint is reported and the previous valid one used; an explicit ``step`` raises.
        """
        recovered = self._recovered
        from_memory = recovered is not None and (step is None or step == recovered[2])
        if self._engine is not None and not from_memory:
            self._engine.drain()
            self._engine.raise_pending()
        with _no_gc():
            flat = flatten(state, self._resolve)
        report: RestoreReport | None = None
        restored: int | None = None
        if from_memory:
            # straight from the verified shared-memory copy, while its persist to disk goes
            # on in the background: no waiting for the disk
            restored, report = self._restore_recovered(flat, strict)
        if restored is None:
            if self._engine is not None and from_memory:
                self._engine.drain()
                self._engine.raise_pending()
            restored, report = self._restore_from_disk(flat, step, strict)
        if restored is None:
            return None
        assert report is not None
        self._apply_adapters(flat)
        if self._engine is not None:
            self._ctx.last_save_step = restored
            self._ctx.last_save_time = time.monotonic()
        return RestoredStep(restored, report)

    def rollback(self, state: Any) -> RestoredStep | None:
        """Restore the newest checkpoint whose arrays were all finite (non-finite guard)."""
        self.wait()  # a save still persisting may be the newest finite one
        finite = sorted((s for s, i in self._index.items() if i.all_finite), reverse=True)
        if not finite:
            return None
        return self.restore(state, step=finite[0])

    def load(self, step: int | None = None) -> Any:
        """A fresh nested dict of numpy arrays and values (no target needed)."""
        if self._engine is not None:
            self._engine.drain()
        steps = [step] if step is not None else sorted(self.all_steps(), reverse=True)
        if step is not None and step not in self.all_steps():
            raise CheckpointNotFoundError(f"no checkpoint of step {step} in {self.directory}")
        last: Exception | None = None
        for s in steps:
            try:
                return CheckpointReader(self.storage, step_name(s)).load()
            except (CorruptCheckpointError, UnsupportedFormatError) as e:
                if step is not None:
                    raise
                warnings.warn(f"pitstop: skipping unreadable checkpoint: {e}", stacklevel=2)
                last = e
        if isinstance(last, UnsupportedFormatError):
            raise last
        if last is not None:
            raise CheckpointNotFoundError(f"no valid checkpoint in {self.directory}") from last
        raise CheckpointNotFoundError(f"no checkpoint in {self.directory}")

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """Committed steps, oldest first."""
        out = []
        for name in self.storage.list_checkpoints():
            m = _NAME.match(name)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def metadata(self, step: int) -> Manifest:
        """The parsed manifest of one checkpoint (metrics, user metadata, arrays)."""
        return CheckpointReader(self.storage, step_name(step)).manifest

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every pending save to commit; raises a background failure."""
        if self._engine is not None:
            self._engine.drain(timeout)
            self._engine.raise_pending()

    def close(self) -> None:
        """Wait for pending saves, release the directory and the memory tier."""
        if self._closed:
            return
        self._closed = True
        error: BaseException | None = None
        # a terminating signal that arrived after the last step(): pitstop only deferred it
        pending = self._pending_signal
        previous = self._signals.get(pending, signal.SIG_DFL) if pending is not None else None
        try:
            if self._engine is not None:
                self._engine.close()
                try:
                    self._engine.raise_pending()
                except CheckpointError as e:
                    error = e
                if self._recovered is not None:
                    self.pool.release(self._recovered[0])
                    self._recovered = None
                # the tier outlives crashes, not a clean close; keep it if the last save failed
                self.pool.close(unlink=error is None)
                if self._tier is not None and error is None:
                    self._tier.remove_all()
        finally:
            self._uninstall_signals()
            self._release_lock()
        if error is not None:
            raise error
        if pending is not None and signal.Signals(pending).name not in CONTINUE_SIGNALS:
            log.warning("pitstop: %s received after the last step; pending saves are "
                        "committed, acting on it now", signal.Signals(pending).name)
            self._pending_signal = None
            self._exit_like(pending, previous)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._abandoned:
            # a second Ctrl+C while the signal's save persisted: the user wants out now.
            # Do not wait for it; close() can still be called later to wait and release.
            log.warning("pitstop: interrupted twice; not waiting for the pending save "
                        "(its snapshot stays in the memory tier when that is on)")
            return
        if exc_type is not None and self._engine is not None:
            # the last consistent state is the last snapshot taken at a step boundary:
            # make sure it is committed before the exception propagates
            try:
                self._engine.drain()
            finally:
                log.warning("pitstop: %s during training; newest committed step: %s",
                            exc_type.__name__, self.latest_step())
            try:
                self.close()
            except CheckpointError as e:
                log.error("pitstop: %s", e)
            return
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed and not self._abandoned and self._engine is not None:
                self._pending_signal = None  # never kill or raise from the garbage collector
                self.close()
        except Exception:  # noqa: BLE001
            pass

    # ================================================================== saving
    def _save(self, step: int, state: Any, metrics: Mapping[str, Any] | None, *, block: bool,
              periodic: bool, user_metadata: Mapping[str, Any] | None = None
              ) -> SaveHandle | None:
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        engine = self._engine
        assert engine is not None
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed")
        if self._recovered is not None:  # first save after a recovery without restore
            # the recovered snapshot may still be persisting from that very buffer: let it
            # commit before a new snapshot may overwrite it
            engine.drain()
            self.pool.release(self._recovered[0])
            self._recovered = None
        clean_metrics = _metrics(metrics)
        stats = SaveStats(step=step)
        handle = SaveHandle(step, stats)
        if self.nonfinite_guard and any(
                isinstance(v, float) and not math.isfinite(v) for v in clean_metrics.values()):
            stats.skipped = "non-finite metrics (non-finite guard)"
            log.warning("pitstop: step %d not saved: %s", step, stats.skipped)
            handle._finish()
            return handle
        t0 = time.perf_counter()
        with _no_gc():  # the cyclic GC would rescan the heap while we allocate leaf objects
            flat = flatten(state, self._resolve)
            buf = engine.snapshot(flat, step, block=block or not periodic)
        if buf is None:
            stats.skipped = "previous save still persisting (on_busy='skip')"
            log.debug("pitstop: step %d: %s", step, stats.skipped)
            handle._finish()
            return None if periodic else handle
        stats.stall_s = time.perf_counter() - t0
        stats.bytes = buf.layout.total
        stats.arrays = len(flat.arrays)
        job = PersistJob(step=step, buffer=buf, values=flat.values, structure=flat.structure,
                         metrics=clean_metrics, handle=handle,
                         user_metadata=dict(user_metadata or {}),
                         check_finite=self.nonfinite_guard)
        # values are captured by reference; the snapshot must not see later mutations
        job.values = {k: _freeze(v) for k, v in flat.values.items()}
        # recorded before the persist starts: on_save must find these figures, not blanks
        self.stats.append(stats)
        if len(self.stats) > 1000:
            del self.stats[:500]
        engine.submit(job)
        ctx = self._ctx
        ctx.last_save_step = step
        ctx.last_save_time = time.monotonic()
        if self._policy is not None:
            ctx.metrics = clean_metrics
            saved = getattr(self._policy, "saved", None)
            if saved is not None:
                saved(step, ctx)
        if self._auto is not None:
            self._auto.update(stats.stall_s)
        if not self.async_save:
            try:
                handle.wait()
            except CheckpointError as e:
                engine.forget(e)  # reported right here; the next call must not raise it again
                raise
        return handle

    def _on_commit(self, manifest: Manifest, name: str) -> None:
        """Background thread, after a commit: index, then retention."""
        info = CheckpointInfo(step=manifest.step, metrics=manifest.metrics, ours=True,
                              all_finite=manifest.all_finite)
        with self._state_lock:
            self._index[manifest.step] = info
            doomed = to_delete(list(self._index.values()), self.retention)
            for s in doomed:
                if not self._written_here(s):
                    # the index said ours, the directory says otherwise (copied in, replaced)
                    old = self._index[s]
                    self._index[s] = CheckpointInfo(s, old.metrics, False, old.all_finite,
                                                    old.protected)
                    log.warning("pitstop: retention leaves %s alone: this manager did not "
                                "write it", self.storage.path_of(step_name(s)))
                    continue
                try:
                    if self.storage.delete_if_unread(step_name(s)):
                        del self._index[s]
                        log.info("pitstop: retention deleted step %d", s)
                    else:
                        log.info("pitstop: retention keeps step %d for now: it is being read", s)
                except FileNotFoundError:
                    del self._index[s]
                except OSError as e:  # a failed deletion must not fail the committed save
                    log.warning("pitstop: retention could not delete step %d: %s", s, e)
            self._write_index()
        for stats_cb in (self.on_save,):
            if stats_cb is not None:
                try:
                    stats_cb(self._stats_of(manifest.step))
                except Exception:  # noqa: BLE001
                    log.exception("pitstop: on_save callback failed")

    def _written_here(self, step: int) -> bool:
        """True when the checkpoint's own manifest names this directory's id (checked right
        before retention deletes it: pitstop never deletes what it did not write)."""
        try:
            m = CheckpointReader(self.storage, step_name(step)).manifest
        except (CheckpointError, OSError):
            return False
        return bool(self.directory_id) and m.directory_id == self.directory_id

    def _stats_of(self, step: int) -> SaveStats:
        for s in reversed(self.stats):
            if s.step == step:
                return s
        return SaveStats(step=step)

    # ================================================================== restoring
    def _restore_from_disk(self, flat: FlatState, step: int | None, strict: bool
                           ) -> tuple[int | None, RestoreReport | None]:
        steps = self.all_steps()
        if step is not None:
            if step not in steps:
                raise CheckpointNotFoundError(
                    f"no checkpoint of step {step} in {self.directory} (have: {steps[-10:]})")
            reader = CheckpointReader(self.storage, step_name(step))
            with self._reading(step_name(step)):
                return step, reader.restore_into(flat, strict)
        newer: UnsupportedFormatError | None = None
        corrupt: list[str] = []
        for s in reversed(steps):
            name = step_name(s)
            try:
                reader = CheckpointReader(self.storage, name)
                with self._reading(name):
                    report = reader.restore_into(flat, strict)
                return s, report
            except CorruptCheckpointError as e:
                msg = (f"pitstop: checkpoint {self.storage.path_of(name)} is corrupt ({e}); "
                       "falling back to the previous one")
                log.error(msg)
                warnings.warn(msg, stacklevel=3)
                corrupt.append(f"{name}: {e}")
                self._quarantine(s)
            except UnsupportedFormatError as e:
                # written by a newer pitstop: not corrupt, so never moved aside
                msg = (f"pitstop: cannot read checkpoint {self.storage.path_of(name)} ({e}); "
                       "falling back to the previous one")
                log.error(msg)
                warnings.warn(msg, stacklevel=3)
                newer = newer or e
        if newer is not None:
            raise newer  # nothing older to use: never start from scratch silently
        if corrupt:
            # checkpoints existed but none is valid: starting from scratch must be the user's
            # decision, not a silent one
            raise CorruptCheckpointError(
                f"no valid checkpoint in {self.directory}: all {len(corrupt)} failed "
                f"verification ({'; '.join(corrupt[:3])}). They were moved aside as "
                "step_*.corrupt-*; restore() again starts from scratch.",
                checkpoint=self.directory)
        return None, None

    def _reading(self, name: str) -> Any:
        return self.storage.read_lease(name)

    def _quarantine(self, step: int) -> None:
        """Move a corrupt checkpoint aside (never deleted) so later saves can reuse its step."""
        if self.read_only:
            return
        name = step_name(step)
        new = self.storage.quarantine(name)
        if new is None:
            log.warning("pitstop: corrupt checkpoint %s stays in place (this storage cannot "
                        "move it aside)", name)
            return
        with self._state_lock:
            self._index.pop(step, None)
            self._write_index()
        log.warning("pitstop: moved corrupt checkpoint %s aside to %s", name, new)

    def _apply_adapters(self, flat: FlatState) -> None:
        for _path, node in flat.adapters:
            node.adapter.apply(node.obj, node.subtree if node.holder is None else node.holder[0])

    # ================================================================== memory tier
    def _recover_tier(self) -> None:
        """Verify a crashed job's newest snapshot in shared memory and finish persisting it."""
        assert self._tier is not None
        tier = self._tier
        newest = self.latest_step()
        keep: set[str] = set()
        for meta, buf_path in tier.candidates():
            why = tier.trusted(meta, newest)
            if why is None and self._recovered is None:
                try:
                    buf = tier.open_buffer(meta, buf_path)
                    manifest_bytes = _tier_manifest(meta)
                    reader = CheckpointReader(_BufferStorage(buf, manifest_bytes, buf_path),
                                              "memory-tier")
                    reader.verify()
                except (CheckpointError, OSError, ValueError, KeyError) as e:
                    log.warning("pitstop: memory-tier snapshot of step %s is unusable: %s",
                                meta.get("step"), e)
                    continue
                step = int(meta["step"])
                log.warning("pitstop: found step %d in the memory tier, newer than the newest "
                            "committed step %s: restoring from memory and persisting it",
                            step, newest)
                self.pool.adopt(buf)
                buf.step = step
                self._recovered = (buf, reader, step)
                keep |= {buf_path, buf_path[: -len(".buf")] + ".json"}
                handle = SaveHandle(step, SaveStats(step=step, bytes=buf.layout.total,
                                                    arrays=len(buf.layout.keys)))
                values = {k: decode_value(v) for k, v in meta["values"].items()}
                job = PersistJob(step=step, buffer=buf, values=values,
                                 structure=meta["structure"], metrics=meta.get("metrics") or {},
                                 handle=handle, user_metadata=meta.get("user_metadata") or {},
                                 hashes=meta["hashes"], check_finite=bool(meta.get("check_finite")))
                job.release_buffer = False
                self._engine.submit(job)  # type: ignore[union-attr]
                self.stats.append(handle.stats)
            elif why is not None:
                log.info("pitstop: ignoring memory-tier snapshot of step %s: %s",
                         meta.get("step"), why)
        tier.remove_all(keep=keep)

    def _restore_recovered(self, flat: FlatState, strict: bool
                           ) -> tuple[int | None, RestoreReport | None]:
        assert self._recovered is not None
        buf, reader, step = self._recovered
        newest = self.latest_step()
        if newest is not None and newest > step:
            return None, None
        report = reader.restore_into(flat, strict)
        log.warning("pitstop: restored step %d from the memory tier", step)
        # the buffer stays held (its persist may still be reading it) until the next save
        # or close() releases it
        return step, report

    # ================================================================== signals
    def _install_signals(self, names: Iterable[str | int] | None) -> None:
        if not names or threading.current_thread() is not threading.main_thread():
            if names:
                log.debug("pitstop: not on the main thread; signal saves are off")
            return
        for n in names:
            signum = int(getattr(signal, n)) if isinstance(n, str) else int(n)
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN:
                continue
            self._signals[signum] = previous
            signal.signal(signum, self._on_signal)

    def _uninstall_signals(self) -> None:
        for signum, previous in list(self._signals.items()):
            try:
                if signal.getsignal(signum) == self._on_signal:
                    signal.signal(signum, previous)
            except (ValueError, TypeError):
                pass
        self._signals.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        # never save here: only note it; the next step() boundary saves
        if signum in (self._pending_signal, self._handling_signal):
            if signal.Signals(signum).name in CONTINUE_SIGNALS:
                return  # a save for it is already requested or under way
            # asked twice: the user means it, act now (also while the first save persists)
            self._abandoned = True
            self._exit_like(signum, self._signals.get(signum, signal.SIG_DFL))
        self._pending_signal = signum
        log.warning("pitstop: %s received; saving at the next step boundary",
                    signal.Signals(signum).name)

    def _handle_signal(self, step: int, state: Any, metrics: Mapping[str, Any] | None
                       ) -> SaveHandle | None:
        signum = self._pending_signal
        assert signum is not None
        self._handling_signal = signum
        self._pending_signal = None
        name = signal.Signals(signum).name
        try:
            handle = None
            if step not in self._index:
                handle = self._save(step, state, metrics, block=True, periodic=False)
            self.wait()
            log.warning("pitstop: saved step %d after %s", step, name)
            if name in CONTINUE_SIGNALS:
                return handle
            # the handler the program had before ours: close() uninstalls ours
            previous = self._signals.get(signum, signal.SIG_DFL)
            self.close()
            self._exit_like(signum, previous)
            return handle
        finally:
            self._handling_signal = None

    def _exit_like(self, signum: int, previous: Any) -> None:
        self._uninstall_signals()
        if signum == signal.SIGINT and previous in (signal.default_int_handler, signal.SIG_DFL):
            raise KeyboardInterrupt
        if callable(previous) and previous not in (signal.SIG_DFL, signal.SIG_IGN):
            previous(signum, None)
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        time.sleep(1)  # the signal is delivered at once; this is never reached in practice

    # ================================================================== index
    def _read_identity(self) -> str | None:
        raw = self.storage.read_meta("directory.json")
        if raw is None:
            return None
        try:
            return str(json.loads(raw)["directory_id"])
        except (ValueError, KeyError):
            return None

    def _create_identity(self) -> str:
        ident = uuid.uuid4().hex
        self.storage.write_meta("directory.json", json.dumps(
            {"directory_id": ident, "created_unix": time.time()}).encode())
        return ident

    def _reconcile_index(self, write: bool) -> None:
        """Load what retention knows; rebuild entries from manifests where it is stale."""
        raw = self.storage.read_meta("index.json")
        known: dict[int, CheckpointInfo] = {}
        if raw is not None:
            try:
                doc = json.loads(raw)
                if doc["directory_id"] != self.directory_id:
                    raise ValueError("the index of another directory")
                for s, d in doc["checkpoints"].items():
                    metrics = d.get("metrics") or {}
                    if not isinstance(metrics, dict):
                        raise TypeError(f"metrics of step {s} are not a dict")
                    known[int(s)] = CheckpointInfo(int(s), metrics,
                                                   bool(d.get("ours")), d.get("all_finite"),
                                                   bool(d.get("protected")))
            except (ValueError, KeyError, TypeError, AttributeError):
                log.warning("pitstop: %s/.pitstop/index.json is unreadable; rebuilding it",
                            self.directory)
                known = {}
        index: dict[int, CheckpointInfo] = {}
        for s in self.all_steps():
            if s in known:
                index[s] = known[s]
                continue
            try:
                m = CheckpointReader(self.storage, step_name(s)).manifest
            except CheckpointError as e:
                log.warning("pitstop: cannot read checkpoint of step %d: %s", s, e)
                index[s] = CheckpointInfo(s, {}, ours=False)
                continue
            index[s] = CheckpointInfo(s, m.metrics, ours=m.directory_id == self.directory_id
                                      and bool(self.directory_id), all_finite=m.all_finite)
        self._index = index
        if write and index != known:
            self._write_index()

    def _write_index(self) -> None:
        doc = {"directory_id": self.directory_id, "checkpoints": {
            str(s): {"metrics": i.metrics, "ours": i.ours, "all_finite": i.all_finite,
                     "protected": i.protected} for s, i in sorted(self._index.items())}}
        # the index is derived from the manifests (rebuilt when stale), so it costs no fsync
        self.storage.write_meta("index.json", json.dumps(doc, allow_nan=True).encode(),
                                durable=False)

    def _best_so_far(self) -> float | None:
        if self.best_metric is None:
            return None
        vals = [i.metrics.get(self.best_metric) for i in self._index.values()]
        nums = [float(v) for v in vals if isinstance(v, (int, float)) and math.isfinite(v)]
        if not nums:
            return None
        return min(nums) if self.best_mode == "min" else max(nums)

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


# ====================================================================== helpers
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


def _metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in (metrics or {}).items():
        if hasattr(v, "item") and callable(v.item):
            v = v.item()  # numpy / framework scalars
        if isinstance(v, (int, float, str, bool)) or v is None:
            out[str(k)] = v
        else:
            raise TypeError(f"metric {k!r} must be a number or string, got {type(v).__name__}")
    return out


def _freeze(v: Any) -> Any:
    """A deep copy of a JSON-able value, so later mutation of the live state is not saved."""
    if isinstance(v, dict):
        return {k: _freeze(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_freeze(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_freeze(x) for x in v)
    return v


def _pin_hooks() -> list[Any]:
    from ..adapters.registry import staging_hooks
    return staging_hooks  # the live list: adapters imported later add their hooks to it


def _tier_manifest(meta: dict[str, Any]) -> bytes:
    """A manifest describing a memory-tier buffer, so the normal reader can verify it."""
    from .manifest import ArrayEntry
    m = Manifest(step=int(meta["step"]), hash_algorithm=meta["hash_algorithm"],
                 structure=meta["structure"], values=meta["values"],
                 metrics=meta.get("metrics") or {}, directory_id=meta.get("directory_id"))
    layout = meta["layout"]
    m.files["shm.buf"] = int(layout["total"])
    for k, dt, shape, off, n in layout["arrays"]:
        m.arrays[k] = ArrayEntry(dtype=dt, shape=list(shape), file="shm.buf", offset=int(off),
                                 length=int(n), hash=meta["hashes"][k])
    return m.to_bytes()


class _BufferStorage:
    """Just enough of the Storage interface to read a memory-tier buffer with the reader."""

    def __init__(self, buf: Any, manifest: bytes, location: str) -> None:
        self.buf = buf
        self.manifest = manifest
        self.location = location

    def path_of(self, name: str, relpath: str = "") -> str:
        return f"memory tier {self.location}"

    def read_bytes(self, name: str, relpath: str) -> bytes:
        return self.manifest

    def size(self, name: str, relpath: str) -> int:
        return int(self.buf.buf.size)

    def read_into(self, name: str, relpath: str, offset: int, out: Any) -> int:
        view = memoryview(out).cast("B")
        src = self.buf.buf[offset:offset + len(view)]
        view[: len(src)] = memoryview(src)
        return len(src)
