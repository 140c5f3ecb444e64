"""``keras.callbacks.ModelCheckpoint`` and ``BackupAndRestore`` with one import changed.

Both subclass Keras's own callbacks, so arguments, defaults, validation errors, formatted
paths, best-only decisions and verbose messages are Keras's. What changes is underneath:
``ModelCheckpoint`` writes its files from an in-memory snapshot in the background, atomically,
with an integrity record; ``BackupAndRestore`` keeps pitstop checkpoints (asynchronous,
hashed, memory tier, saved on SIGTERM) and resumes mid-epoch exactly.
"""

from __future__ import annotations

import atexit
import collections
import collections.abc
import concurrent.futures
import contextlib
import errno
import logging
import os
import shutil
import sys
import warnings
import weakref
from typing import Any

import keras
import numpy as np

from pitstop.adapters.keras import files
from pitstop.adapters.keras._leaf import BACKEND, KerasVariableLeaf, _host, numpy_dtype
from pitstop.adapters.rng import RNG
from pitstop.core.adapter import Adapter
from pitstop.core.errors import CheckpointError, CheckpointWriteError, IncompatibleTargetError

_KerasModelCheckpoint: Any = keras.callbacks.ModelCheckpoint
_KerasBackupAndRestore: Any = keras.callbacks.BackupAndRestore

log = logging.getLogger("pitstop")
#: saves whose file is still being written, at most, before the next one waits for the oldest
_MAX_PENDING = 2


def _report_at_exit(ref: weakref.ref[ModelCheckpoint]) -> None:
    """At exit, a write that failed after fit() had ended by an exception (no on_train_end
    raised it) is reported once, in the log."""
    cb = ref()
    if cb is None:
        return
    cb._finish_all()
    if cb._failure is not None:
        log.error("pitstop: %s", cb._failure)
        cb._failure = None


def _print(message: str) -> None:
    try:
        from keras.src.utils.io_utils import print_msg
    except ImportError:  # pragma: no cover - another Keras layout
        print(message)
    else:
        print_msg(message)


