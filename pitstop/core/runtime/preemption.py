"""Cloud preemption notices: GCE's ``instance/preempted``, AWS's spot ``instance-action``
(IMDSv2) and Azure's Scheduled Events, watched off the training thread.

A :class:`Watcher` is one daemon thread per manager. It polls each source at most once a
second with 0.5 s timeouts (an error or a timeout is "no notice", logged once at DEBUG),
and on a new notice tells the manager's :class:`~pitstop.core.runtime.signals.SignalSaver`,
which marks a save pending as SIGUSR1 does (SIGTERM with ``preemption_exit``): the manager
saves at its next step boundary. The deadline logic (:func:`plan`, :func:`fastest_path`,
:func:`report`) says whether the save fits before the notice's deadline, takes the fastest
path when it does not, and tells the user (one log line, ``.pitstop/directory.json``).
Nothing here knows a framework; nothing here runs on the training thread but the report.
"""

from __future__ import annotations

import contextlib
import email.utils
import http.client
import json
import logging
import os
import socket
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from pitstop.core.save.skips import update_record

log = logging.getLogger("pitstop")

#: each source's endpoint: (environment variable, default), as the real services answer
ENDPOINTS = {
    "gce": ("PITSTOP_GCE_METADATA", "http://metadata.google.internal"),
    "aws": ("PITSTOP_AWS_METADATA", "http://169.254.169.254"),
    "azure": ("PITSTOP_AZURE_METADATA", "http://169.254.169.254"),
}
#: seconds a request may take (connect, and each read) before it counts as "no notice"
TIMEOUT_S = 0.5
#: preemption="auto" that found no service asks again this often
AUTO_RETRY_S = 30.0
#: the least seconds between two polls of one source
INTERVAL_S = 1.0
#: GCE gives no time: the machine is stopped about this long after the notice
GCE_NOTICE_S = 30.0
#: notices kept in directory.json (the newest)
RECORDED = 20
#: the key of the checkpoint's user metadata that says which notice it was saved for
METADATA_KEY = "preemption"


@dataclass(frozen=True)
class Notice:
    """One notice: where from, when seen, the deadline (None: none given), and what tells a
    later notice of the same source from this one polled again."""

    source: str
    noticed_unix: float
    deadline_unix: float | None
    key: str = ""

    def metadata(self) -> dict[str, Any]:
        """The checkpoint's ``user_metadata["preemption"]``."""
        return {"source": self.source, "noticed_unix": self.noticed_unix,
                "deadline_unix": self.deadline_unix}


class PollError(Exception):
    """A source answered, but not as the service does (counted as no notice)."""


class _DeadlineSocket(socket.socket):
    """A socket whose reads all end by one deadline: a server that trickles its answer a
    byte at a time cannot hold a poll past it (a timeout per read would let it)."""

    deadline = 0.0

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no whole answer within {TIMEOUT_S} s")
        self.settimeout(left)
        return super().recv_into(buffer, nbytes, flags)


class _Connection(http.client.HTTPConnection):
    """HTTP to a metadata service (plain HTTP, link-local or internal: never a proxy), every
    request over within TIMEOUT_S from its connect to its last byte."""

    def connect(self) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        plain = socket.create_connection((self.host, self.port), TIMEOUT_S)
        sock = _DeadlineSocket(plain.family, plain.type, plain.proto, fileno=plain.detach())
        sock.deadline = deadline
        self.sock = sock


