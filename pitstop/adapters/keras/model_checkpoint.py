"""``keras.callbacks.ModelCheckpoint`` with one import changed.

It subclasses Keras's own callback, so arguments, defaults, validation errors, formatted
paths, best-only decisions and verbose messages are Keras's. What changes is underneath: it
writes its files from an in-memory snapshot in the background, atomically, with an integrity
record (``BackupAndRestore``, the other callback: ``backup_and_restore``).
"""

from __future__ import annotations

import atexit
import collections
import collections.abc
import concurrent.futures
import errno
import logging
import os
import warnings
import weakref
from typing import Any

import keras
import numpy as np

from pitstop.adapters.keras import files
from pitstop.core.errors import CheckpointWriteError
from pitstop.core.storage.sidecar import remove_stale_temporaries

_KerasModelCheckpoint: Any = keras.callbacks.ModelCheckpoint

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
            remove_stale_temporaries(folder)  # left by a writer killed mid-file
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


