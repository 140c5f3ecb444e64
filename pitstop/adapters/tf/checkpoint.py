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
import time
from typing import Any

import tensorflow as tf
from tensorflow.python.trackable import base as trackable_base
from tensorflow.python.training.saving import saveable_object_util

from pitstop import CheckpointManager as _CoreManager
from pitstop.adapters.tf import _graph, _native, _restore
from pitstop.adapters.tf._options import check as _options
from pitstop.adapters.tf._runs import (
    _ONLY,
    _STATE,
    _fspath,
    _overwrite,
    _replace_native,
    _Runs,
    _RunState,
    _split,
    read_tree,
)
from pitstop.core.errors import CheckpointError, InvalidArgumentError

log = logging.getLogger("pitstop")


class CheckpointLoadStatus:
    """What a restore matched, with tf.train's assertions (each raises ``AssertionError``
    as tf.train's does, and returns the status so calls chain)."""

    def __init__(self, root: Any, restore: _restore.Restore | None, path: str | None) -> None:
        self._root, self._restore, self._path = root, restore, path

    def _live_with_values(self) -> list[tuple[tuple[str, ...], Any]]:
        w = _graph.walk(self._root)
        out = []
        for obj, key, extra in zip(w.objects, w.keys, w.extra, strict=True):
            if extra:
                continue  # pitstop's own additions (Keras seed state): tf.train has no such
            if _graph.base_variable(obj) is not None or (
                    _graph.is_trackable(obj) and _graph.serializes(obj)):
                out.append((tuple(key), obj))
        return out

    def _without_value(self) -> list[str]:
        """Live objects holding values that this restore gave none."""
        matched = {id(o) for o in self._need().outcome.live()}
        return ["/".join(p) or "root" for p, obj in self._live_with_values()
                if id(obj) not in matched]

    def assert_consumed(self) -> CheckpointLoadStatus:
        """Every value in the checkpoint went to an object, and every object got one."""
        r = self._need()
        # as tf.train: every saved object holding values has its live object (those
        # deferred count once their object is created)
        unmatched = [r.label(s) for s, (_c, attrs, *_slots) in enumerate(r.graph)
                     if attrs and s not in r.outcome.matched]
        if unmatched:
            raise AssertionError(
                f"Unresolved objects in checkpoint {self._path}: {', '.join(unmatched[:20])}"
                + (f" and {len(unmatched) - 20} more" if len(unmatched) > 20 else ""))
        if r.outcome.unused:
            raise AssertionError(
                "Unused attributes in these objects (the attributes exist in the checkpoint "
                f"{self._path} but were not restored):\n" + "\n".join(
                    f"    {r.pretty(s)}: [{a!r}]" for s, a in r.outcome.unused[:20]))
        return self.assert_existing_objects_matched()

    def assert_existing_objects_matched(self) -> CheckpointLoadStatus:
        """Every object that exists now and holds values got one from the checkpoint."""
        missing = self._without_value()
        if missing:
            raise AssertionError(
                f"Objects not assigned a value from checkpoint {self._path}: "
                f"{', '.join(missing[:20])}")
        return self

    def assert_nontrivial_match(self) -> CheckpointLoadStatus:
        """Something besides the root was matched (the save counter counts, as in
        tf.train), or there is nothing else to match."""
        if len(self._need().outcome.matched) <= 1:
            unused = self._without_value()
            if unused:
                raise AssertionError(
                    f"Nothing except the root object matched a checkpointed value in "
                    f"{self._path}; these objects have none: {', '.join(unused[:20])}")
        return self

    def expect_partial(self) -> CheckpointLoadStatus:
        """Silence warnings about values in the checkpoint no object took."""
        if self._restore is not None:
            self._restore.outcome.expect_partial = True
        return self

    def run_restore_ops(self, session: Any = None) -> None:
        """Nothing to run in eager mode (kept for code written against tf.train)."""

    def initialize_or_restore(self, session: Any = None) -> None:
        """Nothing to run in eager mode (kept for code written against tf.train)."""

    def _need(self) -> _restore.Restore:
        if self._restore is None:
            raise AssertionError("No checkpoint specified (restore(None)); nothing restored")
        return self._restore


