"""The lazy snapshot (``snapshot="lazy"``, DataStates-LLM's design): the copy of the arrays an
adapter marks ``lazy_safe`` (torch parameters and optimizer state) starts at ``save()`` and
runs on the copy threads while the next forward and backward passes compute, which do not
write those arrays; it is *fenced* before anything next writes them.

A :class:`LazyCopy` is one save's deferred copy. Every one still pending sits in a
process-wide registry, and :func:`fence_all` waits for them (helping with the copy rather
than idling): adapters call it in front of the framework's next mutation (torch: an
optimizer step pre-hook, see ``pitstop.adapters.torch._leaf``), the manager at its next
call, and ``os.fork`` before it forks (a child never inherits a half-copied buffer, nor a
lock held by a copy thread). This module imports no framework.

In-place writes outside the contract are caught where the adapter gives a version counter
(torch's ``Tensor._version``): the counters of the lazily copied arrays are read at
``save()``, again when the copy ends, and once more either at the first fence after it (on
the training thread, so no write can be half done) or just before the commit, whichever
comes first; a change fails that save (never a silently wrong checkpoint).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from pitstop.core.errors import CheckpointError
from pitstop.core.save.threads import wait_event

#: arrays smaller than this are copied at save() even when lazy-safe (a background copy of
#: a few bytes costs more in bookkeeping than it saves)
LAZY_MIN_BYTES = 16 << 10

_lock = threading.Lock()
#: lazy copies that a fence may still have to wait for (or take the versions of)
_pending: list[LazyCopy] = []


class LazyVersionError(CheckpointError):
    """An array copied lazily was written in place between ``save()`` and the fence."""


class LazyCopy:
    """One save's deferred copy: ``tasks`` run on the copy threads (and on any thread that
    fences while some are left); ``done`` is set when every task ran and the leaves'
    asynchronous copies were fenced. ``error`` is the first failure (the save's)."""

    def __init__(self, step: int, tasks: list[Callable[[], None]], leaves: list[Any],
                 keys: list[str], stats: Any = None,
                 hooks: dict[str, Callable[..., Any]] | None = None) -> None:
        self.step = step
        self.stats = stats
        self.hooks = hooks if hooks is not None else {}
        self.nbytes = sum(int(getattr(leaf, "nbytes", 0)) for leaf in leaves)
        self._tasks = tasks
        self._next = 0
        self._running = 0
        self._finishing = False
        self._leaves = leaves
        self._keys = keys
        #: the version of each leaf at save() (None: the leaf has no version counter)
        self._versions = [_version_of(leaf) for leaf in leaves]
        self._mutex = threading.Lock()
        #: set once the copy may start (a test hook can hold it back)
        self.started = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None
        #: the versions were taken for the last time (at a fence or before the commit)
        self._closed_versions: list[Any] | None = None
        self.t0 = time.perf_counter()
        self.copy_s = 0.0
        self.fence_wait_s = 0.0

    # ------------------------------------------------------------------ copying
    def register(self) -> None:
        """From now on every fence waits for this copy (it runs the copy itself when no copy
        thread has started it yet)."""
        if "before_lazy_copy" not in self.hooks:
            self.started.set()
        with _lock:
            _pending.append(self)

    def launch(self, submit: Callable[..., Any], runners: int) -> None:
        """Hand the copy to ``runners`` copy threads: the last thing save() does, so the
        copy threads do not compete with save()'s own bookkeeping for the GIL."""
        submit(self._first)
        for _ in range(max(0, runners - 1)):
            submit(self.run)

    def _first(self) -> None:
        hook = self.hooks.get("before_lazy_copy")
        try:
            if hook is not None:
                hook(self.step)
        except BaseException as e:  # noqa: BLE001 - the save's failure
            self._fail(e)
        finally:
            self.started.set()
        self.run()

    def run(self) -> None:
        """Run copy tasks until none is left (any thread may call it; the last finisher
        fences the leaves' asynchronous copies and sets ``done``)."""
        self.started.wait()
        while True:
            with self._mutex:
                if self._next >= len(self._tasks) or self.error is not None:
                    if self._running or self._finishing:
                        return  # another thread finishes
                    self._finishing = True
                    break
                task = self._tasks[self._next]
                self._next += 1
                self._running += 1
            try:
                task()
            except BaseException as e:  # noqa: BLE001 - the save's failure
                self._fail(e)
            with self._mutex:
                self._running -= 1
        self._finish()

    def _fail(self, e: BaseException) -> None:
        with self._mutex:
            if self.error is None:
                self.error = e

    def _finish(self) -> None:
        try:
            if self.error is None:
                fences: list[Callable[[], None]] = []
                for leaf in self._leaves:
                    fence = getattr(leaf, "snapshot_fence", None)
                    if fence is not None and fence not in fences:
                        fences.append(fence)
                for fence in fences:
                    fence()
                self._check(self._current_versions(), "while it was being copied")
        except BaseException as e:  # noqa: BLE001 - the save's failure
            self._fail(e)
        finally:
            self._tasks = []
            self.copy_s = time.perf_counter() - self.t0
            if self.stats is not None:
                self.stats.lazy_copy_s = self.copy_s
            self.done.set()
            if self.error is not None:
                self.retire()

    # ------------------------------------------------------------------ fences
    def fence(self) -> float:
        """Wait for the copy (helping with what is left); the first fence after it also
        takes the leaves' versions (no write can be half done on the fencing thread).
        Returns the seconds waited."""
        waited = 0.0
        if not self.done.is_set():
            t0 = time.perf_counter()
            hook = self.hooks.get("lazy_fence")
            if hook is not None:
                hook(self.step)
            if self.started.is_set():
                self.run()  # help: copy what is left on this thread too
            wait_event(self.done)
            waited = time.perf_counter() - t0
            self.fence_wait_s += waited
            if self.stats is not None:
                self.stats.fence_wait_s = self.fence_wait_s
        self.close_versions()
        return waited

    def close_versions(self) -> list[Any]:
        """The leaves' versions as of now, taken once (later calls return the first)."""
        with self._mutex:
            if self._closed_versions is None:
                self._closed_versions = self._current_versions()
            closed = self._closed_versions
        self.retire()
        return closed

    def check_final(self) -> None:
        """Raise when a lazily copied array was written in place between save() and the
        first fence (or now, if no fence came yet): called just before the commit."""
        self._check(self.close_versions(), "before the next optimizer step")

    def retire(self) -> None:
        """No fence needs to wait for this copy any more."""
        with _lock:
            if self in _pending:
                _pending.remove(self)

    def _current_versions(self) -> list[Any]:
        return [None if v is None else _version_of(leaf)
                for v, leaf in zip(self._versions, self._leaves, strict=True)]

    def _check(self, now: list[Any], when: str) -> None:
        for key, before, after in zip(self._keys, self._versions, now, strict=True):
            if before is not None and before != after:
                raise LazyVersionError(
                    f"the tensor {key!r} was written in place after save() of step "
                    f"{self.step} returned and {when} (snapshot='lazy' copies parameters and "
                    "optimizer state in the background until the next optimizer step), so "
                    "its saved bytes might mix old and new values; the step is not "
                    "committed. After a lazy save, change parameters only in "
                    "optimizer.step() (or call mgr.wait() first), or use "
                    "snapshot='eager'. This manager takes its later saves eagerly")


def _version_of(leaf: Any) -> Any:
    get = getattr(leaf, "version", None)
    if get is None:
        return None
    try:
        return get()
    except Exception:  # noqa: BLE001 - no counter: nothing to compare
        return None


def pending() -> list[LazyCopy]:
    """The lazy copies a fence would wait for now."""
    with _lock:
        return list(_pending)


def fence_all() -> float:
    """Wait for every pending lazy copy of this process (any manager); the seconds waited.
    Cheap when none is pending (one list check): called before every optimizer step."""
    if not _pending:
        return 0.0
    waited = 0.0
    for copy in pending():
        waited += copy.fence()
    return waited


def _before_fork() -> None:
    # a child must never inherit a buffer half copied, nor a copy lock held by a thread
    # that does not exist there
    if _pending:
        fence_all()


def _in_child() -> None:
    global _lock
    _lock = threading.Lock()
    _pending.clear()  # the parent's copies: nothing of the child's to wait for


os.register_at_fork(before=_before_fork, after_in_child=_in_child)
