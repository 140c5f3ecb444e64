"""``tf.train.CheckpointManager`` and ``tf.train.latest_checkpoint`` over pitstop run
directories (the ``Checkpoint`` they save: ``checkpoint``; the run directories: ``_runs``)."""

from __future__ import annotations

import glob
import logging
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from pitstop import CheckpointManager as _CoreManager
from pitstop.adapters.tf import _graph, _native, _restore
from pitstop.adapters.tf._options import check as _options
from pitstop.adapters.tf._runs import (
    _NUMBERED,
    _STATE,
    SIDE_RUNS,
    _fspath,
    _overwrite,
    _persist_memory_tier,
    _replace_native,
    _Runs,
    _RunState,
    read_tree,
)
from pitstop.adapters.tf.checkpoint import Checkpoint, _graph_root
from pitstop.core.errors import (
    CheckpointError,
    CorruptCheckpointError,
    InvalidArgumentError,
)

log = logging.getLogger("pitstop")


class CheckpointManager:
    """``tf.train.CheckpointManager`` over a pitstop run directory: same arguments, numbering,
    interval checks, paths (``<directory>/<checkpoint_name>-<N>``), ``checkpoints`` and
    ``latest_checkpoint``, and tf.train's retention (``max_to_keep``, then
    ``keep_checkpoint_every_n_hours`` for what falls out of it), carried across restarts in
    the newest checkpoint's manifest as tf.train carries it in its ``checkpoint`` file. Saves
    return after the snapshot (``sync()`` waits for the commit); a checkpoint the sweep
    drops is deleted once the newer one is committed. tf.train's own checkpoints of this
    name in the directory (its ``checkpoint`` state file) are listed, restored from and
    swept as tf.train's manager would (:mod:`._native`)."""

    def __init__(self, checkpoint: Checkpoint | tf.train.Checkpoint, directory: Any,
                 max_to_keep: int | None, keep_checkpoint_every_n_hours: float | None = None,
                 checkpoint_name: str = "ckpt", step_counter: Any = None,
                 checkpoint_interval: int | None = None, init_fn: Callable[[], Any] | None = None,
                 last_checkpoint_step: int | None = None, *, memory_tier: bool | None = None,
                 async_save: bool = True) -> None:
        if not isinstance(checkpoint, (Checkpoint, tf.train.Checkpoint)):
            raise InvalidArgumentError(
                f"checkpoint must be a pitstop.adapters.tf.Checkpoint (or a "
                f"tf.train.Checkpoint), got {type(checkpoint).__name__}")
        if max_to_keep is not None and (isinstance(max_to_keep, bool) or
                                        not isinstance(max_to_keep, int) or max_to_keep <= 0):
            raise InvalidArgumentError(
                f"Expected a positive integer or `None` for `max_to_keep`, got {max_to_keep}.")
        if checkpoint_interval is not None and step_counter is None:
            raise InvalidArgumentError(
                "`step_counter` should be passed if `checkpoint_interval` is not None.")
        if not isinstance(checkpoint_name, str) or not checkpoint_name or "/" in checkpoint_name:
            raise InvalidArgumentError(
                f"checkpoint_name must be a file name, got {checkpoint_name!r}")
        self._checkpoint = checkpoint
        self._root = checkpoint.tf_checkpoint if isinstance(checkpoint, Checkpoint) else \
            checkpoint
        self._directory = _fspath(directory, "directory")
        self._name = checkpoint_name
        self._prefix = os.path.join(self._directory, checkpoint_name)
        self._max_to_keep = max_to_keep
        self._hours = keep_checkpoint_every_n_hours
        self._step_counter = step_counter
        self._checkpoint_interval = checkpoint_interval
        self._last_checkpoint_step = last_checkpoint_step
        self._init_fn = init_fn
        self._mgr = _Runs.get(self._directory, f"{checkpoint_name}-", create=True,
                              memory_tier=memory_tier, async_save=async_save)
        self._run = _RunState.of(self._mgr)
        if isinstance(checkpoint, Checkpoint):
            checkpoint._runs[(os.path.abspath(self._directory), f"{checkpoint_name}-")] = \
                self._mgr
        # tf.train's state: the checkpoints it may still delete (save order, with their
        # save times), the time of the last one kept for keep_checkpoint_every_n_hours,
        # and the newest
        self._maybe_delete: dict[int, float] = {}
        self._latest: int | None = None
        #: the checkpoints saved as the newest, oldest first: when the save of the newest
        #: fails in the background, ``latest_checkpoint`` falls back to the one before it
        self._saved: list[int] = []
        now = time.time()
        #: the numbers of tf.train's own checkpoints of this name in the directory (a run
        #: that changed only its import): managed, restored and swept as tf.train's
        self._native = _native.steps(self._directory, f"{checkpoint_name}-")
        from_disk = self._run.state is None  # (not the state of a live writer here)
        state = self._run.recover()
        if state is not None and self._native and from_disk:
            self._finish_natives(state)
        if state is None and self._native:
            state = _native.state(self._directory, f"{checkpoint_name}-")
            if state is not None:
                log.info("pitstop: %s holds tf.train checkpoints; resuming from %s",
                         self._directory, self._path(state["latest"]))
        #: the newest checkpoint of another name in the directory, the latest until this
        #: manager saves when it has none of its own: tf.train's one ``checkpoint`` file
        #: per directory names it (a run continued from ``Checkpoint.save(dir/other)``)
        self._foreign: str | None = None
        if state is None:
            self._last_preserved = now
            other = latest_checkpoint(self._directory)
            if other is not None and not os.path.basename(other).startswith(
                    f"{checkpoint_name}-"):
                self._foreign = other
            return
        steps = set(self._mgr.all_steps()) | self._native
        self._last_preserved = float(state.get("last_preserved", 0.0))
        if now < self._last_preserved:
            log.warning(
                "pitstop: time.time() returned a value %s seconds behind the last preserved "
                "checkpoint timestamp.", self._last_preserved - now)
        for step, stamp in state.get("managed", []):
            stamp = min(float(stamp), now)
            if step in steps and stamp > self._last_preserved:
                self._maybe_delete[int(step)] = stamp
        latest = state.get("latest")
        self._latest = latest if isinstance(latest, int) else None
        self._saved = [] if self._latest is None else [self._latest]

    def _finish_natives(self, state: dict[str, Any]) -> None:
        """What the commit of the newest checkpoint was to do to tf.train's files, when its
        process died before (killed after ``save()`` returned, the save recovered from the
        memory tier): delete the native checkpoints its sweep dropped (else no later sweep
        knows them: they stay forever) and make tf.train's ``checkpoint`` file name it
        (else ``tf.train.latest_checkpoint`` names an older one in silence)."""
        latest = state.get("latest")
        if not isinstance(latest, int) or latest not in self._mgr.all_steps():
            return
        for n in state.get("native_doomed", []):
            if isinstance(n, int) and n in self._native:
                _native.delete(self._path(n))
                self._native.discard(n)
        if not _native.has_state_file(self._directory):
            return
        try:
            named = tf.train.get_checkpoint_state(self._directory)
        except (tf.errors.OpError, ValueError, OSError):
            return
        base = os.path.basename(named.model_checkpoint_path) if named is not None else ""
        m = _NUMBERED.match(base)
        if m and m.group(1) == self._name and int(m.group(2)) < latest:
            _native.record(self._directory, self._path(latest),
                           [(self._path(int(n)), float(t)) for n, t in state.get("managed", [])
                            if isinstance(n, int)],
                           float(state.get("last_preserved", 0.0)))

    @property
    def directory(self) -> str:
        return self._directory

    @property
    def checkpoint_interval(self) -> int | None:
        return self._checkpoint_interval

    @property
    def checkpoint(self) -> Checkpoint | tf.train.Checkpoint:
        return self._checkpoint

    def _path(self, step: int) -> str:
        return f"{self._prefix}-{step}"

    @property
    def latest_checkpoint(self) -> str | None:
        """The path of the checkpoint saved last (a save in flight included), or None."""
        self._forget_lost()
        if self._latest is None:
            return self._foreign
        return self._path(self._latest)

    @property
    def checkpoints(self) -> list[str]:
        """The checkpoints this manager may still delete, oldest saved first (not those kept
        for ``keep_checkpoint_every_n_hours``, nor those it did not save), as tf.train's."""
        self._forget_lost()
        return [self._path(s) for s in self._maybe_delete]

    def _forget_lost(self) -> None:
        """Drop the checkpoints that are neither committed nor being saved: a save that
        failed in the background (a full disk) never was a checkpoint, as a tf.train save
        that raised is not recorded, so it is not listed, not the latest, and does not count
        towards ``max_to_keep`` (which would delete a good checkpoint in its place)."""
        try:
            steps = set(self._mgr.all_steps()) | self._native
        except CheckpointError:  # a forked child: the parent's manager is not usable here
            return
        for step in [s for s in self._maybe_delete if s not in steps]:
            del self._maybe_delete[step]
        self._saved = [s for s in self._saved if s in steps]
        if self._latest is not None and self._latest not in steps:
            self._latest = self._saved[-1] if self._saved else None

    def _sweep(self) -> set[int]:
        """tf.train's sweep: beyond ``max_to_keep``, the oldest go, except one every
        ``keep_checkpoint_every_n_hours``, which is kept and no longer managed."""
        doomed: set[int] = set()
        if not self._max_to_keep:
            return doomed
        while len(self._maybe_delete) > self._max_to_keep:
            step = next(iter(self._maybe_delete))
            stamp = self._maybe_delete.pop(step)
            if self._hours and stamp - self._hours * 3600.0 >= self._last_preserved:
                self._last_preserved = stamp
                continue
            doomed.add(step)
        return doomed

    def save(self, checkpoint_number: Any = None, check_interval: bool = True,
             options: Any = None) -> str | None:
        """Save as tf.train's manager does (numbered by ``save_counter`` unless
        ``checkpoint_number`` is given); returns the path, or None when the interval check
        skipped it."""
        if self._checkpoint_interval is not None:
            current = _integer(self._step_counter, "step_counter")
            if self._last_checkpoint_step is not None:
                if current == self._last_checkpoint_step:
                    return None
                if check_interval and current < (
                        self._last_checkpoint_step + self._checkpoint_interval):
                    return None
            self._last_checkpoint_step = current
        counter = self._root.save_counter
        counter.assign_add(1)
        number = _integer(counter if checkpoint_number is None else checkpoint_number,
                          "checkpoint_number")
        options = _options(options, "save")
        now = time.time()
        self._forget_lost()
        if number in self._mgr.all_steps():
            _overwrite(self._mgr, number, self._path(number))
        if number in self._native:
            _replace_native(self._path(number))
            self._native.discard(number)
        # as tf.train, a save that raises records nothing: its state is put back
        natives = set(self._native)
        before = (dict(self._maybe_delete), self._latest, list(self._saved),
                  self._last_preserved, set(self._run.doomed), self._run.state)
        try:
            self._run.doomed.discard(number)
            self._maybe_delete.pop(number, None)
            self._maybe_delete[number] = now
            self._latest = number
            self._saved = [*(s for s in self._saved if s != number), number]
            swept = self._sweep()
            self._run.doomed.update(swept - self._native)
            state = self._run.record({
                "latest": number, "managed": [[s, t] for s, t in self._maybe_delete.items()],
                "last_preserved": self._last_preserved,
                # what this save's commit does to tf.train's files, done again by the next
                # manager when the process died first (a SIGKILL, its save recovered
                # from the memory tier): see _finish_natives
                "native_doomed": sorted(swept & self._native)})
            self._after_commit(number, swept, options)
            self._mgr.save(number, _graph_root(self._root), user_metadata={_STATE: state})
        except BaseException:
            if self._run.policy is not None:
                self._run.policy.forget(number)
            self._native = natives
            (self._maybe_delete, self._latest, self._saved, self._last_preserved, doomed,
             self._run.state) = before
            self._run.doomed.clear()
            self._run.doomed.update(doomed)
            raise
        return self._path(number)

    def _after_commit(self, number: int, swept: set[int], options: Any) -> None:
        """What happens once the save of ``number`` is committed (in pitstop's retention
        pass, registered before the save, as a synchronous one commits inside it): the native
        checkpoints its sweep dropped are deleted, tf.train's
        ``checkpoint`` file (of a directory that has one) names it, and the
        ``experimental_write_callbacks`` of its options are called with its path."""
        policy = self._run.policy
        if policy is None:
            return
        with policy._lock:
            for s in swept & self._native:
                policy.natives[self._path(s)] = number
            if _native.has_state_file(self._directory):
                policy.tf_states[number] = (
                    self._directory, self._path(number),
                    [(self._path(s), t) for s, t in self._maybe_delete.items()],
                    self._last_preserved)
            if options is not None and options.experimental_write_callbacks:
                policy.callbacks[number] = [
                    (f, self._path(number)) for f in options.experimental_write_callbacks]
        self._native -= swept

    def restore_or_initialize(self) -> str | None:
        """Restore the newest checkpoint (returns its path) or call ``init_fn`` (returns
        None)."""
        latest = self.latest_checkpoint
        if latest is not None and self._latest is None:  # another name's (tf.train's too)
            self._restore_path(latest)
        elif latest is not None:
            latest = self._restore_newest_valid()
        if latest is not None:
            if self._checkpoint_interval is not None:
                self._last_checkpoint_step = _integer(self._step_counter, "step_counter")
            return latest
        self._mgr.report_restored(None)  # `pitstop run`: a fresh start
        if self._init_fn is not None:
            self._init_fn()
        return None

    def _restore_newest_valid(self) -> str | None:
        """Restore ``latest_checkpoint``, or, when it is corrupt, the newest valid one before
        it, loudly (as pitstop's manager restores; the corrupt one is moved aside when
        pitstop wrote it, left in place when tf.train did). Returns the path restored."""
        assert self._latest is not None
        older = sorted((set(self._mgr.all_steps()) | self._native) - {self._latest},
                       reverse=True)
        for step in [self._latest, *older]:
            path = self._path(step)
            try:
                self._restore_path(path)
            except CorruptCheckpointError as e:
                msg = (f"pitstop: checkpoint {path} is corrupt ({e}); falling back to the "
                       "previous one")
                log.error(msg)
                warnings.warn(msg, stacklevel=3)
                if step in self._mgr.all_steps():
                    self._mgr.set_aside_corrupt(step)
                self._maybe_delete.pop(step, None)
                self._saved = [s for s in self._saved if s != step]
                # (still one of the native checkpoints: a save of its number replaces its
                # files, so that path never names the corrupt one beside a new one)
                continue
            self._latest = step
            if step not in self._saved:
                self._saved.append(step)
            return path
        self._latest = None
        raise CorruptCheckpointError(
            f"no valid checkpoint in {self._directory}: every {self._name}-<N> failed "
            "verification (see the warnings above); pitstop's were moved aside, so "
            "restore_or_initialize() again starts from scratch", checkpoint=self._directory)

    def _restore_path(self, path: str) -> None:
        if isinstance(self._checkpoint, Checkpoint):
            self._checkpoint.restore(path)
            return
        view = _graph_root(self._root)
        tree = read_tree(path, {
            (os.path.abspath(self._directory), f"{self._name}-"): self._mgr})
        r = _restore.Restore(tree, os.path.basename(path))
        r.check(view)
        _restore.restore_into(view, tree, os.path.basename(path), restore=r)

    def sync(self) -> None:
        """Wait for every save to commit (raises a failed one)."""
        self._mgr.wait()

    def close(self) -> None:
        """Commit what is in flight and release the directory."""
        self._mgr.close()


