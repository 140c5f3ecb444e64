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

import glob
import logging
import os
import re
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.trackable import base as trackable_base
from tensorflow.python.training.saving import saveable_object_util

from pitstop import CheckpointManager as _CoreManager
from pitstop.adapters.tf import _graph, _native, _restore
from pitstop.adapters.tf._options import call_back as _call_back
from pitstop.adapters.tf._options import check as _options
from pitstop.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
)
from pitstop.core.policy import CheckpointInfo
from pitstop.core.save import memtier as memtier_mod
from pitstop.core.save.memtier import MemoryTier

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

    _open: dict[tuple[str, str], weakref.ref[_CoreManager]] = {}
    _lock = threading.Lock()

    @classmethod
    def get(cls, directory: str, name: str, *, create: bool, **options: Any) -> _CoreManager:
        real = os.path.realpath(directory)
        with cls._lock:
            ref = cls._open.get((real, name or "ckpt-"))
            mgr = ref() if ref is not None else None
            # a reader opened for a restore does not answer for a writer: a manager made
            # after ``restore(path)`` of its directory must be able to save there
            if mgr is not None and not getattr(mgr, "_closed", False) and (
                    not create or not mgr.read_only):
                return mgr
            naming: dict[str, Any] = (
                {"step_prefix": name, "step_digits": 0} if name else
                {"step_prefix": "ckpt-", "step_digits": 0})
            if not create and not os.path.isdir(directory):
                raise NotFoundError(f"no checkpoint at {directory}: no such directory")
            directory = run_directory(directory, name)
            if not create and not os.path.isdir(directory):
                raise NotFoundError(
                    f"no checkpoint named {name}<N> in {os.path.dirname(directory)}")
            doomed: set[int] = set()
            policy = _Doomed(doomed) if create else None
            if policy is not None:
                options["retention"] = [policy]
            mgr = _CoreManager(directory, read_only=not create, save_on_signals=None,
                               **naming, **options)
            if not create and _persist_memory_tier(mgr, directory):
                mgr.close()
                mgr = _CoreManager(directory, read_only=True, save_on_signals=None,
                                   **naming, **options)
            _RunState.of(mgr).doomed = doomed
            _RunState.of(mgr).policy = policy
            cls._open[(real, name or "ckpt-")] = weakref.ref(mgr)
            return mgr


#: where the checkpoints of a second name live in a directory (``model-N`` and ``best-N``)
SIDE_RUNS = ".pitstop-"


def run_directory(directory: str, name: str) -> str:
    """The pitstop run directory that holds the checkpoints ``<directory>/<name><N>``.

    A pitstop run directory names its checkpoints one way, so the name ``directory`` was
    created with lives in ``directory`` itself, and every other name in a hidden run
    directory beside them, ``<directory>/.pitstop-<name>`` (``.pitstop-best-``): tf.train
    keeps ``model-N`` and ``best-N`` in one folder, and so do these paths. A directory
    that is not a pitstop one yet is taken by the first name written to it."""
    if not name:
        return directory
    try:
        probe = _CoreManager(directory, read_only=True, save_on_signals=None)
    except CheckpointError:
        return directory
    try:
        mine = not probe.directory_id or probe.naming.prefix == name
    finally:
        probe.close()
    return directory if mine else os.path.join(directory, SIDE_RUNS + name)


def _persist_memory_tier(reader: _CoreManager, directory: str) -> bool:
    """Commit the saves of ``directory`` whose snapshot survived their writer (a SIGKILL
    after ``save()`` returned) in the memory tier; True when there were some.

    Only a writer recovers them: a reader does not see them, so after a restart
    ``restore(latest_checkpoint(d))`` would start afresh in silence, and ``restore`` of the
    path ``save()`` returned would not find it. A directory a live writer holds (here or in
    another process) is left to it."""
    root = memtier_mod.default_root()
    if root is None or not reader.directory_id:
        return False
    steps = reader.all_steps()
    tier = MemoryTier(root, directory, reader.directory_id)
    try:
        waiting = [m for m, _buf in tier.candidates()
                   if tier.trusted(m, steps[-1] if steps else None) is None]
    except OSError:
        return False
    if not waiting:
        return False
    try:
        writer = _CoreManager(directory, save_on_signals=None, retention=[_Doomed(set())])
    except CheckpointError:  # DirectoryLockedError: its live writer recovers them
        return False
    try:
        recovered = bool(writer._recovered_all)
        writer.wait()
    finally:
        writer.close()
    return recovered


