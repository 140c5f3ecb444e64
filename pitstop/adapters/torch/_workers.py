"""DataLoader worker processes that leave SIGTERM and SIGINT to the training process.

Slurm preemption, ``scancel``, ``docker stop`` and Ctrl+C signal every process of the job.
A torch worker dies of a SIGTERM that its parent did not send (torch's C handler), and the
main process's SIGCHLD handler then raises ``RuntimeError: DataLoader worker ... is killed by
signal`` before the training loop reaches the step where the manager saves; a forked worker
also runs the main process's Python SIGINT handler. Workers of a
:class:`~pitstop.adapters.torch.ResumableLoader` instead keep both signals blocked and let a
small thread take them with ``sigwaitinfo``: SIGINT, and a SIGTERM from anyone but the
parent, are dropped (the main process acts on them: save, then exit); a SIGTERM from the
parent (``Process.terminate()``, which multiprocessing uses on daemonic workers at exit and
torch as a last resort at shutdown) or arriving after the parent is gone ends the worker at
once, as torch's own handler would. Workers still exit when the parent exits (torch's
watchdog) and on the loader's normal shutdown.

So that no signal reaches a worker between its start and ``worker_init_fn``, the loader
blocks both signals in the thread that starts the workers while it does (a blocked signal
to the main process waits and is delivered when they are unblocked; a worker inherits the
mask). Grandchildren a worker starts with ``subprocess`` inherit the blocked mask too.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("pitstop")

#: the signals a job's scheduler or a terminal sends to the whole process group
SIGNALS: frozenset[int] = frozenset(
    s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGINT", None))
    if s is not None)
SUPPORTED = hasattr(signal, "pthread_sigmask") and hasattr(signal, "sigwaitinfo")


@contextlib.contextmanager
def signals_blocked() -> Iterator[None]:
    """Block SIGTERM and SIGINT in this thread for the duration (workers started meanwhile
    inherit the mask); a signal that arrives meanwhile is delivered afterwards, not lost."""
    if not SUPPORTED:
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class WorkerInit:
    """A ``worker_init_fn`` that first leaves SIGTERM/SIGINT to the main process, then calls
    the user's own ``worker_init_fn`` (picklable as long as that one is, for ``spawn``)."""

    def __init__(self, fn: Callable[[int], Any] | None) -> None:
        self.fn = fn

    def __call__(self, worker_id: int) -> None:
        leave_signals_to_main()
        if self.fn is not None:
            self.fn(worker_id)

    def __repr__(self) -> str:
        return f"WorkerInit({self.fn!r})"


def leave_signals_to_main() -> None:
    """In a worker process: block SIGTERM and SIGINT and take them on a helper thread."""
    if not SUPPORTED:
        # no sigwaitinfo (macOS): at least a terminal's Ctrl+C no longer reaches workers
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    ppid = os.getppid()
    parents = {ppid}
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:
        parents.add(parent.pid)  # the main process, also under forkserver
    threading.Thread(target=_take_signals, args=(parents, ppid),
                     name="pitstop-worker-signals", daemon=True).start()


def _take_signals(parents: set[int], ppid: int) -> None:
    while True:
        info = signal.sigwaitinfo(SIGNALS)
        if info.si_signo == signal.SIGTERM and (info.si_pid in parents or os.getppid() != ppid):
            os._exit(0)  # what torch's handler does when the parent terminates a worker
        log.debug("pitstop: DataLoader worker %d leaves signal %d from pid %d to the main "
                  "process", os.getpid(), info.si_signo, info.si_pid)


def worker_death_hint(exc: BaseException) -> str | None:
    """The fix to name when training died of a DataLoader worker killed by a signal (an
    ``exception_hints`` entry: the signal's save could not happen)."""
    if isinstance(exc, RuntimeError) and "DataLoader worker" in str(exc):
        return ("A plain DataLoader's workers die of a signal sent to the whole process group "
                "(Slurm, scancel, a terminal's Ctrl+C, kill -TERM -<pgid>), and torch then "
                "stops the training loop. Use pitstop.adapters.torch.ResumableLoader: its "
                "workers leave the signal to the training process, which saves and then exits "
                "as the signal asks.")
    return None
