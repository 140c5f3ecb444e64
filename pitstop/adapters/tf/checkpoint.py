"""``tf.train.Checkpoint`` and ``tf.train.CheckpointManager``, with pitstop underneath.

Change one import and keep the calls::

    from pitstop.adapters.tf import Checkpoint, CheckpointManager

    ckpt = Checkpoint(model=model, optimizer=opt, step=step)
    manager = CheckpointManager(ckpt, "/runs/a", max_to_keep=3)
    ckpt.restore(manager.latest_checkpoint)      # None on a fresh run: nothing restored
    ...
    manager.save()                               # returns "/runs/a/ckpt-4" after the snapshot

The object graph, the numbering by ``save_counter``, the paths (``<directory>/ckpt-<N>``),
the interval checks and ``max_to_keep`` are tf.train's. What pitstop adds: saves return after
an in-memory snapshot and commit in the background (``sync()`` waits), every checkpoint is
committed atomically and verified by hash on restore, retention survives restarts and never
deletes what this directory's runs did not write, and the snapshot survives a SIGKILL in the
memory tier. A checkpoint ``<dir>/<name>-<N>`` is the pitstop checkpoint of step N in the run
directory ``<dir>`` whose checkpoints are named ``<name>-<N>``; a prefix without a number is a
run directory of its own holding one checkpoint.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from ... import CheckpointManager as _CoreManager
from ...core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    InvalidArgumentError,
)
from ...core.policy import CheckpointInfo
from ...core.reader import CheckpointReader
from . import _graph

log = logging.getLogger("pitstop")

_NUMBERED = re.compile(r"^(.+)-(0|[1-9]\d*)$")
#: the step of a checkpoint written to a prefix without a number (its own run directory)
_ONLY = 0


def _split(prefix: str) -> tuple[str, str, int]:
    """``(run directory, checkpoint name prefix, step)`` of a TensorFlow-style path."""
    path = os.path.abspath(os.fspath(prefix))
    head, base = os.path.split(path)
    m = _NUMBERED.match(base)
    if m:
        return head, f"{m.group(1)}-", int(m.group(2))
    return path, "", -1


class _Runs:
    """The pitstop managers behind one wrapper, one per run directory (opened on first use).

    A directory another wrapper in this process writes to is shared with it, so that
    ``Checkpoint.restore(manager.latest_checkpoint)`` reads what the manager has in flight."""

    _open: dict[str, weakref.ref[_CoreManager]] = {}
    _lock = threading.Lock()

    @classmethod
    def get(cls, directory: str, name: str, *, create: bool, **options: Any) -> _CoreManager:
        key = os.path.realpath(directory) if os.path.exists(directory) else directory
        with cls._lock:
            ref = cls._open.get(key)
            mgr = ref() if ref is not None else None
            if mgr is not None and not getattr(mgr, "_closed", False):
                return mgr
            naming: dict[str, Any] = (
                {"step_prefix": name, "step_digits": 0} if name else
                {"step_prefix": "ckpt-", "step_digits": 0})
            if not create and not os.path.isdir(directory):
                raise CheckpointNotFoundError(f"no checkpoint at {directory}")
            mgr = _CoreManager(directory, read_only=not create, save_on_signals=None,
                               **naming, **options)
            cls._open[os.path.realpath(directory)] = weakref.ref(mgr)
            return mgr


class CheckpointLoadStatus:
    """What a restore matched, with tf.train's assertions (each raises ``AssertionError``
    as tf.train's does, and returns the status so calls chain)."""

    def __init__(self, root: Any, restore: _graph.Restore | None, path: str | None) -> None:
        self._root, self._restore, self._path = root, restore, path

    def _live_with_values(self) -> list[tuple[tuple[str, ...], Any]]:
        objects, _edges, paths = _graph.walk(self._root)
        out = []
        for obj, path in zip(objects, paths, strict=True):
            if any(p.startswith(_graph.EXTRA) for p in path):
                continue  # pitstop's own additions (Keras seed state): tf.train has no such
            if _graph.base_variable(obj) is not None or (
                    _graph.is_trackable(obj) and _graph.serializes(obj)):
                out.append((path, obj))
        return out

    def assert_consumed(self) -> CheckpointLoadStatus:
        """Every value in the checkpoint went to an object, and every object got one."""
        r = self._need()
        # as tf.train: every saved object holding values has its live object (those
        # deferred count once their object is created)
        unmatched = [r.label(s) for s, (_c, attrs) in enumerate(r.graph)
                     if attrs and s not in r.outcome.matched]
        if unmatched:
            raise AssertionError(
                f"Unresolved objects in checkpoint {self._path}: {', '.join(unmatched[:20])}"
                + (f" and {len(unmatched) - 20} more" if len(unmatched) > 20 else ""))
        return self.assert_existing_objects_matched()

    def assert_existing_objects_matched(self) -> CheckpointLoadStatus:
        """Every object that exists now and holds values got one from the checkpoint."""
        r = self._need()
        matched = {id(o) for o in r.outcome.matched.values()}
        missing = ["/".join(p) or "root" for p, obj in self._live_with_values()
                   if id(obj) not in matched]
        if missing:
            raise AssertionError(
                f"Objects not assigned a value from checkpoint {self._path}: "
                f"{', '.join(missing[:20])}")
        return self

    def assert_nontrivial_match(self) -> CheckpointLoadStatus:
        """Something besides the root and its save counter was matched."""
        r = self._need()
        counter = {cid for name, cid in r.graph[0][0] if name == "save_counter"}
        if not any(s not in counter and s != 0 for s in r.outcome.matched):
            raise AssertionError(
                f"Nothing except the root object matched a checkpointed value in {self._path}")
        return self

    def expect_partial(self) -> CheckpointLoadStatus:
        """Silence warnings about values in the checkpoint no object took."""
        self._restore = self._restore  # nothing is warned at collection time
        return self

    def run_restore_ops(self, session: Any = None) -> None:
        """Nothing to run in eager mode (kept for code written against tf.train)."""

    def initialize_or_restore(self, session: Any = None) -> None:
        """Nothing to run in eager mode (kept for code written against tf.train)."""

    def _need(self) -> _graph.Restore:
        if self._restore is None:
            raise AssertionError("No checkpoint specified (restore(None)); nothing restored")
        return self._restore


