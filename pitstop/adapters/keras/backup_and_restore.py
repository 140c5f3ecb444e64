"""``keras.callbacks.BackupAndRestore`` with one import changed: backups are pitstop
checkpoints (asynchronous, hashed, memory tier, saved on SIGTERM), and a ``fit()``
interrupted anywhere, mid-epoch included, resumes exactly."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import warnings
from typing import Any

import keras
import numpy as np

from pitstop.adapters.keras._fit_guard import _callback_list, _FitGuard
from pitstop.adapters.keras._leaf import BACKEND, KerasVariableLeaf, _host, numpy_dtype
from pitstop.adapters.keras._options import _check_manager_options
from pitstop.adapters.keras.model_checkpoint import _scalars
from pitstop.adapters.rng import RNG
from pitstop.core.adapter import Adapter
from pitstop.core.errors import CheckpointError, IncompatibleTargetError

_KerasBackupAndRestore: Any = keras.callbacks.BackupAndRestore

log = logging.getLogger("pitstop")


class _FitState:
    """What a mid-``fit()`` backup holds, built fresh at each save (variables by reference)."""

    def __init__(self, owner: BackupAndRestore) -> None:
        self.owner = owner

    def state_dict(self) -> dict[str, Any]:
        o = self.owner
        model = o.model  # on JAX this property syncs the training state into the variables
        opt = model.optimizer
        gen = _global_seed_generator()
        return {
            "model": [KerasVariableLeaf(v) for v in model.variables],
            "optimizer": [KerasVariableLeaf(v) for v in (opt.variables if opt else [])],
            # running means of the loss and compiled metrics: a few floats, kept as values
            # (TensorFlow builds compiled metrics only at the first step of a new fit())
            "metrics": [[str(v.path), str(v.dtype), np.asarray(_host(v.value)).tolist()]
                        for v in model.metrics_variables],
            "global_seed": [KerasVariableLeaf(gen.state)] if gen is not None else [],
            "paths": {"model": [str(v.path) for v in model.variables],
                      "optimizer": [str(v.path) for v in (opt.variables if opt else [])]},
            "progress": dict(o._progress()),
            "rng": RNG().state_dict(),
            # the generators as they were when the current data iterator was drawn
            "rng_data": o._rng_data,
        }

    def load_state_dict(self, tree: dict[str, Any]) -> None:
        self.owner._loaded(tree)


class FitStateAdapter(Adapter):
    """A backup's state is matched strictly: every variable list must have the checkpoint's
    length, shapes and dtypes (a generic ``state_dict`` adapter may replace instead)."""

    def can_handle(self, obj: Any) -> bool:
        return isinstance(obj, _FitState)

    def capture(self, obj: _FitState) -> dict[str, Any]:
        return obj.state_dict()

    def apply(self, obj: _FitState, tree: dict[str, Any]) -> None:
        obj.load_state_dict(tree)


def _global_seed_generator() -> Any:
    from keras.src.backend.common import global_state

    return global_state.get_global_attribute("global_seed_generator")


def _epoch_iterator() -> Any:
    """The ``EpochIterator`` of the ``fit()`` calling back (a local of Keras's trainer), or
    None where Keras's internals differ: then the resume passes over the epoch's batches."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        it = frame.f_locals.get("epoch_iterator")
        if frame.f_code.co_name == "fit" and it is not None \
                and all(hasattr(it, a) for a in ("_steps_seen", "_current_iterator",
                                                 "steps_per_epoch")):
            return it
        frame = frame.f_back
    return None


class BackupAndRestore(_KerasBackupAndRestore):
    """Keras's ``BackupAndRestore`` (same arguments and semantics) that resumes exactly.

    Backups are pitstop checkpoints in ``backup_dir``: taken from an in-memory snapshot,
    written in the background, hashed, kept in the memory tier (a SIGKILL right after a save
    loses nothing) and taken on SIGTERM / SIGINT at the next batch. A ``fit()`` interrupted
    mid-epoch resumes at the next batch with the same shuffle order, dropout masks, metric
    running means, optimizer state and RNG streams as an uninterrupted ``fit()``: the
    batches already trained are passed over without computing, and no callback sees them
    (the first batch they see is the first one trained). When ``fit()`` ends by an
    exception, the backups it asked for are committed before the exception propagates.
    ``manager_options`` are passed on to the
    :class:`pitstop.CheckpointManager` that keeps the backups.
    """

    def __init__(self, backup_dir: Any, save_freq: str | int = "epoch",
                 double_checkpoint: bool = False, delete_checkpoint: bool = True, *,
                 manager_options: dict[str, Any] | None = None) -> None:
        super().__init__(backup_dir, save_freq=save_freq, double_checkpoint=double_checkpoint,
                         delete_checkpoint=delete_checkpoint)
        self.backup_dir = os.fspath(backup_dir)
        #: more keyword arguments for the pitstop.CheckpointManager that keeps the backups
        #: (memory_tier=, save_on_signals=, compression=, ...)
        self.manager_options = _check_manager_options(manager_options, double_checkpoint)
        self._mgr: Any = None
        self._state = _FitState(self)
        self._global = 0          # batches trained since the run began: the checkpoint step
        self._done_in_epoch = 0   # batches of the current epoch trained
        self._epoch_complete = False
        self._rng_data: Any = None
        self._rng_last: Any = None  # the generators after an epoch's last batch
        self._drawn = 0           # data iterators drawn since the run began (tf.data reshuffles)
        self._it: Any = None      # fit()'s EpochIterator, where it can be found
        self._counting = False    # whether its iterator creations are counted as they happen
        #: the latest logs as fit() gave them (converted only when a backup is taken: a
        #: conversion at every batch would wait for the device at every batch)
        self._last_logs: Any = {}
        self._resume: dict[str, Any] | None = None
        self._skip_until = 0
        self._real_train_function: Any = None
        self._metrics_pending: list[Any] | None = None
        self._guard: _FitGuard | None = None
        self._guard_warned = False  # whether it said once that the guard steps aside
        self._due_at_end = False  # a batch backup due at the epoch's last batch, taken at its end
        self._pass_left = [0]     # train calls still to pass over in the resumed epoch
        self._passed = False      # whether the latest train call passed over its batches

    # ------------------------------------------------------------------ bookkeeping
    def _progress(self) -> dict[str, Any]:
        return {"epoch": self._current_epoch,
                "batch": 0 if self._epoch_complete else self._done_in_epoch,
                "position": self._position(), "global": self._global,
                "iterators": self._drawn, "logs": _scalars(self._last_logs)}

    def _position(self) -> int:
        """Batches read from the current data iterator: this epoch's, or, where the iterator
        goes on across epochs (``steps_per_epoch`` on a stream), every one since it began."""
        it = self._it
        if it is None:
            return 0 if self._epoch_complete else self._done_in_epoch
        seen = int(getattr(it, "_steps_seen", 0) or 0)
        total = getattr(it, "_num_batches", None)
        return min(seen, int(total)) if total else seen

    def _manager(self) -> Any:
        if self._mgr is not None and self._mgr.closed:
            self._mgr = None  # closed by a signal's save (Ctrl+C) in an earlier fit()
        if self._mgr is None:
            from pitstop.core.manager import CheckpointManager
            from pitstop.core.policy import OnSteps

            # the callback saves when save_freq says (save()); its step() calls are there
            # for the signals only: a policy of no step says so (no "step() never saves")
            opts: dict[str, Any] = {"keep_last": 2 if self.double_checkpoint else 1,
                                    "on_busy": "wait", "save_policy": OnSteps(())}
            opts.update(self.manager_options)
            self._mgr = CheckpointManager(self.backup_dir, **opts)
        return self._mgr

    # ------------------------------------------------------------------ restore
    def on_train_begin(self, logs: Any = None) -> None:
        model = self.model
        if not model.built:
            raise ValueError(
                "To use the BackupAndRestore callback, you model must be built before you call "
                f"`fit()`. Model {model} is unbuilt. You can build it beforehand by calling it "
                "on a batch of data.")
        self._end_fit()  # (an earlier fit() that ended where no hook of ours saw it)
        self._guard = _FitGuard(self._fit_failed, self._hidden)
        self._guard.install(_callback_list(self), model, self)
        if not self._guard.hides and not self._guard_warned:
            self._guard_warned = True
            warnings.warn(
                "pitstop: BackupAndRestore cannot find the callback list through which this "
                "Keras's fit() calls its callbacks (its internals differ from the ones pitstop "
                "knows): on a mid-epoch resume the batches passed over still reach the other "
                "callbacks, shown the restored model, and a fit() ended by an exception of "
                "another callback may return before the backups are committed (call "
                "backup.wait() before touching backup_dir). Resuming itself is unaffected.",
                UserWarning, stacklevel=2)
        try:
            self._begin(model)
            self._guard.watch_input(self._it)
        except BaseException:
            self._end_fit()
            raise

    def _begin(self, model: Any) -> None:
        self._it = _epoch_iterator()
        self._counting = False
        if self._it is not None and BACKEND == "tensorflow":
            self._count_iterators(self._it)
        self._global, self._done_in_epoch, self._resume = 0, 0, None
        self._drawn, self._rng_last = 0, None
        self._current_epoch, self._last_batch_seen = 0, 0
        self._batches_seen_since_last_saving = 0
        self._epoch_complete = False
        mgr = self._manager()
        if mgr.latest_step() is None:
            mgr.report_restored(None)  # `pitstop run`: a fresh start
            return
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)  # to restore its slots into
        # a damaged newest backup is moved aside and the one before it restored (kept with
        # double_checkpoint=True); with none valid, CorruptCheckpointError says so
        try:
            restored = mgr.restore(self._state)
        except IncompatibleTargetError as e:
            raise IncompatibleTargetError(
                f"the backup in {self.backup_dir} was written for another model (or "
                f"compile()): {self._describe(e)}. Resume with the model and optimizer it was "
                "saved from, or give this run another backup_dir. Nothing was restored.\n"
                f"{e}", missing=e.missing_keys, unexpected=e.unexpected_keys,
                mismatched=e.mismatched_keys) from None
        if restored is None:
            return
        p = self._resume
        assert p is not None
        model._initial_epoch = p["epoch"] if p["epoch"] else None
        self._current_epoch = p["epoch"]
        self._global = p["global"]
        self._drawn = int(p.get("iterators", 0))
        if not p["batch"] and not p["position"]:
            RNG().load_state_dict(p["rng"])  # the run goes on from an epoch boundary
            self._resume = None
            self._burn(self._drawn)

    def _describe(self, e: IncompatibleTargetError) -> str:
        """The variables an incompatible-backup error's keys (``model/3``) stand for."""
        model = self.model
        parts = {"model": model.variables,
                 "optimizer": model.optimizer.variables if model.optimizer else []}
        out = []
        for key in [*e.mismatched_keys, *e.missing_keys][:4]:
            part, _, index = key.partition("/")
            if part in parts and index.isdigit() and int(index) < len(parts[part]):
                v = parts[part][int(index)]
                out.append(f"{part} variable {v.path} {v.dtype}{list(v.shape)} has no match")
        n = len(e.unexpected_keys)
        if n:
            out.append(f"{n} saved variable(s) have no place here")
        return "; ".join(out) or "the saved state has another structure"

    def _loaded(self, tree: dict[str, Any]) -> None:
        p = dict(tree["progress"])
        p["rng"], p["rng_data"] = tree["rng"], tree["rng_data"]
        p["metrics"] = list(tree["metrics"])  # given back when the resumed epoch begins
        self._resume = p

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._current_epoch = epoch
        self._done_in_epoch, self._epoch_complete, self._skip_until = 0, False, 0
        self._due_at_end = False
        p, self._resume = self._resume, None
        if p is not None and epoch == p["epoch"] and (p["batch"] or p["position"]):
            # this process's data iterator is drawn after this callback: draw it as the first
            # run drew it (its place among the dataset's iterators, the generators' state),
            # then pass over what that run had read from it
            self._burn(max(int(p.get("iterators", 1)) - 1, 0))
            # (where creations are counted, the one about to be drawn is counted then)
            self._drawn = int(p.get("iterators", 1)) - (1 if self._counting else 0)
            self._redraw(p["rng_data"])
            self._warn_inexact_input()
            batch = int(p["batch"])
            self._metrics_pending = p["metrics"] if batch else None
            if self._metrics_pending is not None \
                    and len(self.model.metrics_variables) == len(p["metrics"]):
                self._assign_metrics()
            self._last_logs = dict(p["logs"])
            self._done_in_epoch = self._skip_until = batch
            self._last_batch_seen = batch - 1
            self._pass_over(batch, max(int(p["position"]) - batch, 0), p["rng"])
            return
        it = self._it
        counted = 0 if self._counting else 1
        if it is None or it._current_iterator is None or it.steps_per_epoch is None:
            # a new data iterator is drawn this epoch, its shuffle from the generators now
            self._rng_data = {"begin": RNG().state_dict()}
            self._drawn += counted
        elif it._steps_seen == 0 and self._rng_last is not None:
            # a stream read across epochs ran out at the last epoch's end, where Keras drew
            # its next iterator (a torch DataLoader draws a seed then); its shuffle is drawn
            # now, at its first batch
            self._rng_data = {"created": self._rng_last, "begin": RNG().state_dict()}
            self._drawn += counted

    def _redraw(self, rng_data: dict[str, Any]) -> None:
        """Set the generators so that the data iterator this process draws for the resumed
        epoch is the one the interrupted run drew (see on_epoch_begin)."""
        it = self._it
        if rng_data.get("created") is not None and it is not None:
            RNG().load_state_dict(rng_data["created"])
            it._current_iterator = iter(it._get_iterator())  # drawn where Keras drew it
            it._steps_seen = 0
        RNG().load_state_dict(rng_data["begin"])
        self._rng_data = rng_data

    def _count_iterators(self, it: Any) -> None:
        """On TensorFlow each ``_get_iterator()`` of fit()'s EpochIterator starts a
        ``tf.data`` iterator (Keras draws one at each epoch's start and, for a dataset of
        known length, another at its end): count them all."""
        real = it.__dict__.get("_get_iterator_unwrapped", it._get_iterator)

        def counted() -> Any:
            self._drawn += 1
            return real()

        it._get_iterator_unwrapped = real
        it._get_iterator = counted
        self._counting = True

    def _burn(self, n: int) -> None:
        """Draw and drop ``n`` iterators of a ``tf.data`` input: a dataset that reshuffles
        each iteration gives its next iterator the order the first run's had."""
        it = self._it
        if not n or it is None:
            return
        source = getattr(it.data_adapter, "_dataset", None)
        if source is None or type(source).__module__.split(".")[0] != "tensorflow":
            return  # arrays, generators, torch loaders: their order is the generators'
        for _ in range(n):
            iter(source)

    def _warn_inexact_input(self) -> None:
        it = self._it
        adapter = getattr(it, "data_adapter", None)
        if getattr(adapter, "enqueuer", None) is not None:
            warnings.warn(
                "pitstop: this fit() reads a keras.utils.PyDataset with workers: Keras's "
                "enqueuer starts a process's first epoch with batches it prefetched before "
                "fit() began, so the resumed epoch may see its batches in another order than "
                "the interrupted run. For an exact resume use workers=1 (or a tf.data "
                "pipeline).", UserWarning, stacklevel=2)

    def _assign_metrics(self) -> None:
        saved, self._metrics_pending = self._metrics_pending or [], None
        mine = self.model.metrics_variables
        if len(mine) != len(saved):
            warnings.warn(
                f"pitstop: the backup in {self.backup_dir} holds {len(saved)} metric variables, "
                f"this model {len(mine)} (compile() changed?): the epoch's logged metrics "
                "restart from zero; weights and optimizer are restored exactly", stacklevel=2)
            return
        for v, (_, dtype, value) in zip(mine, saved, strict=True):
            KerasVariableLeaf(v).assign(np.asarray(value, dtype=numpy_dtype(dtype)))

    def _pass_over(self, batches: int, extra: int, rng_after: Any) -> None:
        """Make the epoch's first ``batches`` train steps consume their data and train
        nothing (they were trained before the interruption), after ``extra`` batches the
        data iterator gave in earlier epochs (a stream read across epochs)."""
        model = self.model
        real = self._real_train_function = model.train_function
        per_call = max(int(getattr(model, "steps_per_execution", 1) or 1), 1)
        left = self._pass_left = [batches]
        pending = [extra]
        logs = _scalars(self._last_logs)
        it = self._it

        def advance(iterator: Any, n: int) -> None:
            for _ in range(n):
                next(iterator)
            if it is not None:
                it._steps_seen += n

        def finish() -> None:
            model.train_function = real
            self._real_train_function = None
            RNG().load_state_dict(rng_after)

        def consume(iterator: Any) -> None:
            for _ in range(min(per_call, left[0])):
                data = next(iterator)
                if self._metrics_pending is not None:
                    # TensorFlow builds compiled metrics when it first traces a step: build
                    # them (symbolically: no layer runs) to give them their running values
                    model._symbolic_build(data_batch=data)
                    self._assign_metrics()

        def step(iterator: Any, train: Any) -> Any:
            """One call of the train function: passes over, or trains once all is passed."""
            try:
                if pending[0]:
                    n, pending[0] = pending[0], 0
                    advance(iterator, n)
                if left[0] <= 0:
                    finish()
                    self._passed = False
                    return train()
                consume(iterator)
            except BaseException:
                finish()  # the data ran out (the epoch ends): the next epoch trains
                raise
            self._passed = True
            left[0] -= per_call
            if left[0] <= 0:
                finish()
            return None

        if BACKEND == "jax":  # the train function pulls its batches from the iterator
            def skip(state: Any, iterator: Any) -> Any:
                out = step(iterator, lambda: real(state, iterator))
                return (logs, state) if out is None else out
        elif BACKEND == "tensorflow":
            def skip(iterator: Any) -> Any:  # type: ignore[misc]
                out = step(iterator, lambda: real(iterator))
                return logs if out is None else out
        else:  # torch: the step's batches were read before the call
            def skip(data: Any) -> Any:  # type: ignore[misc]
                source = it._current_iterator if it is not None else None
                if pending[0] and source is not None:
                    n, pending[0] = pending[0], 0
                    if left[0] > 0:
                        advance(source, n)  # this step's own batches are passed over too
                    else:  # this step trains: on the batches after the ones passed over
                        advance(source, n - len(data))
                        data = [next(source) for _ in data]
                        it._steps_seen += len(data)
                if left[0] <= 0:
                    finish()
                    self._passed = False
                    return real(data)
                self._passed = True
                left[0] -= per_call
                if left[0] <= 0:
                    finish()
                return logs
        model.train_function = skip

    # ------------------------------------------------------------------ saves
    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if batch < self._skip_until:
            return  # a batch passed over on resume
        steps = (self.params or {}).get("steps")
        done = min(batch + 1, int(steps)) if steps else batch + 1  # a last, partial execution
        self._global += done - self._done_in_epoch
        self._done_in_epoch = done
        self._last_logs = logs or {}
        it = self._it
        if it is not None and it.steps_per_epoch and it._num_batches \
                and it._steps_seen >= it._num_batches:
            # the stream is read to its end: Keras draws its next iterator after this batch
            self._rng_last = RNG().state_dict()
        # Keras's own count of the batches since the last backup (steps_per_execution too)
        due = self.save_freq is not False and self._should_save_on_batch(batch)
        self._last_batch_seen = batch
        mgr = self._manager()
        if due and steps and done >= int(steps):
            # the epoch's last batch: the backup is taken at the epoch's end, so that a
            # resume does not end this epoch a second time (a second CSVLogger row, a second
            # validation); a fit() failing before then takes it in _fit_failed
            self._due_at_end, due = True, False
        if due and self._global not in mgr.all_steps():
            mgr.save(self._global, self._state)
        else:
            mgr.step(self._global, self._state)  # a SIGTERM / SIGINT saves here

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._current_epoch = epoch + 1
        self._last_batch_seen = 0
        self._epoch_complete = True
        self._last_logs = logs or {}
        due_at_end, self._due_at_end = self._due_at_end, False
        if self.save_freq == "epoch" or due_at_end:
            mgr = self._manager()
            if self._global not in mgr.all_steps():
                mgr.save(self._global, self._state)

    def _hidden(self, hook: str) -> bool:
        """Whether fit()'s call of ``hook`` is about batches the resume passes over (trained
        before the interruption): no callback sees those, as none would in a fit() that was
        never interrupted, so none is shown a model that is not that batch's."""
        if hook == "on_train_batch_begin":
            return self._real_train_function is not None and self._pass_left[0] > 0
        passed, self._passed = self._passed, False
        return passed

    def _end_fit(self) -> None:
        """Put back what this fit() changed on the model and its callback list."""
        if self._real_train_function is not None:  # fit ended before the passing over did
            self.model.train_function = self._real_train_function
            self._real_train_function = None
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.remove()
        self._pass_left, self._passed = [0], False
        if self.model is not None:
            self.model._initial_epoch = None

    def _fit_failed(self) -> None:
        """fit() is ending by an exception (from a callback, its train step or its
        validation): the backups it asked for are committed before the exception goes on,
        so what the user does next (retry, delete backup_dir) never races a writer."""
        self._end_fit()
        mgr, self._mgr = self._mgr, None
        if mgr is None:
            return
        try:
            if self._due_at_end and not self._epoch_complete \
                    and self._global not in mgr.all_steps():
                mgr.save(self._global, self._state)  # the one deferred to the epoch's end
            self._due_at_end = False
            mgr.close()
        except CheckpointError as e:  # reported, without hiding the exception fit() ends by
            log.error("pitstop: %s", e)

    def on_train_end(self, logs: Any = None) -> None:
        self._end_fit()
        mgr, self._mgr = self._mgr, None
        if mgr is not None:
            mgr.close()
        if self.delete_checkpoint and os.path.exists(self.backup_dir):
            shutil.rmtree(self.backup_dir)

    def wait(self) -> None:
        """Wait until the backups requested so far are committed."""
        if self._mgr is not None:
            self._mgr.wait()