def _request(method: str, url: str, headers: dict[str, str], data: bytes | None = None
             ) -> tuple[int, Any, bytes]:
    """(status, headers, body) of one request; an HTTP error status is an answer too."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise PollError(f"{url}: a metadata endpoint is a plain http:// URL")
    conn = _Connection(parts.hostname, parts.port or 80, timeout=TIMEOUT_S)
    try:
        conn.request(method, (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                     body=data, headers=headers)
        r = conn.getresponse()
        return r.status, r.headers, r.read(1 << 16)
    finally:
        conn.close()


def endpoint(source: str) -> str:
    """The base URL of ``source``'s metadata service (its environment variable, or the
    real one)."""
    var, default = ENDPOINTS[source]
    return (os.environ.get(var) or default).rstrip("/")


class Gce:
    """GCE: ``GET /computeMetadata/v1/instance/preempted`` (``Metadata-Flavor: Google``)
    answers TRUE once the instance is being preempted; the deadline is 30 s after."""

    name = "gce"
    path = "/computeMetadata/v1/instance/preempted"

    def __init__(self) -> None:
        self.base = endpoint(self.name)

    def _get(self) -> tuple[int, Any, bytes]:
        return _request("GET", self.base + self.path, {"Metadata-Flavor": "Google"})

    def detect(self) -> bool:
        status, headers, _ = self._get()
        return status == 200 and headers.get("Metadata-Flavor") == "Google"

    def poll(self) -> Notice | None:
        status, _, body = self._get()
        if status != 200:
            raise PollError(f"HTTP {status} from {self.base}{self.path}")
        if body.strip().upper() != b"TRUE":
            return None
        now = time.time()
        return Notice(self.name, now, now + GCE_NOTICE_S, "TRUE")


class Aws:
    """AWS IMDSv2: a session token (``PUT /latest/api/token``), then ``GET
    /latest/meta-data/spot/instance-action``: 404 until an interruption is scheduled, then
    JSON with its action and time (the deadline)."""

    name = "aws"
    path = "/latest/meta-data/spot/instance-action"
    ttl_s = 21600

    def __init__(self) -> None:
        self.base = endpoint(self.name)
        self._token: tuple[str, float] | None = None

    def _get_token(self) -> str:
        if self._token is not None and time.monotonic() < self._token[1]:
            return self._token[0]
        status, _, body = _request("PUT", self.base + "/latest/api/token",
                                   {"X-aws-ec2-metadata-token-ttl-seconds": str(self.ttl_s)},
                                   data=b"")
        if status != 200 or not body.strip():
            raise PollError(f"HTTP {status} for an IMDSv2 token from {self.base}")
        token = body.decode("ascii", "replace").strip()
        self._token = (token, time.monotonic() + self.ttl_s - 60)
        return token

    def detect(self) -> bool:
        try:
            self._get_token()
        except PollError:
            return False
        return True

    def poll(self) -> Notice | None:
        status, _, body = _request("GET", self.base + self.path,
                                   {"X-aws-ec2-metadata-token": self._get_token()})
        if status == 404:
            return None
        if status == 401:
            self._token = None  # expired: a new one next time
        if status != 200:
            raise PollError(f"HTTP {status} from {self.base}{self.path}")
        try:
            doc = json.loads(body)
            action, when = doc["action"], doc["time"]
            deadline = datetime.fromisoformat(str(when).replace("Z", "+00:00"))
        except (ValueError, KeyError, TypeError) as e:
            raise PollError(f"{self.base}{self.path} answered {body[:200]!r}: {e}") from None
        if deadline.tzinfo is None:
            deadline = deadline.replace(tzinfo=timezone.utc)
        return Notice(self.name, time.time(), deadline.timestamp(), f"{action} {when}")


class Azure:
    """Azure Scheduled Events: ``GET /metadata/scheduledevents?api-version=2020-07-01``
    (``Metadata: true``) lists events; a ``Preempt`` one is the notice, its ``NotBefore``
    the deadline (empty once the event started)."""

    name = "azure"
    path = "/metadata/scheduledevents?api-version=2020-07-01"

    def __init__(self) -> None:
        self.base = endpoint(self.name)

    def _events(self) -> list[Any]:
        status, _, body = _request("GET", self.base + self.path, {"Metadata": "true"})
        if status != 200:
            raise PollError(f"HTTP {status} from {self.base}{self.path}")
        try:
            doc = json.loads(body)
        except ValueError:
            doc = None
        events = doc.get("Events") if isinstance(doc, dict) else None
        if not isinstance(events, list):
            raise PollError(f"{self.base}{self.path} answered {body[:200]!r}, not events")
        return events

    def detect(self) -> bool:
        try:
            self._events()
        except PollError:
            return False
        return True

    def poll(self) -> Notice | None:
        for event in self._events():
            if isinstance(event, dict) and event.get("EventType") == "Preempt":
                now = time.time()
                deadline = None
                if not event.get("NotBefore"):
                    deadline = now  # no NotBefore: the event has started, the machine goes now
                with contextlib.suppress(TypeError, ValueError, IndexError):
                    deadline = email.utils.parsedate_to_datetime(
                        str(event.get("NotBefore") or "")).timestamp()
                return Notice(self.name, now, deadline, str(event.get("EventId")))
        return None


POLLERS: dict[str, Callable[[], Any]] = {"gce": Gce, "aws": Aws, "azure": Azure}


class Watcher:
    """The daemon thread that polls the sources (detected first for "auto") and hands each
    new notice to ``on_notice``. It never runs in a forked child, and stops with
    :meth:`stop` (the manager's close or release)."""

    def __init__(self, sources: tuple[str, ...], on_notice: Callable[[Notice], None]) -> None:
        self.sources = sources
        self.on_notice = on_notice
        self.owner_pid = os.getpid()
        self._stop = threading.Event()
        self._said: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="pitstop-preemption",
                                        daemon=True)
        _watchers.add(self)

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling; waits a moment for a poll under way (it times out in 0.5 s)."""
        self._stop.set()
        if os.getpid() == self.owner_pid and self._thread.is_alive() and \
                threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * TIMEOUT_S + 0.5)

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def _live(self) -> bool:
        return not self._stop.is_set() and os.getpid() == self.owner_pid

    def _pollers(self, quiet: bool = False) -> list[Any]:
        if "auto" not in self.sources:
            return [POLLERS[s]() for s in self.sources]
        found = [POLLERS[s]() for s in self.sources if s != "auto"]
        for name in ("gce", "aws", "azure"):
            if not self._live():
                return []
            if any(p.name == name for p in found):
                continue
            poller = POLLERS[name]()
            try:
                if poller.detect():
                    found.append(poller)
            except Exception as e:  # noqa: BLE001 - not this service
                log.debug("pitstop: preemption='auto': no %s metadata service at %s (%s)",
                          name, poller.base, e)
        if not found:
            if quiet:
                return found
            log.info("pitstop: preemption='auto' found no metadata service answering here "
                     "(GCE, AWS, Azure): none is watched; it asks again every %.0f s", AUTO_RETRY_S)
        else:
            log.info("pitstop: watching preemption notices from %s",
                     ", ".join(p.name for p in found))
        return found

    def _run(self) -> None:
        pollers = self._pollers()
        while not pollers and "auto" in self.sources and self._live():
            # a metadata service may come up after the job (or answer late): look again
            if self._stop.wait(AUTO_RETRY_S):
                return
            pollers = self._pollers(quiet=True)
        due = {p.name: 0.0 for p in pollers}
        seen: dict[str, str] = {}
        while pollers and self._live():
            for poller in pollers:
                name = poller.name
                if not self._live():
                    return
                if time.monotonic() < due[name]:
                    continue
                due[name] = time.monotonic() + INTERVAL_S  # from the start of this poll
                try:
                    notice = poller.poll()
                except Exception as e:  # noqa: BLE001 - any failure is "no notice"
                    if name not in self._said:
                        self._said.add(name)
                        log.debug("pitstop: no preemption notice from %s (%s); said once",
                                  name, e)
                    continue
                if notice is None:
                    seen.pop(name, None)  # withdrawn: a new notice is a later one
                elif seen.get(name) != notice.key and self._live():
                    seen[name] = notice.key
                    try:
                        self.on_notice(notice)
                    except Exception:  # noqa: BLE001 - the watcher must go on
                        log.exception("pitstop: acting on the preemption notice from %s "
                                      "failed", name)
            self._stop.wait(max(0.02, min(due.values()) - time.monotonic()))


_watchers: weakref.WeakSet[Watcher] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for watcher in list(_watchers):
        watcher._stop.set()  # (its thread is not in the child)


os.register_at_fork(after_in_child=_after_fork_in_child)


# ====================================================================== the deadline
def expected_persist_s(stats: list[Any]) -> float | None:
    """The persist time of the last committed save (None: no save committed yet)."""
    for s in reversed(stats):
        if getattr(s, "committed", False) and s.persist_s > 0:
            return float(s.persist_s)
    return None


def plan(notice: Notice, stats: list[Any]) -> tuple[float | None, bool | None]:
    """(expected persist seconds, whether the save fits before the deadline); None where it
    cannot be told (no deadline, or no save measured yet and the deadline still ahead)."""
    expected = expected_persist_s(stats)
    if notice.deadline_unix is None:
        return expected, None
    left = notice.deadline_unix - time.time()
    if left <= 0:
        return expected, False
    if expected is None:
        return None, None
    return expected, expected <= left


@contextlib.contextmanager
def fastest_path(engine: Any) -> Iterator[None]:
    """The save made inside persists by the fastest path: the saves before it drained first,
    then no compression and no incremental references (the memory tier: the job's ``fast``),
    and the save persisted before the engine's own settings come back."""
    engine.drain()
    compression, incremental = engine.compression, engine.incremental
    engine.compression, engine.incremental = None, False
    try:
        yield
    finally:
        engine.drain()
        engine.compression, engine.incremental = compression, incremental
        if incremental:
            engine.forget_previous()  # the next save writes every array again


def _clock(t: float, tenths: bool = False) -> str:
    text = time.strftime("%H:%M:%S", time.localtime(t))
    return f"{text}.{int(t * 10) % 10}" if tenths else text


def outcome_line(notice: Notice, step: int, durable_unix: float | None,
                 error: BaseException | None = None) -> str:
    """The one line said after a notice's save (see docs/preemption.md)."""
    head = f"pitstop: preemption notice from {notice.source} at {_clock(notice.noticed_unix)}"
    if durable_unix is None:
        return f"{head}: the save of step {step} failed ({error}); nothing was saved for it"
    text = f"{head}: saved step {step}, durable at {_clock(durable_unix, True)}"
    if notice.deadline_unix is None:
        return f"{text}, no deadline given"
    margin = notice.deadline_unix - durable_unix
    if margin >= 0:
        return f"{text}, {margin:.1f} s before the deadline"
    return f"{text}, {-margin:.1f} s AFTER the deadline"


def fit_warning(notice: Notice, step: int, expected: float | None) -> str:
    """The warning said when the save is not expected to be durable before the deadline."""
    assert notice.deadline_unix is not None
    left = notice.deadline_unix - time.time()
    cost = f"a save persists in about {expected:.1f} s (the last one)" if expected is not \
        None else "the save's persist time is not known yet"
    when = f"the deadline is in {left:.1f} s" if left > 0 else \
        f"the deadline passed {-left:.1f} s ago"
    return (f"pitstop: preemption notice from {notice.source}: {when} and {cost}: step {step} "
            "may not be durable in time; saving it by the fastest path (durable storage "
            "only: no memory tier, no compression, no incremental references)")


def report(storage: Any, notice: Notice, step: int, expected: float | None,
           fits: bool | None, durable_unix: float | None, *, record: bool = True,
           say: bool = True, error: BaseException | None = None) -> None:
    """After a notice's save: the one log line (``say``), and (``record``: the writer) the
    notice appended to ``.pitstop/directory.json`` under ``"preemption"``. Never raises."""
    line = outcome_line(notice, step, durable_unix, error)
    if not say:
        pass
    elif durable_unix is None:
        log.error("%s", line)
    else:
        log.warning("%s", line)
    if record:
        record_notice(storage, {**notice.metadata(), "step": step,
                                "durable_unix": durable_unix, "expected_persist_s": expected,
                                "fits": fits})


def record_notice(storage: Any, entry: dict[str, Any]) -> None:
    """Append ``entry`` to directory.json's ``"preemption"`` list (the newest
    :data:`RECORDED` kept), the file and write path the skipped saves use. Informational:
    a failure is logged, never raised."""
    def change(doc: dict[str, Any]) -> None:
        old = doc.get(METADATA_KEY)
        kept = [e for e in old if isinstance(e, dict)] if isinstance(old, list) else []
        doc[METADATA_KEY] = (kept + [entry])[-RECORDED:]

    update_record(storage, "the preemption notice", change)


__all__ = ["Notice", "Watcher", "Gce", "Aws", "Azure", "ENDPOINTS", "TIMEOUT_S",
           "INTERVAL_S", "METADATA_KEY", "plan", "fastest_path", "report", "record_notice",
           "outcome_line", "fit_warning", "expected_persist_s"]
