"""DataLoader worker processes that leave SIGTERM and SIGINT to the training process.

Slurm preemption, ``scancel``, ``docker stop`` and Ctrl+C signal every process of the job.
A torch worker dies of a SIGTERM that its parent did not send (torch's C handler), and the
main process's SIGCHLD handler then raises ``RuntimeError: DataLoader worker ... is killed by
signal`` before the training loop reaches the step where the manager saves; a forked worker
also runs the main process's Python SIGINT handler. Workers of a
:class:`~pitstop.adapters.torch.ResumableLoader` instead keep both signals blocked and let a
small thread take them with ``sigtimedwait``: SIGINT, and a SIGTERM from anyone but the
training process, are dropped (the main process acts on them: save, then exit); a SIGTERM
from the training process (``Process.terminate()``, which multiprocessing uses on daemonic
workers at exit and torch as a last resort at shutdown) ends the worker at once, as torch's
own handler would. A worker whose training process is gone ends: at start-up (a worker still
starting when its trainer was killed), on any SIGTERM, and within a second or two otherwise
(torch's own watchdog misses a trainer that died before the worker started, and one that
is not the worker's parent, as under ``forkserver``). The training process is the one
multiprocessing names (``parent_process()``), not ``os.getppid()``, which is the forkserver
under ``forkserver`` and init for an orphan. Workers still exit on the loader's normal
shutdown.

So that no signal reaches a worker between its start and ``worker_init_fn``, the loader
starts its workers in :func:`start_workers`: with both signals blocked in the starting thread
(a blocked signal to the main process waits and is delivered when they are unblocked; a
worker inherits the mask). Two helper processes of multiprocessing matter there:

- the resource tracker (``spawn``, ``forkserver``): starting it *unblocks* both signals in the
  calling thread (``resource_tracker.ensure_running``), so it is started before the window.
  It ignores both signals itself.
- the forkserver (``forkserver``): it dies of a SIGTERM to the process group, and the workers
  it forked then stop. Started inside the window it inherits the blocked mask and survives,
  and so do the workers it forks. Other code's processes forked by it must not inherit the
  blocked signals (``Process.terminate()`` would no longer end them): the forkserver preloads
  :mod:`._forkserver_guard`, which unblocks them in every child that is not a
  ResumableLoader worker. A forkserver started earlier by other code, with the signals
  unblocked, cannot be protected: that is logged once, with the fix.

Grandchildren a worker starts with ``subprocess`` inherit the blocked mask.
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
SUPPORTED = hasattr(signal, "pthread_sigmask") and hasattr(signal, "sigtimedwait")


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
        #: an IterableDataset's per-worker states for the workers about to start (set by
        #: the loader before it starts them; see ``_fetch.install``)
        self.stream_resume: dict[str, Any] | None = None

    def __call__(self, worker_id: int) -> None:
        leave_signals_to_main()
        if self.fn is not None:
            self.fn(worker_id)
        from pitstop.adapters.torch._fetch import install
        install(self.stream_resume)

    def __repr__(self) -> str:
        return f"WorkerInit({self.fn!r})"


def leave_signals_to_main() -> None:
    """In a worker process: block SIGTERM and SIGINT and take them on a helper thread; end
    at once if the training process is already gone."""
    if not SUPPORTED:
        # no sigtimedwait (macOS): at least a terminal's Ctrl+C no longer reaches workers
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    trainer = _Trainer()
    if trainer.gone():
        os._exit(0)  # orphaned while starting: nobody will ever read what it loads
    threading.Thread(target=_take_signals, args=(trainer,), name="pitstop-worker-signals",
                     daemon=True).start()


class _Trainer:
    """The training process, as a worker sees it: multiprocessing's ``parent_process()``
    (the process that started the worker: the trainer under fork and spawn, also under
    forkserver, whose forkserver is the worker's OS parent)."""

    def __init__(self) -> None:
        self.ppid = os.getppid()
        parent = multiprocessing.parent_process()
        self.parent = parent
        self.pid = parent.pid if parent is not None and parent.pid else self.ppid

    def gone(self) -> bool:
        if self.ppid == self.pid and os.getppid() != self.ppid:
            return True  # our OS parent was the trainer, and it is not any more
        try:
            return self.parent is not None and not self.parent.is_alive()
        except (OSError, ValueError):  # its sentinel is closed: it is gone
            return True


#: how often (s) a worker's signal thread checks that the training process is still there
_PARENT_CHECK_S = 1.0


def _take_signals(trainer: _Trainer) -> None:
    while True:
        info = signal.sigtimedwait(SIGNALS, _PARENT_CHECK_S)
        if info is None:
            if trainer.gone():
                os._exit(0)  # as torch's watchdog does when it notices
            continue
        if info.si_signo == signal.SIGTERM and (info.si_pid == trainer.pid or trainer.gone()):
            os._exit(0)  # what torch's handler does when the parent terminates a worker
        log.debug("pitstop: DataLoader worker %d leaves signal %d from pid %d to the main "
                  "process", os.getpid(), info.si_signo, info.si_pid)


# --------------------------------------------------------------------- starting workers
#: the module the forkserver preloads so that its children other than ResumableLoader
#: workers get the signals unblocked (see the module docstring)
GUARD = "pitstop.adapters.torch._forkserver_guard"

#: what this process saw: whether a ResumableLoader started worker processes, and the
#: warnings given about helper processes that a group signal kills (for worker_death_hint)
seen: dict[str, Any] = {"started": False, "unprotected": []}
_warned: set[Any] = set()


def start_workers(context: Any, start: Callable[[], Any]) -> Any:
    """``start()`` (it starts DataLoader workers under ``context``, a multiprocessing
    context or None for the default one), so that the workers and the helper processes
    they need are born with SIGTERM and SIGINT blocked."""
    if not SUPPORTED:
        return start()
    method = (context if context is not None else multiprocessing.get_context()
              ).get_start_method()
    if method in ("spawn", "forkserver"):
        # started now, not inside the window: starting it unblocks both signals there
        from multiprocessing import resource_tracker
        resource_tracker.ensure_running()
    with signals_blocked():
        if method == "forkserver":
            _ensure_forkserver()
        it = start()
        unblocked = SIGNALS - signal.pthread_sigmask(signal.SIG_BLOCK, [])
    seen["started"] = True
    if unblocked and "mask" not in _warned:
        _warned.add("mask")
        _unprotected(
            "something unblocked SIGTERM/SIGINT while this ResumableLoader started its "
            "worker processes (a multiprocessing helper starting inside that window?), so "
            "they may die of a signal sent to the whole process group before pitstop can "
            "save. Please report this with your multiprocessing_context.")
    return it


def _ensure_forkserver() -> None:
    """Start the forkserver now (inside the blocked window) unless it runs; warn once when
    it was started earlier without the signals blocked."""
    from multiprocessing import forkserver
    server = getattr(forkserver, "_forkserver", None)
    if server is None:
        return
    before = getattr(server, "_forkserver_pid", None)
    preload = list(getattr(server, "_preload_modules", None) or [])
    if GUARD not in preload:
        server._preload_modules = [*preload, GUARD]  # read only when it starts
    forkserver.ensure_running()
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None or pid != before or ("forkserver", pid) in _warned:
        return  # started just now, blocked
    blocked = _blocked_signals(pid)
    if blocked is not None and signal.SIGTERM not in blocked:
        _warned.add(("forkserver", pid))
        _unprotected(
            f"the forkserver process (pid {pid}) that starts this ResumableLoader's worker "
            "processes was started earlier, by other code (another DataLoader or a "
            "multiprocessing pool with the forkserver start method), without SIGTERM "
            "blocked: a SIGTERM to the whole process group (Slurm, scancel, docker stop, "
            "kill -TERM -<pgid>) kills it and then the workers, and training stops before "
            "pitstop can save. Iterate the ResumableLoader before that code starts the "
            "forkserver, or pass multiprocessing_context='spawn' to the ResumableLoader.")


def _unprotected(text: str) -> None:
    seen["unprotected"].append(text)
    log.warning("pitstop: %s", text)


def _blocked_signals(pid: int) -> set[int] | None:
    """The signals process ``pid`` blocks (from /proc; None where that cannot be read)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigBlk:"):
                    bits = int(line.split()[1], 16)
                    return {n for n in range(1, 65) if bits >> (n - 1) & 1}
    except (OSError, ValueError):
        return None
    return None


def worker_death_hint(exc: BaseException) -> str | None:
    """The fix to name when training died of a DataLoader worker killed by a signal (an
    ``exception_hints`` entry: the signal's save could not happen)."""
    if not (isinstance(exc, RuntimeError) and "DataLoader worker" in str(exc)):
        return None
    if seen["unprotected"]:
        return ("A ResumableLoader's worker processes could not be protected from a signal "
                "sent to the whole process group: " + seen["unprotected"][-1])
    plain = ("A plain DataLoader's workers die of a signal sent to the whole process group "
             "(Slurm, scancel, a terminal's Ctrl+C, kill -TERM -<pgid>), and torch then stops "
             "the training loop. Use pitstop.adapters.torch.ResumableLoader: its workers leave "
             "the signal to the training process, which saves and then exits as the signal "
             "asks.")
    if not seen["started"]:
        return plain
    return (plain + " If the worker that died was a ResumableLoader's: a process it relies "
            "on was killed, e.g. a forkserver that other code had started before the loader "
            "(multiprocessing_context='forkserver'); pass multiprocessing_context='spawn' or "
            "'fork' to the ResumableLoader, or iterate it before that code runs. Workers of "
            "a plain DataLoader in the same job die of such a signal as well.")
