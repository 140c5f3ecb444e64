"""Periodic saves skipped because the previous one was still persisting (``on_busy="skip"``).

A skip is never silent: the first one of a manager warns with why and what to do, later
ones are summed up at most once per :data:`WARN_EVERY_S` (and once more at ``close()``), each
is counted (``CheckpointManager.skipped_saves``, ``SaveStats.skipped_before`` of the next
save), and the writer records them in ``.pitstop/directory.json`` (``"skipped"``) after its
next commit, where ``pitstop ls`` shows them. Recording is informational: it never fails a
save or a writer.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger("pitstop")

#: seconds between two summaries of further skips
WARN_EVERY_S = 60.0
#: steps listed in directory.json (the newest ones), and kept in memory
RECORDED_STEPS = 20
KEPT_STEPS = 1000
REASON = "previous save still persisting"
IDENTITY = "directory.json"



def update_record(storage: Any, what: str, change: Callable[[dict[str, Any]], None]) -> bool:
    """Read ``.pitstop/directory.json``, let ``change`` edit it, write it back; False when it
    was not written. Informational records only: never raises, a failure is logged."""
    try:
        raw = storage.read_meta(IDENTITY)
        if raw is None:
            return False
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            return False
        change(doc)
        storage.write_meta(IDENTITY, json.dumps(doc).encode())
        return True
    except Exception as e:  # noqa: BLE001 - informational: never a save's failure
        log.warning("pitstop: could not record %s in %s/.pitstop/%s: %s", what,
                    getattr(storage, "location", "?"), IDENTITY, e)
        return False

class SkippedSaves:
    """This manager's busy skips: the count, the newest steps, what was said and recorded."""

    def __init__(self) -> None:
        self.count = 0
        self.steps: deque[int] = deque(maxlen=KEPT_STEPS)
        #: skips since the last save that took a snapshot (its SaveStats.skipped_before)
        self.since_save = 0
        self._lock = threading.Lock()
        self._unsaid: list[int] = []
        self._unsaid_count = 0
        self._last_warn: float | None = None
        self._recorded = 0
        #: what directory.json recorded before this manager's first skip (other runs')
        self._base: tuple[int, list[int]] | None = None

    def note(self, step: int, where: str, *, world: bool = False) -> None:
        """One periodic save of ``step`` skipped: counted, and said (rate-limited)."""
        now = time.monotonic()
        with self._lock:
            self.count += 1
            self.since_save += 1
            self.steps.append(step)
            if self._last_warn is None:
                self._last_warn = now
                first = True
            else:
                first = False
                self._unsaid.append(step)
                self._unsaid_count += 1
                if now - self._last_warn < WARN_EVERY_S:
                    return
                self._last_warn = now
        if first:
            ranks = " on at least one rank, so every rank skips it" if world else ""
            log.warning(
                "pitstop: step %d not saved in %s: the previous save was still persisting%s "
                "(on_busy='skip', the default, "
                "drops a periodic save that comes due meanwhile, so training never waits). "
                "Saves come due faster than they persist: save less often, or pass "
                "on_busy='wait' to wait for the previous save instead. Further skips are "
                "summed up at most every %g s; mgr.skipped_saves counts them and `pitstop "
                "ls` lists them.", step, where, ranks, WARN_EVERY_S)
        else:
            self._say(where)

    def _say(self, where: str) -> None:
        with self._lock:
            steps, n = self._unsaid, self._unsaid_count
            self._unsaid, self._unsaid_count = [], 0
        if n:
            log.warning("pitstop: %d more periodic save%s skipped in %s (%s; on_busy='skip'), "
                        "%d in all: steps %s", n, "s" * (n != 1), where, REASON, self.count,
                        _steps_text(steps))

    def closing(self, where: str) -> None:
        """At close: the skips not summed up yet."""
        self._say(where)

    def saved(self) -> int:
        """A save took its snapshot: the skips before it (reset for the next one)."""
        with self._lock:
            n, self.since_save = self.since_save, 0
        return n

    def record(self, storage: Any) -> None:
        """Record this manager's skips in ``directory.json`` when there are new ones (with
        those earlier writers recorded). Never raises: a failure is logged."""
        with self._lock:
            if self.count == self._recorded:
                return
            count, steps = self.count, list(self.steps)[-RECORDED_STEPS:]

        def change(doc: dict[str, Any]) -> None:
            if self._base is None:
                old = doc.get("skipped")
                if isinstance(old, dict) and isinstance(old.get("count"), int) and \
                        isinstance(old.get("steps"), list):
                    self._base = (old["count"], [s for s in old["steps"] if isinstance(s, int)])
                else:
                    self._base = (0, [])
            base_n, base_steps = self._base
            doc["skipped"] = {"count": base_n + count, "reason": REASON,
                              "steps": (base_steps + steps)[-RECORDED_STEPS:],
                              "last_unix": time.time()}

        if not update_record(storage, "the skipped saves", change):
            return
        with self._lock:
            self._recorded = max(self._recorded, count)


def _steps_text(steps: list[int], most: int = 10) -> str:
    if len(steps) <= most:
        return ", ".join(map(str, steps))
    return ", ".join(map(str, steps[:most // 2])) + ", ..., " + \
        ", ".join(map(str, steps[-(most // 2):]))


def ls_line(doc: Any) -> str | None:
    """The line ``pitstop ls`` prints for a ``directory.json`` that records skipped saves."""
    rec = doc.get("skipped") if isinstance(doc, dict) else None
    if not isinstance(rec, dict) or not isinstance(rec.get("count"), int) or rec["count"] < 1:
        return None
    n = rec["count"]
    steps = [s for s in rec.get("steps") or [] if isinstance(s, int)]
    shown = f": steps {_steps_text(steps)}" if steps else ""
    if steps and len(steps) < n:
        shown += f" (the newest {len(steps)})"
    return (f"{n} periodic save{'s' * (n != 1)} skipped ({REASON}){shown}; on_busy='wait' "
            "makes them wait instead")
