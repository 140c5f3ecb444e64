"""The engine's own threads, and a wait that lets signals in.

Below every other save module: handles, the lazy copy and the engine all wait with
:func:`wait_event` and run calls on :class:`Workers`.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import wait as wait_all
from typing import Any

#: longest uninterrupted wait on the main thread (see :func:`wait_event`)
SIGNAL_POLL_S = 0.1

#: this process's pid, kept current across forks (os.getpid() is a system call, and the
#: per-step calls check it): what pitstop made belongs to the process that made it
current_pid = [os.getpid()]
os.register_at_fork(after_in_child=lambda: current_pid.__setitem__(0, os.getpid()))


def wait_event(event: threading.Event, timeout: float | None = None) -> bool:
    """``event.wait(timeout)``, in short slices on the main thread.

    Python runs signal handlers only on the main thread, between bytecodes; an untimed lock
    wait is not woken when the kernel delivers the signal to another thread (the persist or
    I/O threads), so a second Ctrl+C / SIGTERM during a save would wait for the save.
    """
    if threading.current_thread() is not threading.main_thread():
        return event.wait(timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = SIGNAL_POLL_S if deadline is None else min(SIGNAL_POLL_S,
                                                          deadline - time.monotonic())
        if left <= 0:
            return event.is_set()
        if event.wait(left):
            return True


class Workers:
    """A few daemon threads running submitted calls; their futures are standard ones.

    A ``ThreadPoolExecutor`` would do, except that interpreter shutdown stops it *before*
    ``atexit`` handlers run, and pitstop's handler must still hash and write the saves a
    script accepted without calling ``close()``.
    """

    def __init__(self, n: int, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]
                                       | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
                         for i in range(max(1, n))]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        f: Future[Any] = Future()
        self._queue.put((f, fn, args))
        return f

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        """``fn`` over ``items``; waits for *every* call before raising the first failure."""
        futures = [self.submit(fn, item) for item in items]
        wait_all(futures)
        return [f.result() for f in futures]

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            f, fn, args = item
            if not f.set_running_or_notify_cancel():
                continue
            try:
                f.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on it
                f.set_exception(e)
            del item, f, fn, args

    def owns(self, thread: threading.Thread) -> bool:
        return thread in self._threads

    def shutdown(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()