class Checkpoint:
    """``tf.train.Checkpoint(root=None, **kwargs)`` with asynchronous, verified saves.

    Children are given as keyword arguments (or ``root``), exactly as to tf.train, and are
    reachable as attributes (``ckpt.model``)."""

    def __init__(self, root: Any = None, **kwargs: Any) -> None:
        object.__setattr__(self, "_tf", tf.train.Checkpoint(root=root, **kwargs))
        object.__setattr__(self, "_runs", {})

    # children and save_counter behave as tf.train's
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(object.__getattribute__(self, "_tf"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._tf, name, value)

    @property
    def save_counter(self) -> tf.Variable:
        """Incremented by each ``save()``; numbers the checkpoints it writes."""
        return self._tf.save_counter

    @property
    def tf_checkpoint(self) -> tf.train.Checkpoint:
        """The ``tf.train.Checkpoint`` holding the object graph (for tf.train-only APIs)."""
        return self._tf

    # -------------------------------------------------------------- saving
    def write(self, file_prefix: str | os.PathLike[str], options: Any = None) -> str:
        """Write a checkpoint at exactly ``file_prefix``; returns it once the snapshot is
        taken (the commit follows in the background; ``sync()`` waits)."""
        path = _fspath(file_prefix, "file_prefix")
        directory, name, step = _split(path)
        mgr = self._manager(directory, name)
        self._save(mgr, step if name else _ONLY, path)
        return path

    def save(self, file_prefix: str | os.PathLike[str], options: Any = None) -> str:
        """Increment ``save_counter`` and write ``<file_prefix>-<save_counter>``."""
        prefix = _fspath(file_prefix, "file_prefix")
        self._tf.save_counter.assign_add(1)
        return self.write(f"{prefix}-{int(self._tf.save_counter.numpy())}", options)

    def _manager(self, directory: str, name: str, **options: Any) -> _CoreManager:
        key = (os.path.abspath(directory), name)
        mgr = self._runs.get(key)
        if mgr is None or mgr._closed:
            mgr = _Runs.get(directory, name, create=True, **options)
            self._runs[key] = mgr
        return mgr

    def _save(self, mgr: _CoreManager, step: int, path: str) -> None:
        if step in mgr.all_steps():
            _overwrite(mgr, step, path)
        mgr.save(step, self._tf)

    def sync(self) -> None:
        """Wait until every save of this checkpoint is committed (raises a failed one)."""
        for mgr in list(self._runs.values()):
            if not mgr._closed:
                mgr.wait()

    # -------------------------------------------------------------- restoring
    def read(self, save_path: str | os.PathLike[str] | None,
             options: Any = None) -> CheckpointLoadStatus:
        """Restore from ``save_path`` (as written by ``write`` or ``save``)."""
        return self.restore(save_path, options)

    def restore(self, save_path: str | os.PathLike[str] | None,
                options: Any = None) -> CheckpointLoadStatus:
        """Restore the checkpoint at ``save_path``: values go to the objects the saved graph
        reaches by the same names; objects created later get theirs when they are created.
        ``None`` restores nothing (a fresh run), as tf.train does."""
        if save_path is None:
            return CheckpointLoadStatus(self._tf, None, None)
        path = _fspath(save_path, "save_path")
        tree = read_tree(path, self._runs)
        r = _graph.Restore(tree, os.path.basename(path))
        self._tf.save_counter  # noqa: B018 - created now, as tf.train's restore creates it
        r.check(self._tf)
        try:
            r.apply(self._tf)
        except CheckpointError:
            raise
        except (tf.errors.OpError, ValueError, TypeError) as e:
            raise CheckpointError(
                f"{path}: TensorFlow refused a restored value ({type(e).__name__}: {e}); some "
                "objects may already hold the checkpoint's values") from e
        return CheckpointLoadStatus(self._tf, r, path)


def read_tree(path: str, runs: dict[Any, _CoreManager] | None = None) -> Any:
    """The saved tree of the checkpoint at a TensorFlow-style ``path`` (a pitstop checkpoint,
    or a native TensorFlow one: ``<prefix>.index`` beside it)."""
    if os.path.exists(path + ".index"):
        from .convert import read_native
        return read_native(path)
    directory, name, step = _split(path)
    if not name:
        step = _ONLY
    mgr = None
    for (d, n), m in (runs or {}).items():
        if d == os.path.abspath(directory) and n == name and not m._closed:
            mgr = m
    if mgr is None:
        mgr = _Runs.get(directory, name, create=False)
    mgr.wait()
    if step not in mgr.all_steps():
        raise CheckpointNotFoundError(
            f"no checkpoint at {path}: {directory} holds "
            f"{[f'{name}{s}' for s in mgr.all_steps()] or 'none'}")
    return mgr.load(step)


def _overwrite(mgr: _CoreManager, step: int, path: str) -> None:
    """tf.train overwrites a checkpoint written again at the same path; pitstop moves the old
    one out first, so the new one is committed whole or not at all."""
    mgr.delete(step)


def _fspath(p: Any, what: str) -> str:
    try:
        s = os.fspath(p)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be a path, got {p!r}") from None
    if isinstance(s, bytes):
        s = os.fsdecode(s)
    if not s:
        raise InvalidArgumentError(f"{what} must not be empty")
    return s


class _Order:
    """When each checkpoint of a run directory was saved: tf.train's manager orders its
    checkpoints by save time, not by number (``checkpoint_number`` may go down). Times come
    from the save itself, else from the checkpoint's manifest (read directly: this is also
    asked on the background thread that applies retention)."""

    def __init__(self, mgr: _CoreManager) -> None:
        self.mgr = mgr
        self.times: dict[int, float] = {}

    def saved(self, step: int) -> None:
        self.times[step] = time.time()

    def time_of(self, step: int, *, api: bool = False) -> float:
        """When ``step`` was saved. ``api``: asked from a user's call, where the manager may
        also answer for a snapshot recovered from the memory tier and not on disk yet (never
        from the retention thread: the manager may wait there for that very thread)."""
        t = self.times.get(step)
        if t is None:
            try:
                name = self.mgr.naming.name(step)
                t = CheckpointReader(self.mgr.storage, name, naming=self.mgr.naming,
                                     threads=1).manifest.created_unix
            except (CheckpointError, OSError):
                if not api:
                    return float("-inf")  # unreadable: the oldest, first to go
                try:
                    t = self.mgr.metadata(step).created_unix
                except CheckpointError:
                    return float("-inf")
            self.times[step] = t
        return t

    def sort(self, steps: Sequence[int], *, api: bool = False) -> list[int]:
        return sorted(steps, key=lambda s: (self.time_of(s, api=api), s))


class _LazyOrder:
    """The manager's :class:`_Order`, which exists only once the run directory is open (the
    retention policy is given to the directory before that)."""

    def __init__(self) -> None:
        self.order: _Order | None = None

    def sort(self, steps: Sequence[int]) -> list[int]:
        return self.order.sort(steps) if self.order is not None else sorted(steps)

    def time_of(self, step: int) -> float:
        return self.order.time_of(step) if self.order is not None else 0.0


class _KeepNewest:
    """tf.train's ``max_to_keep`` (the last ``n`` saved) and
    ``keep_checkpoint_every_n_hours`` (of the others, one every ``hours``, oldest first)."""

    def __init__(self, n: int | None, hours: float | None, order: _LazyOrder) -> None:
        self.n, self.order = n, order
        self.seconds = None if hours is None else float(hours) * 3600.0

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        steps = self.order.sort([c.step for c in checkpoints])
        kept = set(steps if self.n is None else steps[-self.n:])
        if self.seconds is not None:
            last: float | None = None
            for s in steps:
                t = self.order.time_of(s)
                if last is None or t - self.seconds >= last:
                    kept.add(s)
                    last = t
        return kept

    def preserved(self, steps: Sequence[int]) -> set[int]:
        """Of ``steps`` (in save order), those kept only by ``keep_checkpoint_every_n_hours``:
        tf.train does not list them in ``checkpoints``."""
        if self.n is None or self.seconds is None or len(steps) <= self.n:
            return set()
        return set(steps[:-self.n])


class CheckpointManager:
    """``tf.train.CheckpointManager`` over a pitstop run directory: same arguments, numbering,
    interval checks, ``max_to_keep`` and paths (``<directory>/<checkpoint_name>-<N>``), and
    checkpoints ordered by when they were saved; saves return after the snapshot (``sync()``
    waits for the commit)."""

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
        self._step_counter = step_counter
        self._checkpoint_interval = checkpoint_interval
        self._last_checkpoint_step = last_checkpoint_step
        self._init_fn = init_fn
        lazy = _LazyOrder()
        self._retention = _KeepNewest(max_to_keep, keep_checkpoint_every_n_hours, lazy)
        keeps = max_to_keep is not None or keep_checkpoint_every_n_hours is not None
        self._mgr = _Runs.get(
            self._directory, f"{checkpoint_name}-", create=True,
            retention=[self._retention] if keeps else None, memory_tier=memory_tier,
            async_save=async_save)
        self._order = lazy.order = _Order(self._mgr)
        if isinstance(checkpoint, Checkpoint):
            checkpoint._runs[(os.path.abspath(self._directory), f"{checkpoint_name}-")] = \
                self._mgr

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

    def _saved_order(self) -> list[int]:
        return self._order.sort(self._mgr.all_steps(), api=True)

    @property
    def latest_checkpoint(self) -> str | None:
        """The path of the checkpoint saved last (saves in flight included), or None."""
        steps = self._saved_order()
        return self._path(steps[-1]) if steps else None

    @property
    def checkpoints(self) -> list[str]:
        """The checkpoints ``max_to_keep`` manages, oldest saved first (as tf.train lists
        them: not the ones kept for ``keep_checkpoint_every_n_hours``)."""
        steps = self._saved_order()
        kept = self._retention.preserved(steps)
        active = [s for s in steps if s not in kept]
        return [self._path(s) for s in (active if self._max_to_keep is None
                                         else active[-self._max_to_keep:])]

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
        if number in self._mgr.all_steps():
            _overwrite(self._mgr, number, self._path(number))
        self._order.saved(number)
        self._mgr.save(number, self._root)
        return self._path(number)

    def restore_or_initialize(self) -> str | None:
        """Restore the newest checkpoint (returns its path) or call ``init_fn`` (returns
        None)."""
        latest = self.latest_checkpoint
        if latest is not None:
            if isinstance(self._checkpoint, Checkpoint):
                self._checkpoint.restore(latest)
            else:
                r = _graph.Restore(read_tree(latest, {
                    (os.path.abspath(self._directory), f"{self._name}-"): self._mgr}))
                r.check(self._root)
                r.apply(self._root)
            if self._checkpoint_interval is not None:
                self._last_checkpoint_step = _integer(self._step_counter, "step_counter")
            return latest
        if self._init_fn is not None:
            self._init_fn()
        return None

    def sync(self) -> None:
        """Wait for every save to commit (raises a failed one)."""
        self._mgr.wait()

    def close(self) -> None:
        """Commit what is in flight and release the directory."""
        self._mgr.close()


def _integer(value: Any, what: str) -> int:
    if isinstance(value, (tf.Variable, tf.Tensor)) or _graph.base_variable(value) is not None:
        value = value.numpy() if hasattr(value, "numpy") else value.value.numpy()
    try:
        import numpy as np
        if isinstance(value, np.ndarray) and value.shape == ():
            value = value.item()
        if isinstance(value, np.integer):
            value = int(value)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{what} must be an integer, got {value!r}")
    return value