def latest_checkpoint(checkpoint_dir: str | os.PathLike[str],
                      latest_filename: str | None = None) -> str | None:
    """``tf.train.latest_checkpoint`` that also reads a pitstop run directory: the path of
    the checkpoint saved last (by a manager or ``Checkpoint.save``), or None; a directory
    of native TensorFlow checkpoints is answered by tf.train itself."""
    d = _fspath(checkpoint_dir, "checkpoint_dir")
    if not os.path.isdir(os.path.join(d, ".pitstop")):
        return tf.train.latest_checkpoint(d, latest_filename)
    # every name of the directory (its own and those beside it, see run_directory): the
    # one saved last, as tf.train's one ``checkpoint`` file per directory says
    runs = [d, *sorted(glob.glob(os.path.join(glob.escape(d), SIDE_RUNS + "*")))]
    found = [f for r in runs if os.path.isdir(os.path.join(r, ".pitstop"))
             and (f := _latest_in(r)) is not None]
    if not found:  # nothing of pitstop's yet: tf.train's own checkpoints, if any
        return tf.train.latest_checkpoint(d, latest_filename)
    return os.path.join(d, max(found)[1])


def _latest_in(d: str) -> tuple[float, str] | None:
    """(saved when, name) of the checkpoint saved last in the pitstop run directory ``d``."""
    reader = _CoreManager(d, read_only=True, save_on_signals=None)
    try:
        prefix = reader.naming.prefix
        ref = _Runs._open.get((os.path.realpath(d), prefix))
        writer = ref() if ref is not None else None
        if (writer is None or writer.closed or writer.read_only) and \
                _persist_memory_tier(reader, d):
            reader.close()
            reader = _CoreManager(d, read_only=True, save_on_signals=None)
        mgr = writer if writer is not None and not writer.closed else reader
        steps = mgr.all_steps()
        state = _RunState.of(mgr).recover() if steps else None
        latest = state.get("latest") if state is not None else None
        if not isinstance(latest, int) or latest not in steps:
            latest = steps[-1] if steps else None
        if latest is None:
            return None
        try:
            when = mgr.metadata(latest).created_unix
        except (CheckpointError, OSError):
            when = 0.0
        return when, mgr.naming.name(latest)
    finally:
        reader.close()


def _integer(value: Any, what: str) -> int:
    """An integer given as a Python or numpy integer, or a scalar variable or tensor."""
    if isinstance(value, (tf.Variable, tf.Tensor)) or _graph.base_variable(value) is not None:
        value = value.numpy() if hasattr(value, "numpy") else value.value.numpy()
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value.item()
    if isinstance(value, np.integer):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{what} must be an integer, got {value!r}")
    return value
