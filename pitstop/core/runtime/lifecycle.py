"""A manager's resources and the end of its life: what it holds (engine, staging buffers,
memory tier, signal handlers, the directory lock), gathered without a reference back to the
manager so a dropped manager can be collected, and released by ``close()``, a finalizer
(garbage collection, interpreter exit) or a multiprocessing worker's exit hook; and the
messages a user gets when something is lost there or the memory tier steps aside."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
import warnings
from typing import Any

from pitstop.core.directory.recovery import Recovered
from pitstop.core.errors import CheckpointError
from pitstop.core.runtime.preemption import Watcher
from pitstop.core.runtime.signals import SignalSaver, signal_name
from pitstop.core.save.engine import Engine
from pitstop.core.save.memtier import MemoryTier
from pitstop.core.save.snapshot import StagingPool

log = logging.getLogger("pitstop")


class Resources:
    """What a manager holds, without a reference back to it, so a dropped manager can be
    collected and its resources released by a finalizer (or at interpreter exit)."""

    def __init__(self, owner_pid: int, directory: str, lock: Any = None) -> None:
        self.owner_pid = owner_pid
        self.directory = directory
        self.lock = lock
        self.engine: Engine | None = None
        self.pool: StagingPool | None = None
        self.tier: MemoryTier | None = None
        self.signals: SignalSaver | None = None
        #: the preemption notices' watcher thread (None: none watched)
        self.watcher: Watcher | None = None
        self.recovered: list[Recovered] = []
        self.released = False

    def release(self, unattended: bool) -> CheckpointError | None:
        """Commit what was accepted, then release everything. ``unattended``: from the
        garbage collector or interpreter exit, where nobody can catch an error (it is logged
        instead, loudly)."""
        if os.getpid() != self.owner_pid or self.released:
            return None  # a forked child: nothing here is the child's to release
        if self.engine is not None and self.engine.on_own_thread():
            # the garbage collector ran this finalizer on pitstop's own thread (a manager in
            # a reference cycle): waiting for the saves here would wait for itself
            threading.Thread(target=self.release, args=(unattended,),
                             name="pitstop-release").start()
            return None
        self.released = True
        if self.watcher is not None:
            self.watcher.stop()  # (no notice can matter once the manager is released)
        error: CheckpointError | None = None
        engine = self.engine
        if unattended and self.signals is not None and self.signals.abandoned:
            # interrupted twice: the user wants out now, without waiting for the save (its
            # snapshot stays in the memory tier, when that is on, for the next start)
            self.signals.retire()
            return None
        try:
            if engine is not None:
                pending = sorted(engine.pending_steps())
                if unattended and pending:
                    log.warning("pitstop: CheckpointManager(%r) was not closed: committing "
                                "step(s) %s before it goes", self.directory, pending)
                engine.close()
                try:
                    engine.raise_pending()
                except CheckpointError as e:
                    error = e
            if unattended and self.signals is not None and self.signals.pending is not None:
                log.error("pitstop: %s", lost_signal_message(self.signals.pending,
                                                              self.signals, None, None))
            if self.pool is not None:
                for r in self.recovered:
                    self.pool.release(r.buffer)
                # the tier outlives crashes, not a clean close; keep it if a save failed
                self.pool.close(unlink=error is None)
            if self.tier is not None and error is None:
                self.tier.remove_all()
        finally:
            if self.signals is not None:
                self.signals.retire()
            if self.lock is not None:
                with contextlib.suppress(OSError):
                    self.lock.release()
                self.lock = None
        if error is not None and unattended:
            log.error("pitstop: a save accepted by CheckpointManager(%r) was lost: %s",
                      self.directory, error)
            return None
        return error


class TierFallback:
    """Warns once when the memory tier steps aside: when it cannot hold a snapshot (the save
    then stages in private memory: the tier's size, what the state needs, and how to fix
    it), or when it cannot describe one (:meth:`trouble`); one warning per manager, whichever
    comes first, since both have one cause (a full or unwritable tier)."""

    def __init__(self, root: str | None) -> None:
        self.root = root
        self.warned = False

    def trouble(self, error: OSError, what: str) -> None:
        """The tier's bookkeeping failed (``what``: "description of step 3 could not be written"): saves go
        on, but a crash before a commit may lose that save."""
        if self.warned:
            log.debug("pitstop: memory tier: %s (%s)", what, error)
            return
        self.warned = True
        text = (f"pitstop: the memory tier {what} ({error}): saves go on, but a crash before "
                f"a commit may lose that save. To keep the tier: {self._fix(error)}; to "
                "silence this, memory_tier=False.")
        log.warning("%s", text)
        warnings.warn(text, stacklevel=2)

    def _fix(self, error: OSError) -> str:
        code = error.errno
        if code == errno.EFBIG:
            return ("a file-size limit stops the tier's file: raise it (`ulimit -f unlimited`, "
                    "or the job's RLIMIT_FSIZE)")
        if code in (errno.EMFILE, errno.ENFILE):
            return "no file descriptor was left: raise the limit (`ulimit -n`)"
        if code in (errno.EACCES, errno.EPERM, errno.EROFS):
            return (f"{self.root} is not writable here: give the job write access, or pass "
                    "memory_tier='<a writable dir on a tmpfs>'")
        if code == errno.EEXIST:
            return ("a file pitstop did not make (another user's, or a symlink) is in the way: "
                    "remove it, or pass memory_tier='<a directory of your own on a tmpfs>'")
        if code == errno.ENOENT:
            return f"{self.root} does not exist: create it, or pass another memory_tier"
        return ("enlarge /dev/shm (`docker run --shm-size=<size>`; in Kubernetes mount an "
                "emptyDir with `medium: Memory` and a sizeLimit at /dev/shm), or pass "
                "memory_tier='<dir on a larger tmpfs>'")

    def __call__(self, error: OSError, nbytes: int) -> None:
        if self.warned:
            log.debug("pitstop: memory tier unavailable again: %s", error)
            return
        self.warned = True
        size = free = None
        with contextlib.suppress(OSError):
            st = os.statvfs(self.root or "/dev/shm")
            size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        have = (f"{self.root} has {_mib(size)} ({_mib(free)} free)" if size is not None
                else f"{self.root} cannot be inspected")
        fix = self._fix(error)
        text = (f"pitstop: the memory tier cannot hold this snapshot ({type(error).__name__}: "
                f"{error}): the state needs {_mib(nbytes)} and {have}. Saves go on, staged in "
                "private memory (a crash between a save and its commit then loses that "
                f"save). To keep the tier: {fix}; to silence this, memory_tier=False.")
        log.warning("%s", text)
        # user code <- save/step <- _save <- snapshot <- acquire <- _allocate <- here
        warnings.warn(text, stacklevel=7)


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:.1f} MiB"


def lost_signal_message(signum: int, signals: SignalSaver, exc: BaseException | None,
                         committed: list[int] | None) -> str:
    name = signal_name(signum)
    ago = ""
    if signals.received_at is not None:
        ago = f" {time.monotonic() - signals.received_at:.1f} s ago"
    newest = f"; the newest committed step is {committed[-1]}" if committed else ""
    if exc is None:
        return (f"{name} arrived{ago}, but the process is exiting before the next step "
                f"boundary: nothing was saved for it{newest}.")
    hint = _hint_for(exc)
    return (f"{name} arrived{ago}, but training stopped with {type(exc).__name__}: {exc} "
            f"before the next step boundary, so nothing was saved for it{newest}."
            + (f" {hint}" if hint else ""))


def _hint_for(exc: BaseException) -> str | None:
    from pitstop.core.adapter import exception_hints
    for hint in exception_hints:
        try:
            text = hint(exc)
        except Exception:  # noqa: BLE001 - a hint must never hide the real error
            continue
        if text:
            return str(text)
    return None


__all__ = ["Resources", "TierFallback", "lost_signal_message"]
