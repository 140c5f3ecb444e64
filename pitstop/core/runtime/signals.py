"""Saves on a signal: SIGTERM / SIGINT / SIGUSR1 are noted at once and acted on at the next
step boundary (the only moment the state is consistent).

:class:`SignalSaver` owns pitstop's handlers. The handler never saves and never touches
the manager: it only records the signal. A repeat of the same terminating signal acts at
once (the user means it). The handlers hold no reference to the manager, so a manager the
program drops can still be collected; once its saver is retired, or in a forked child
(a DataLoader worker, a ``multiprocessing`` process), the handler behaves exactly as the
handler the program had before pitstop installed its own — and in a forked child that
previous handler is put back right after the fork.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

from pitstop.core.runtime import supervised
from pitstop.core.runtime.preemption import Notice

log = logging.getLogger("pitstop")

DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")
#: signals after whose save the process goes on training (a "checkpoint now" request)
CONTINUE_SIGNALS = {"SIGUSR1"}

_savers: weakref.WeakSet[SignalSaver] = weakref.WeakSet()


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class SignalSaver:
    """pitstop's handlers for ``names``; ``pending`` is the signal to act on at the next step."""

    def __init__(self, names: Iterable[str | int] | None) -> None:
        self.owner_pid = os.getpid()
        #: the handler each signal had before pitstop's
        self.previous: dict[int, Any] = {}
        #: noted, not yet acted on
        self.pending: int | None = None
        #: being acted on (its save is under way): a repeat of it acts at once
        self.handling: int | None = None
        #: a repeated signal stopped waiting for the save: exit without waiting for it
        self.abandoned = False
        self.active = True
        #: when the signal arrived (for the message if training dies before the boundary)
        self.received_at: float | None = None
        #: SIGTERM's deadline is its arrival plus this (None: no deadline; set by the manager)
        self.grace_seconds: float | None = None
        #: the notice the pending save is for (a signal, or a cloud notice from the
        #: preemption watcher), and the one being acted on
        self.notice: Notice | None = None
        self.handling_notice: Notice | None = None
        self._install(names)
        _savers.add(self)

    def _install(self, names: Iterable[str | int] | None) -> None:
        signums = check_signals(names)
        if not signums:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning("pitstop: this CheckpointManager was created on a thread other than "
                        "the main one, where Python lets no one install signal handlers: "
                        "SIGTERM/SIGINT do not save. Create it on the main thread (it may be "
                        "used from others), or pass save_on_signals=None to silence this.")
            return
        for signum in signums:
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN:
                continue
            self.previous[signum] = previous
            signal.signal(signum, self._on_signal)

    # ------------------------------------------------------------------ the handler
    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self.active or os.getpid() != self.owner_pid:
            # not ours to act on (the manager is gone, or this is a forked child): do what
            # the program's own handler would have done
            self._delegate(signum, frame)
            return
        if signum in (self.pending, self.handling):
            if signal_name(signum) in CONTINUE_SIGNALS:
                return  # a save for it is already requested or under way
            launcher = _forwarding_launcher()
            if launcher is not None:
                # a launcher forwards the stop signal that a scheduler (scancel, a preemption,
                # a time limit) also sends every process directly: the same request twice.
                # The launcher is the one to insist to (it kills its job)
                log.warning("pitstop: %s again, under %s (a scheduler signals every process, "
                            "and %s forwards it too): the same request; the save for it goes "
                            "on (%s stops the job at once)", signal_name(signum), launcher,
                            launcher, "signalling pitstop run again" if launcher ==
                            "pitstop run" else "SIGKILL")
                return
            # asked twice: the user means it, act now (also while the first save persists)
            self.abandoned = True
            self.exit_like(signum)
        first = self.handling if self.handling is not None else self.pending
        if first is not None and signal_name(first) not in CONTINUE_SIGNALS and \
                signal_name(signum) not in CONTINUE_SIGNALS:
            # another stop request while one is noted or its save runs (SIGINT after
            # SIGTERM): the user insists; leave now, as the first one asks
            self.abandoned = True
            self.exit_like(first)
        self.pending = signum
        self.received_at = time.monotonic()
        name = signal_name(signum)
        if self.notice is None or self.notice.source.startswith("SIG"):
            now = time.time()  # (a cloud notice already pending keeps its deadline)
            grace = self.grace_seconds if name == "SIGTERM" else None
            self.notice = Notice(name, now, now + grace if grace else None)
        log.warning("pitstop: %s received; saving at the next step boundary", name)

    def mark(self, notice: Notice, exit_after: bool) -> None:
        """A cloud preemption notice (from the watcher thread): save at the next step
        boundary as SIGUSR1 asks, or as SIGTERM asks with ``exit_after``."""
        if not self.active or os.getpid() != self.owner_pid:
            return
        signum = signal.SIGTERM if exit_after else signal.SIGUSR1
        pending = self.pending
        self.notice = notice
        if pending is None or (exit_after and signal_name(pending) in CONTINUE_SIGNALS):
            self.pending = signum
            self.received_at = time.monotonic()
        deadline = "no deadline given" if notice.deadline_unix is None else \
            f"deadline in {notice.deadline_unix - time.time():.1f} s"
        log.warning("pitstop: preemption notice from %s (%s); saving at the next step "
                    "boundary%s", notice.source, deadline,
                    ", then exiting" if exit_after else "")

    def _delegate(self, signum: int, frame: Any) -> None:
        previous = self.previous.get(signum, signal.SIG_DFL)
        if previous is signal.SIG_IGN:
            return
        if callable(previous) and previous is not signal.SIG_DFL:
            previous(signum, frame)
            return
        _default_action(signum)

    # ------------------------------------------------------------------ acting on it
    def take(self) -> int | None:
        """The pending signal, now being handled (None when there is none)."""
        signum = self.pending
        if signum is not None:
            self.handling = signum
            self.handling_notice, self.notice = self.notice, None
            self.pending = None
        return signum

    def exit_like(self, signum: int) -> None:
        """Leave the way the signal asks, as the program's previous handler would."""
        previous = self.previous.get(signum, signal.SIG_DFL)
        self.retire()
        if signum == signal.SIGINT and previous in (signal.default_int_handler, signal.SIG_DFL):
            raise KeyboardInterrupt
        if callable(previous) and previous not in (signal.SIG_DFL, signal.SIG_IGN):
            previous(signum, None)
            return
        _default_action(signum)

    def retire(self) -> None:
        """Put the previous handlers back (where this thread may); from now on pitstop's
        handler, if still installed, behaves as the previous one. A signal noted before
        stays in ``pending`` for the caller to act on."""
        self.active = False
        if threading.current_thread() is threading.main_thread():
            self._put_back()

    def _after_fork_in_child(self) -> None:
        # the forking thread is the child's main thread
        self.active = False
        self.pending = None
        self._put_back()

    def _put_back(self) -> None:
        for signum, previous in list(self.previous.items()):
            try:
                if signal.getsignal(signum) == self._on_signal:
                    signal.signal(signum, _unretired(signum, previous))
            except (ValueError, TypeError):
                pass