class _Doomed:
    """pitstop's retention policy for a run directory the adapter writes: keep every
    checkpoint but those tf.train's sweep deleted (see :meth:`CheckpointManager._sweep`).

    It runs after each commit, which is also when what tf.train's manager does to the native
    checkpoints of a mixed directory happens: the native ones the sweep dropped are deleted
    once the save that dropped them is committed, and tf.train's ``checkpoint`` file is
    rewritten to name the newest committed checkpoint (:mod:`._native`)."""

    #: how ``pitstop ls`` names it (directory.json's retention record)
    retention_label = "tf.train's max_to_keep (pitstop.adapters.tf)"

    def __init__(self, doomed: set[int]) -> None:
        self.doomed = doomed
        #: native checkpoints to delete: prefix -> the step whose commit drops it
        self.natives: dict[str, int] = {}
        #: tf.train state files to write: step -> (directory, latest, managed, preserved)
        self.tf_states: dict[int, tuple[str, str, list[tuple[str, float]], float]] = {}
        #: CheckpointOptions.experimental_write_callbacks: step -> [(callback, path)]
        self.callbacks: dict[int, list[tuple[Callable[..., Any], str]]] = {}
        self._lock = threading.Lock()

    def forget(self, step: int) -> None:
        """A save of ``step`` that raised: what was to follow its commit does not."""
        with self._lock:
            for p in [p for p, s in self.natives.items() if s == step]:
                del self.natives[p]
            self.tf_states.pop(step, None)
            self.callbacks.pop(step, None)

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        committed = {c.step for c in checkpoints}
        with self._lock:
            done = {p for p, s in self.natives.items() if s in committed}
            for p in done:
                del self.natives[p]
            ready = [s for s in self.tf_states if s in committed]  # in save order
            states = [self.tf_states.pop(s) for s in ready]
            calls = [c for s in [s for s in self.callbacks if s in committed]
                     for c in self.callbacks.pop(s)]
        for p in sorted(done):
            _native.delete(p)
        if states:  # the newest recorded state among those committed now
            _native.record(*states[-1])
        for fn, path in calls:
            _call_back(fn, path)
        return {c.step for c in checkpoints if c.step not in self.doomed}


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
        if mgr is None or mgr._closed:
            mgr = _Runs.get(directory, name, create=True, **options)
            self._runs[key] = mgr
        return mgr

    def sync(self) -> None:
        """Wait until every save of this checkpoint is committed (raises a failed one)."""
        for mgr in list(self._runs.values()):
            if not mgr._closed:
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


def _replace_native(prefix: str) -> None:
    """A save at the path of a native TensorFlow checkpoint replaces it, as tf.train's does:
    its files go first, so the path names one checkpoint only."""
    log.warning("pitstop: saving %s replaces the tf.train checkpoint of that name (its "
                ".index and .data-* files are deleted), as tf.train would overwrite it", prefix)
    _native.delete(prefix)


class NotFoundError(CheckpointNotFoundError, tf.errors.NotFoundError):
    """No checkpoint at the path given: a pitstop ``CheckpointNotFoundError`` that
    ``except tf.errors.NotFoundError`` catches too, as tf.train's restore raises it."""

    def __init__(self, message: str) -> None:
        tf.errors.NotFoundError.__init__(self, None, None, message)


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