def _scalars(logs: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in (logs or {}).items():
        try:
            a = np.asarray(keras.ops.convert_to_numpy(v))
        except Exception:
            continue
        if a.shape == () and a.dtype.kind in "fiub":
            out[str(k)] = float(a)
    return out


def _refuse_url(filepath: Any) -> None:
    """A URL (s3://, gs://, memory://) is refused here, at construction: it would otherwise
    be taken for a local folder named ``s3:``."""
    from pitstop.core.errors import InvalidArgumentError
    from pitstop.core.storage import is_url

    text = os.fspath(filepath) if isinstance(filepath, (str, os.PathLike)) else None
    if isinstance(text, str) and is_url(text):
        raise InvalidArgumentError(
            f"ModelCheckpoint({text!r}): pitstop's ModelCheckpoint writes local files only; "
            "give it a local path (and copy the files to the store), or keep backups in the "
            f"store with BackupAndRestore({text.rsplit('/', 1)[0]!r}) / "
            "pitstop.CheckpointManager, which take s3:// and other fsspec URLs")


class ModelCheckpoint(_KerasModelCheckpoint):
    """Keras's ``ModelCheckpoint`` (same arguments, files and decisions), written atomically.

    By default the file is whole when the callback returns (a callback after it can load
    it), as with Keras's; ``write_in_background=True`` makes a save cost ``fit()`` an
    in-memory copy only, the file written in a background thread. It appears atomically (never half-written, even
    after SIGKILL) with ``<file>.pitstop`` beside it (size, hash, epoch, batch, logs: see
    :func:`pitstop.adapters.keras.verify_file`). ``keep_last`` keeps only the newest N files this
    callback wrote. With ``save_best_only`` and a batch ``save_freq``, a ``val_`` metric
    (computed at epoch ends only) is judged when it is fresh, at the epoch's end, instead of
    saving unjudged at every batch save; one warning says so. ``fit()`` returns once every
    file is written; a write that failed raises :class:`pitstop.CheckpointWriteError`. When
    ``fit()`` ends by an exception, the files it asked for are still written (``wait()``
    waits for them; a failure is raised there, or logged at exit).
    """

    def __init__(self, filepath: Any, monitor: str = "val_loss", verbose: int = 0,
                 save_best_only: bool = False, save_weights_only: bool = False,
                 mode: str = "auto", save_freq: str | int = "epoch",
                 initial_value_threshold: float | None = None, *,
                 keep_last: int | None = None, write_in_background: bool = False) -> None:
        _refuse_url(filepath)
        super().__init__(filepath, monitor=monitor, verbose=verbose,
                         save_best_only=save_best_only, save_weights_only=save_weights_only,
                         mode=mode, save_freq=save_freq,
                         initial_value_threshold=initial_value_threshold)
        if keep_last is not None and (isinstance(keep_last, bool)
                                      or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be None or an integer >= 1, got {keep_last!r}")
        self.keep_last = keep_last
        if not isinstance(write_in_background, bool):
            raise ValueError("write_in_background must be True or False, got "
                             f"{write_in_background!r}")
        #: False (the default, as Keras's callback): the file is complete when the callback
        #: returns, so a callback after it can load it; True: fit() waits for an in-memory
        #: copy only and the file appears once written in the background
        self.write_in_background = write_in_background
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: collections.deque[tuple[str, concurrent.futures.Future[None]]] = (
            collections.deque())
        self._written: list[str] = []
        self._failure: BaseException | None = None
        self._stale_warned = False
        self._monitor_seen = False

    # ------------------------------------------------------------------ decisions
    def _judged_at_epoch_end(self) -> bool:
        """Best-only with batch saves on a metric only validation produces."""
        return (self.save_best_only and self.save_freq != "epoch"
                and str(self.monitor).startswith("val_"))

    def on_train_begin(self, logs: Any = None) -> None:
        folder = os.path.dirname(os.path.abspath(self.filepath))
        if "{" not in folder:
            files.remove_stale_temporaries(folder)  # left by a writer killed mid-file
        if self._judged_at_epoch_end() and not self._stale_warned:
            self._stale_warned = True
            warnings.warn(
                f"ModelCheckpoint(save_best_only=True, monitor={self.monitor!r}, "
                f"save_freq={self.save_freq!r}): {self.monitor!r} is computed only at the end "
                "of an epoch (validation), so no batch save ever sees a fresh value. pitstop "
                "judges it at each epoch end and saves then if it improved; Keras's own "
                "callback would save unjudged at every batch save. Use save_freq='epoch', or "
                "monitor a training metric (e.g. 'loss') to judge at batch saves.",
                UserWarning, stacklevel=2)
        super().on_train_begin(logs)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        super().on_epoch_end(epoch, logs)
        if not self._judged_at_epoch_end():
            return
        if self.monitor in (logs or {}):
            self._monitor_seen = True
        elif self._monitor_seen:
            return  # no validation this epoch (validation_freq): nothing fresh to judge
        # judged on the fresh value; a run with no validation at all saves as Keras's
        # callback does (its warning says the metric is not available)
        self._save_model(epoch=epoch, batch=self._last_batch_seen, logs=logs, _fresh=True)

    def _save_model(self, epoch: int, batch: int | None, logs: Any,
                    _fresh: bool = False) -> None:
        logs = logs or {}
        if not _fresh and batch is not None and self._judged_at_epoch_end() \
                and self.monitor not in logs:
            return  # judged at the epoch's end, on a fresh value (warned at train begin)
        self._raise_failure()
        if self.save_best_only and self.monitor_op is None and self.monitor in logs:
            # Keras sets the comparison at the first epoch end only, so its own callback
            # fails (TypeError) at the second batch save of the first epoch
            self._set_monitor_op()
        filepath = self._get_file_path(epoch, batch, logs)
        if not self._should_save_model(epoch, batch, logs, filepath):
            return
        if os.path.isdir(filepath):
            raise OSError("Please specify a non-directory filepath for ModelCheckpoint. "
                          f"Filepath used is an existing directory: {filepath}")
        snap = files.snapshot(self.model, filepath, self.save_weights_only)
        info = {"epoch": epoch + 1, "batch": None if batch is None else batch + 1,
                "logs": _scalars(logs), "monitor": self.monitor,
                "best": None if self.best is None else float(self.best)}
        self._submit(snap, filepath, info)
        if self.verbose > 0:
            # Keras's message, where Keras prints it; with write_in_background it marks the
            # snapshot: the file appears, whole, once written in the background
            _print(f"\nEpoch {epoch + 1}: finished saving model to {filepath}")

    # ------------------------------------------------------------------ background writes
    def _submit(self, snap: files.Snapshot, filepath: str, info: dict[str, Any]) -> None:
        while len(self._pending) >= _MAX_PENDING:
            self._finish_one()
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="pitstop-keras-checkpoint")
            atexit.register(_report_at_exit, weakref.ref(self))
        if snap.model is not None or not self.write_in_background:
            # the drop-in default: the file is whole before the next callback runs; and
            # Keras saves the file itself (legacy .h5, or internals this pitstop does not
            # know): it reads the live model, so it runs here, before training goes on
            self._finish_all()
            self._write(snap, filepath, info)
            return
        self._pending.append((filepath, self._pool.submit(self._write, snap, filepath, info)))

    def _write(self, snap: files.Snapshot, filepath: str, info: dict[str, Any]) -> None:
        try:
            files.write(snap, filepath, info)
        except OSError as e:
            hint = ("free disk space (or keep fewer files: keep_last=)"
                    if e.errno in (errno.ENOSPC, errno.EDQUOT) else
                    "check that the directory is writable")
            raise CheckpointWriteError(
                f"ModelCheckpoint could not write {filepath}: {e.strerror or e}; files "
                f"written before it are intact. {hint[0].upper()}{hint[1:]}.",
                path=filepath) from e
        full = os.path.abspath(filepath)
        if full in self._written:
            self._written.remove(full)
        self._written.append(full)
        if self.keep_last is not None:
            while len(self._written) > self.keep_last:
                files.remove(self._written.pop(0))

    def _finish_one(self) -> None:
        _, fut = self._pending.popleft()
        try:
            fut.result()
        except BaseException as e:
            self._failure = self._failure or e

    def _finish_all(self) -> None:
        while self._pending:
            self._finish_one()

    def _raise_failure(self) -> None:
        while self._pending and self._pending[0][1].done():
            self._finish_one()
        if self._failure is not None:
            e, self._failure = self._failure, None
            raise e

    def wait(self) -> None:
        """Wait until every file requested so far is written; raise the first failure."""
        self._finish_all()
        self._raise_failure()

    def on_train_end(self, logs: Any = None) -> None:
        self.wait()
        super().on_train_end(logs)


# ====================================================================== BackupAndRestore
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


#: fit()'s calls into its callbacks that a guard wraps (see _FitGuard)
#: (on_train_end too: a callback before this one that raises there ends fit() before this
#: one's on_train_end commits the backups)
_GUARDED_HOOKS = ("on_epoch_begin", "on_epoch_end", "on_train_batch_begin",
                  "on_train_batch_end", "on_test_begin", "on_test_end",
                  "on_test_batch_begin", "on_test_batch_end", "on_train_end")


def _callback_list(cb: Any) -> Any:
    """The ``CallbackList`` through which ``fit()`` calls ``cb`` (found from the hook that
    is running), or None where Keras's internals differ."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.callbacks.CallbackList) \
                and any(c is cb for c in getattr(owner, "callbacks", ())):
            return owner
        frame = frame.f_back
    return None


def _ends_the_data(e: BaseException) -> bool:
    """Whether ``e`` is how a train step says its input ran out (``fit()`` catches it and
    goes on with the next epoch), not a failure."""
    return isinstance(e, StopIteration) or type(e).__name__ == "OutOfRangeError"


class _FitGuard:
    """One ``fit()``'s calls into its callbacks, its train step and its validation, wrapped:
    a batch hook that ``hidden(name)`` says is passed over reaches no callback, and an
    exception from any of them calls ``on_failure`` (once) before it propagates, so that
    ``fit()`` never ends with a write of its callbacks in flight. :meth:`remove` puts back
    what it wrapped."""

    def __init__(self, on_failure: Any, hidden: Any) -> None:
        self._on_failure, self._hidden = on_failure, hidden
        self._wrapped: list[tuple[Any, str, bool, Any]] = []
        self._failed = False
        self.hides = False

    def install(self, callbacks: Any, model: Any, owner: Any = None) -> None:
        if callbacks is not None:
            self.hides = True
            for name in _GUARDED_HOOKS:
                self._wrap(callbacks, name, name in ("on_train_batch_begin",
                                                     "on_train_batch_end"))
            # the callbacks after ``owner`` are yet to run their on_train_begin (the list's
            # own call is under way: ours is one of it): a failure there ends fit() too
            later = list(getattr(callbacks, "callbacks", ()))
            at = next((i for i, c in enumerate(later) if c is owner), None)
            for c in later[at + 1:] if at is not None else ():
                self._wrap(c, "on_train_begin", False)
        if getattr(model, "train_function", None) is not None:
            self._wrap(model, "train_function", False)
        self._wrap(model, "evaluate", False)

    def _wrap(self, obj: Any, name: str, hideable: bool) -> None:
        real = getattr(obj, name)
        own = name in vars(obj)

        def call(*args: Any, **kwargs: Any) -> Any:
            if hideable and self._hidden(name):
                return None
            try:
                return real(*args, **kwargs)
            except BaseException as e:
                if not _ends_the_data(e):
                    self.fail()
                raise

        self._wrapped.append((obj, name, own, real))
        setattr(obj, name, call)

    def watch_input(self, it: Any) -> None:
        """Also watch fit()'s reading of its input: on torch the batches are read outside
        the train step (``EpochIterator.__next__``, within its ``catch_stop_iteration()``),
        so an exception of the data pipeline reaches neither a hook nor the train step."""
        if it is None or not callable(getattr(it, "catch_stop_iteration", None)):
            return
        real, guard = it.catch_stop_iteration, self

        class Watched:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self._inner = real(*args, **kwargs)

            def __enter__(self) -> Any:
                return self._inner.__enter__()

            def __exit__(self, kind: Any, e: Any, tb: Any) -> Any:
                if e is not None and not _ends_the_data(e):
                    guard.fail()
                return self._inner.__exit__(kind, e, tb)

        self._wrapped.append((it, "catch_stop_iteration", "catch_stop_iteration" in vars(it),
                              real))
        it.catch_stop_iteration = Watched

    def fail(self) -> None:
        if not self._failed:
            self._failed = True
            self._on_failure()

    def remove(self) -> None:
        while self._wrapped:
            obj, name, own, real = self._wrapped.pop()
            if own:
                setattr(obj, name, real)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)


#: options BackupAndRestore sets itself: what to pass instead
_OWN_OPTIONS = {
    "directory": "it is the backup_dir argument",
    "read_only": "backups are written; open the folder with pitstop.CheckpointManager("
                 "backup_dir, read_only=True) to read them",
    "on_busy": "BackupAndRestore saves whenever save_freq asks, as Keras's does (on_busy="
               "'wait'); drop the option",
}


def _type_ok(value: Any, hint: Any) -> bool:
    """Whether ``value`` fits the annotation ``hint`` (plain types, unions, containers'
    outer types; a bool is no int here); an annotation it cannot judge passes."""
    import collections.abc as abc
    import typing

    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    target = origin or hint
    if target is abc.Callable:
        return callable(value)
    if not isinstance(target, type) or getattr(target, "_is_protocol", False):
        return True
    if target in (int, float) and isinstance(value, bool):
        return False
    if target is float:
        return isinstance(value, (int, float))
    return isinstance(value, target)


def _check_manager_options(options: Any, double_checkpoint: bool) -> dict[str, Any]:
    """``manager_options`` checked when the callback is built: known names of
    :class:`pitstop.CheckpointManager`, values of the types it takes, none that the callback
    sets itself. A bad one raises InvalidArgumentError naming it and what to do."""
    import difflib
    import inspect
    import typing

    from pitstop.core.errors import InvalidArgumentError
    from pitstop.core.manager import CheckpointManager

    if options is None:
        return {}
    if not isinstance(options, collections.abc.Mapping):
        raise InvalidArgumentError(
            f"manager_options must be a dict of pitstop.CheckpointManager arguments, e.g. "
            f"{{'memory_tier': False}}; got a {type(options).__name__}")
    params = inspect.signature(CheckpointManager.__init__).parameters
    hints = typing.get_type_hints(CheckpointManager.__init__)
    known = [n for n in params if n not in ("self", "directory")]
    for name, value in options.items():
        if name in _OWN_OPTIONS:
            raise InvalidArgumentError(
                f"manager_options[{name!r}] is set by BackupAndRestore itself: "
                f"{_OWN_OPTIONS[name]}")
        if name not in params:
            near = difflib.get_close_matches(str(name), known, n=1)
            raise InvalidArgumentError(
                f"manager_options[{name!r}]: pitstop.CheckpointManager has no such option"
                + (f" (did you mean {near[0]!r}?)" if near else "")
                + f"; it takes {', '.join(known)}")
        hint = hints.get(name, Any)
        if not _type_ok(value, hint):
            raise InvalidArgumentError(
                f"manager_options[{name!r}] must be {_hint_text(hint)}, got "
                f"{type(value).__name__} {value!r}")
    keep = options.get("keep_last")
    if keep is not None and keep < (2 if double_checkpoint else 1):
        raise InvalidArgumentError(
            f"manager_options['keep_last']={keep!r} would keep fewer backups than "
            f"double_checkpoint={double_checkpoint} needs; pass keep_last >= "
            f"{2 if double_checkpoint else 1} or drop it")
    return dict(options)


def _hint_text(hint: Any) -> str:
    import typing

    args = typing.get_args(hint)
    if args and typing.get_origin(hint) not in (None,) and all(
            isinstance(a, type) or a is type(None) for a in args) \
            and typing.get_origin(hint) is not collections.abc.Iterable:
        return " or ".join("None" if a is type(None) else a.__name__ for a in args)
    return getattr(hint, "__name__", None) or str(hint).replace("collections.abc.", "")


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