def _unretired(signum: int, handler: Any) -> Any:
    """``handler``, or, where it is a retired saver's (managers closed in another order than
    made), the handler that saver had found: the program's own handler, not a dead one."""
    seen = 0
    while isinstance(getattr(handler, "__self__", None), SignalSaver) and \
            getattr(handler, "__func__", None) is SignalSaver._on_signal and \
            not handler.__self__.active and seen < 1000:
        handler = handler.__self__.previous.get(signum, signal.SIG_DFL)
        seen += 1
    return handler


def _forwarding_launcher() -> str | None:
    """The launcher this process runs under that forwards stop signals to it, and kills it
    on its own when asked again: ``pitstop run`` or torchrun (None: neither)."""
    if os.environ.get(supervised.ENV):
        return "pitstop run"
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return "torchrun"
    return None


def check_signals(names: Iterable[str | int] | None) -> list[int]:
    """The signal numbers of ``save_on_signals``, every one checked before any is installed:
    known, and one a handler can catch (not SIGKILL or SIGSTOP)."""
    from pitstop.core.errors import InvalidArgumentError
    if names is None:
        return []
    if isinstance(names, (str, int)):
        names = [names]
    out = []
    for name in names:
        if isinstance(name, str):
            value = getattr(signal, name, None)
            if not isinstance(value, int) or not name.startswith("SIG") or \
                    name.startswith("SIG_"):
                raise InvalidArgumentError(f"save_on_signals: unknown signal {name!r} (use "
                                           "names such as 'SIGTERM', or numbers)")
            signum = int(value)
        elif isinstance(name, int) and not isinstance(name, bool):
            signum = int(name)
        else:
            raise InvalidArgumentError(f"save_on_signals: {name!r} is not a signal name or "
                                       "number")
        if signum not in signal.valid_signals() or signum in _UNCATCHABLE:
            raise InvalidArgumentError(
                f"save_on_signals: {name!r} cannot be caught by a handler (SIGKILL and SIGSTOP "
                "never can); pitstop saves on signals such as SIGTERM, SIGINT, SIGUSR1")
        out.append(signum)
    return out


_UNCATCHABLE = {getattr(signal, n) for n in ("SIGKILL", "SIGSTOP") if hasattr(signal, n)}


@contextlib.contextmanager
def child_signals_held() -> Iterator[None]:
    """While a signal's save runs, hold back the program's own SIGCHLD handler (torch's
    DataLoader has one that raises when a worker died of a signal): a signal sent to the
    whole process group (Slurm, ``kill -TERM -PGID``) kills a plain DataLoader's workers
    while their trainer saves, and that raise would fail a save that can still commit.

    Left by KeyboardInterrupt or SystemExit (the process exits as the signal asks), the
    handler stays held; otherwise it is put back and, after a normal return, called once if
    SIGCHLD came meanwhile (the trainer learns of its workers now, as it would have). Main
    thread only (elsewhere nothing is changed)."""
    signum = getattr(signal, "SIGCHLD", None)
    previous: Any = None
    if signum is not None and threading.current_thread() is threading.main_thread():
        with contextlib.suppress(ValueError, TypeError, OSError):
            previous = signal.getsignal(signum)
    if signum is None or not callable(previous) or \
            previous in (signal.SIG_DFL, signal.SIG_IGN):
        yield
        return
    came: list[int] = []
    signal.signal(signum, lambda s, frame: came.append(s))
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise  # leaving: a dead worker no longer matters, and must not replace this exit
    except BaseException:
        signal.signal(signum, previous)
        raise
    signal.signal(signum, previous)
    if came:
        previous(signum, None)


def _default_action(signum: int) -> None:
    if threading.current_thread() is not threading.main_thread():
        # only the main thread may change handlers: send the signal again; the main thread
        # runs the (now previous) handler, which ends the process as the signal asks
        os.kill(os.getpid(), signum)
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    time.sleep(1)  # the signal is delivered at once; this is never reached in practice


def _after_fork_in_child() -> None:
    for saver in list(_savers):
        saver._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)

__all__ = ["SignalSaver", "DEFAULT_SIGNALS", "CONTINUE_SIGNALS", "signal_name",
           "check_signals", "child_signals_held"]