def read_tree(path: str, runs: dict[Any, _CoreManager] | None = None) -> Any:
    """The saved tree of the checkpoint at a TensorFlow-style ``path`` (a pitstop checkpoint,
    or a native TensorFlow one: ``<prefix>.index`` beside it)."""
    if os.path.exists(path + ".index"):
        from pitstop.adapters.tf.convert import read_native
        return read_native(path)
    directory, name, step = _split(path)
    if not name:
        step = _ONLY
    mgr = None
    for (d, n), m in (runs or {}).items():
        if d == os.path.abspath(directory) and n == name and not m._closed:
            mgr = m
    if mgr is None:
        try:
            mgr = _Runs.get(directory, name, create=False)
        except NotFoundError as e:
            raise NotFoundError(f"no checkpoint at {path} ({e})") from None
    mgr.wait()
    if step not in mgr.all_steps():
        raise NotFoundError(
            f"no checkpoint at {path}: {directory} holds "
            f"{[f'{name}{s}' for s in mgr.all_steps()] or 'none'}")
    try:
        return mgr.load(step)
    except CheckpointNotFoundError as e:  # deleted meanwhile
        if isinstance(e, NotFoundError):
            raise
        raise NotFoundError(f"no checkpoint at {path}: {e}") from e


def _overwrite(mgr: _CoreManager, step: int, path: str) -> None:
    """tf.train overwrites a checkpoint written again at the same path: pitstop deletes the
    old one first (only one this directory's runs wrote; ``CheckpointManager.delete``)."""
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


class _RunState:
    """What every wrapper writing one run directory shares: the steps tf.train's sweep chose
    to delete (pitstop's retention deletes them after the next commit) and the sequence
    number of the newest saved manager state."""

    _of: weakref.WeakKeyDictionary[_CoreManager, _RunState] = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, mgr: _CoreManager) -> None:
        self.mgr = mgr
        self.doomed: set[int] = set()
        self.seq: int | None = None
        self.state: dict[str, Any] | None = None  # the newest, once saved or read
        #: the retention policy of a writer (None for a reader)
        self.policy: _Doomed | None = None

    @classmethod
    def of(cls, mgr: _CoreManager) -> _RunState:
        with cls._lock:
            st = cls._of.get(mgr)
            if st is None:
                st = cls._of[mgr] = cls(mgr)
            return st

    def recover(self) -> dict[str, Any] | None:
        """The newest state a manager or ``Checkpoint.save`` recorded in this run (tf.train's
        ``checkpoint`` file, kept in the manifest of the checkpoint saved with it)."""
        if self.state is None:
            best: dict[str, Any] | None = None
            # snapshots recovered from the memory tier carry no user metadata: each was
            # saved after everything on disk, so it is the newest, still managed
            recovered = {r.step for r in getattr(self.mgr, "_recovered_all", ())}
            late: list[tuple[float, int]] = []
            for step in self.mgr.all_steps():
                try:
                    manifest = self.mgr.metadata(step)
                except (CheckpointError, OSError):
                    continue
                st = manifest.user_metadata.get(_STATE)
                if isinstance(st, dict) and isinstance(st.get("seq"), int):
                    if best is None or st["seq"] > best["seq"]:
                        best = st
                elif step in recovered:
                    late.append((manifest.created_unix, step))
            for created, step in sorted(late):
                base = best or {"seq": 0, "managed": [], "last_preserved": 0.0}
                best = {**base, "latest": step, "managed": [
                    *[m for m in base.get("managed", []) if m[0] != step], [step, created]]}
            self.state = best
        if self.seq is None:
            self.seq = self.state["seq"] if self.state is not None else 0
        return self.state

    def record(self, state: dict[str, Any]) -> dict[str, Any]:
        self.recover()
        assert self.seq is not None
        self.seq += 1
        self.state = {"seq": self.seq, **state}
        return self.state


#: the manifest's user-metadata key of tf.train's checkpoint state
_STATE = "tf_checkpoint_state"


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
        self._mgr._tell_supervisor("restore", step=None)  # `pitstop run`: a fresh start
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
                    self._mgr._quarantine(step)
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
        if (writer is None or writer._closed or writer.read_only) and \
                _persist_memory_tier(reader, d):
            reader.close()
            reader = _CoreManager(d, read_only=True, save_on_signals=None)
        mgr = writer if writer is not None and not writer._closed else reader
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