class Checkpoint:
    """``tf.train.Checkpoint(root=None, **kwargs)`` with asynchronous, verified saves.

    Children are given as keyword arguments (or ``root``), exactly as to tf.train, and are
    reachable as attributes (``ckpt.model``)."""

    def __init__(self, root: Any = None, **kwargs: Any) -> None:
        object.__setattr__(self, "_tf", tf.train.Checkpoint(
            root=_unwrap(root), **{k: _unwrap(v) for k, v in kwargs.items()}))
        object.__setattr__(self, "_runs", {})

    def __deepcopy__(self, memo: dict[int, Any]) -> Checkpoint:
        """A copy of the object graph (as ``copy.deepcopy`` of tf.train's), writing on its
        own."""
        import copy
        new = object.__new__(type(self))
        memo[id(self)] = new
        object.__setattr__(new, "_tf", copy.deepcopy(self._tf, memo))
        object.__setattr__(new, "_runs", {})
        return new

    # children and save_counter behave as tf.train's
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(object.__getattribute__(self, "_tf"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._tf, name, _unwrap(value))

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
        return self._write(_fspath(file_prefix, "file_prefix"), record=False,
                           options=_options(options, "write"))

    def save(self, file_prefix: str | os.PathLike[str], options: Any = None) -> str:
        """Increment ``save_counter`` and write ``<file_prefix>-<save_counter>``; a
        ``CheckpointManager`` made later on that directory starts from it (``latest_checkpoint``),
        as from tf.train's ``checkpoint`` file, and does not delete it."""
        prefix = _fspath(file_prefix, "file_prefix")
        options = _options(options, "save")
        self._tf.save_counter.assign_add(1)
        return self._write(f"{prefix}-{int(self._tf.save_counter.numpy())}", record=True,
                           options=options)

    def _write(self, path: str, record: bool | None = None, options: Any = None) -> str:
        if record is None:  # tf.train.CheckpointManager(pitstop_checkpoint, ...).save()
            raise InvalidArgumentError(
                "a pitstop.adapters.tf.Checkpoint is saved by pitstop.adapters.tf."
                "CheckpointManager: change tf.train.CheckpointManager to it too (same "
                "arguments); tf.train's manager cannot list or delete pitstop checkpoints")
        directory, name, step = _split(path)
        mgr = self._manager(directory, name)
        step = step if name else _ONLY
        if step in mgr.all_steps():
            _overwrite(mgr, step, path)
        if _native.exists(path):
            _replace_native(path)
        run = _RunState.of(mgr)
        run.doomed.discard(step)
        meta = {_STATE: run.record({"latest": step, "managed": [], "last_preserved": 0.0})} \
            if record else None
        policy = run.policy
        if policy is not None:  # (before the save: a synchronous one commits inside it)
            with policy._lock:
                if record and _native.has_state_file(directory):
                    # tf.train's save names it in the directory's checkpoint file
                    policy.tf_states[step] = (directory, path, [(path, time.time())], 0.0)
                if options is not None and options.experimental_write_callbacks:
                    policy.callbacks[step] = [
                        (f, path) for f in options.experimental_write_callbacks]
        try:
            mgr.save(step, _graph_root(self._tf), user_metadata=meta)
        except BaseException:
            if policy is not None:
                policy.forget(step)
            raise
        return path

    def _manager(self, directory: str, name: str, **options: Any) -> _CoreManager:
        key = (os.path.abspath(directory), name)
        mgr = self._runs.get(key)
        if mgr is None or mgr.closed:
            mgr = _Runs.get(directory, name, create=True, **options)
            self._runs[key] = mgr
        return mgr

    def sync(self) -> None:
        """Wait until every save of this checkpoint is committed (raises a failed one)."""
        for mgr in list(self._runs.values()):
            if not mgr.closed:
                mgr.wait()

    # -------------------------------------------------------------- restoring
    def read(self, save_path: str | os.PathLike[str] | None,
             options: Any = None) -> CheckpointLoadStatus:
        """Restore from ``save_path`` (as written by ``write``), as tf.train's ``read``: only
        the objects that exist are restored, and ``save_counter`` is not created, so
        ``read(write(p)).assert_consumed()`` passes."""
        _options(options, "read")
        return self._read(save_path, counter=False)

    def restore(self, save_path: str | os.PathLike[str] | None,
                options: Any = None) -> CheckpointLoadStatus:
        """Restore the checkpoint at ``save_path``: values go to the objects the saved graph
        reaches by the same names; objects created later get theirs when they are created.
        ``None`` restores nothing (a fresh run), as tf.train does. As tf.train's, it then
        creates ``save_counter`` (restored if the checkpoint holds one: one ``write`` wrote
        without a ``save`` before holds none, which ``assert_consumed()`` reports)."""
        _options(options, "restore")
        return self._read(save_path, counter=True)

    def _read(self, save_path: str | os.PathLike[str] | None, counter: bool
              ) -> CheckpointLoadStatus:
        if save_path is None:
            if counter:
                self._tf.save_counter  # noqa: B018 - created, as tf.train's restore does
            return CheckpointLoadStatus(self._tf, None, None)
        path = _fspath(save_path, "save_path")
        tree = read_tree(path, self._runs)
        r = _restore.Restore(tree, os.path.basename(path), report_unrestored=True)
        view = _graph_root(self._tf)
        try:
            r.check(view)
            r.apply(view)
            if counter:
                # created after the read, as tf.train's restore creates it: a saved value
                # waiting for it (deferred) is restored into it now
                self._tf.save_counter  # noqa: B018
        except BaseException as e:
            # the error says what went wrong: no warning follows that values found no object
            # (with a hint to call expect_partial() on a status the caller never got)
            r.outcome.expect_partial = True
            if isinstance(e, (tf.errors.OpError, ValueError, TypeError)) and \
                    not isinstance(e, CheckpointError):
                raise CheckpointError(
                    f"{path}: TensorFlow refused a restored value ({type(e).__name__}: {e}); "
                    "some objects may already hold the checkpoint's values") from e
            raise
        return CheckpointLoadStatus(view, r, path)


def _unwrap(value: Any) -> Any:
    """A pitstop Checkpoint given as a child is tracked as the tf.train one it wraps."""
    return value.tf_checkpoint if isinstance(value, Checkpoint) else value


class _RootView(trackable_base.Trackable):
    """The object graph ``tf.train.Checkpoint(root=obj, **kwargs)`` saves: ``obj`` itself at
    the root (its own dependencies and tensors), with the keyword arguments and
    ``save_counter`` attached as further children, as tf.train's ``ObjectGraphView`` has it.
    Values waiting for a child of the root wait on ``obj``, so they arrive when it gets it."""

    def __init__(self, view: Any) -> None:
        self._pitstop_view = view
        root = view.root
        if saveable_object_util.trackable_has_serialize_to_tensor(root):
            self._serialize_to_tensors = root._serialize_to_tensors
            self._restore_from_tensors = root._restore_from_tensors

    @property
    def _pitstop_root(self) -> Any:
        return self._pitstop_view.root

    def _trackable_children(self, save_type: Any = "checkpoint", **kwargs: Any) -> Any:
        out = dict(self._pitstop_root._trackable_children(save_type, **kwargs))
        for ref in self._pitstop_view._attached_dependencies or ():
            if ref.ref is not None:
                out.setdefault(ref.name, ref.ref)
        return out

    def _maybe_initialize_trackable(self) -> None:
        self._pitstop_root._maybe_initialize_trackable()

    @property
    def _deferred_dependencies(self) -> Any:
        return self._pitstop_root._deferred_dependencies

    @property
    def _update_uid(self) -> Any:
        return getattr(self._pitstop_root, "_update_uid", None)

    @_update_uid.setter
    def _update_uid(self, value: Any) -> None:
        self._pitstop_root._update_uid = value

    @property
    def _seed_generators(self) -> Any:
        return getattr(self._pitstop_root, "_seed_generators", None)


def _graph_root(ckpt: tf.train.Checkpoint) -> Any:
    """What tf.train's saver walks from: the checkpoint itself, or its ``root=`` object."""
    view = getattr(getattr(ckpt, "_saver", None), "_graph_view", None)
    root = getattr(view, "root", None)
    if view is None or root is None or root is ckpt:
        return ckpt
    return _RootView(view)


