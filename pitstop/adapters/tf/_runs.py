"""The pitstop run directories behind the tf.train faces: which manager writes or reads a
TensorFlow-style path (``<dir>/<name>-<N>``), the retention that carries out tf.train's
sweep, and the tf.train state (``checkpoint`` file) each run keeps in its manifests."""

from __future__ import annotations

import logging
import os
import re
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from pitstop import CheckpointManager as _CoreManager
from pitstop.adapters.tf import _native
from pitstop.adapters.tf._options import call_back as _call_back
from pitstop.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    InvalidArgumentError,
)
from pitstop.core.policy import CheckpointInfo
from pitstop.core.survivors import persist_survivors

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
            if mgr is not None and not mgr.closed and (
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
    return persist_survivors(reader, directory, save_on_signals=None,
                             retention=[_Doomed(set())])


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


def read_tree(path: str, runs: dict[Any, _CoreManager] | None = None) -> Any:
    """The saved tree of the checkpoint at a TensorFlow-style ``path`` (a pitstop checkpoint,
    or a native TensorFlow one: ``<prefix>.index`` beside it)."""
    if os.path.exists(path + ".index"):
        from pitstop.interop.tf_native import read_native
        return read_native(path)
    directory, name, step = _split(path)
    if not name:
        step = _ONLY
    mgr = None
    for (d, n), m in (runs or {}).items():
        if d == os.path.abspath(directory) and n == name and not m.closed:
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
            recovered = set(self.mgr.recovered_steps)
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
