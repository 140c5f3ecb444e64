"""What ``save`` hands back: :class:`SaveHandle` (snapshot taken now, committed later) and
the figures of one save, :class:`SaveStats` (both exported as ``pitstop.SaveHandle`` /
``pitstop.SaveStats``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from pitstop.core.errors import CheckpointError
from pitstop.core.save.threads import current_pid, wait_event


@dataclass
class SaveStats:
    """Figures of one save. Times are seconds; ``stall_s`` is what the caller waited."""

    step: int
    bytes: int = 0
    arrays: int = 0
    stall_s: float = 0.0
    persist_s: float = 0.0
    total_s: float = 0.0
    #: parts of persist_s: hashing, writing data files (with fsync), manifest + publish
    hash_s: float = 0.0
    write_s: float = 0.0
    commit_s: float = 0.0
    #: bytes of arrays unchanged since the previous save, referenced instead of written
    #: (incremental checkpoints)
    reused_bytes: int = 0
    #: snapshot="lazy": bytes copied in the background after save() returned, how long that
    #: copy took from save(), and how long fences (the next optimizer step, the manager's
    #: next call, a fork) waited for it on the caller's thread
    lazy_bytes: int = 0
    lazy_copy_s: float = 0.0
    fence_wait_s: float = 0.0
    committed: bool = False
    skipped: str | None = None
    #: periodic saves this manager skipped since its previous snapshot because that one was
    #: still persisting (``on_busy="skip"``): the steps this save is the first after
    skipped_before: int = 0
    path: str | None = None

    @property
    def throughput(self) -> float:
        """Bytes per second of the background persist (hash, write, fsync, commit)."""
        return self.bytes / self.persist_s if self.persist_s > 0 else 0.0


class SaveHandle:
    """What ``save`` returns: "snapshot taken" as soon as it returns, "committed" later."""

    def __init__(self, step: int, stats: SaveStats) -> None:
        self.step = step
        self.stats = stats
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._owner_pid = current_pid[0]

    @property
    def snapshot_taken(self) -> bool:
        return self.stats.skipped is None

    @property
    def committed(self) -> bool:
        return self.stats.committed

    def done(self) -> bool:
        """True once the save has committed, failed or been skipped."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the commit; raises the save's error. Returns False on timeout."""
        timeout = check_timeout(timeout)
        if current_pid[0] != self._owner_pid and not self._event.is_set():
            raise CheckpointError(
                f"the save of step {self.step} belongs to process {self._owner_pid}; its "
                f"outcome cannot be waited for in the forked process {current_pid[0]}")
        if not wait_event(self._event, timeout):
            return False
        if self._error is not None:
            self._error.delivered = True  # type: ignore[attr-defined]
            raise self._error
        return True

    def result(self, timeout: float | None = None) -> SaveStats:
        """Wait for the commit and return the save's figures."""
        if not self.wait(timeout):
            raise TimeoutError(f"save of step {self.step} did not commit within {timeout} s")
        return self.stats

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._event.set()

    def __repr__(self) -> str:
        state = ("failed" if self._error else "committed" if self.committed else
                 f"skipped ({self.stats.skipped})" if self.stats.skipped else "persisting")
        return f"<SaveHandle step={self.step} {state}>"



def check_timeout(timeout: Any) -> float | None:
    """A wait's timeout: None (no limit) or a number of seconds."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        from pitstop.core.errors import InvalidArgumentError
        raise InvalidArgumentError(f"timeout must be a number of seconds or None, got "
                                   f"{timeout!r}")
    return float(timeout)

