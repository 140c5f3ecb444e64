"""A fake cloud metadata server that answers as GCE's, AWS's (IMDSv2) and Azure's do, for
testing a job's preemption handling on one machine (pitstop's own tests use it).

::

    from pitstop.testing.metadata import FakeMetadata

    with FakeMetadata() as fake:            # http://127.0.0.1:<port>, in a thread
        env = {**os.environ, **fake.env()}  # PITSTOP_GCE_METADATA=... for the job
        job = subprocess.Popen([...], env=env)
        ...
        deadline = fake.announce("aws", in_seconds=5)   # the spot interruption notice

Or from a shell: ``python -m pitstop.testing.metadata --announce gce --after 10`` prints
the environment to give the job, then announces a GCE preemption 10 s later.

Each service is as strict as the real one: GCE answers 403 without ``Metadata-Flavor:
Google``, AWS 401 without an IMDSv2 token and 400 for a token request without its TTL
header, Azure 400 without ``Metadata: true``.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SOURCES = ("gce", "aws", "azure")
ENV = {"gce": "PITSTOP_GCE_METADATA", "aws": "PITSTOP_AWS_METADATA",
       "azure": "PITSTOP_AZURE_METADATA"}
GCE_PATH = "/computeMetadata/v1/instance/preempted"
AWS_TOKEN = "/latest/api/token"
AWS_PATH = "/latest/meta-data/spot/instance-action"
AZURE_PATH = "/metadata/scheduledevents"
#: GCE gives no deadline: the machine is stopped about this long after the notice
GCE_NOTICE_S = 30.0


class FakeMetadata:
    """The fake server. ``services``: those it answers for (others get 404, as a real
    machine of another cloud). ``delay_s``: every answer waits this long first (a hanging
    service). ``requests`` lists each request as (source, method, path, headers, time)."""

    def __init__(self, services: tuple[str, ...] = SOURCES, delay_s: float = 0.0) -> None:
        self.services = tuple(services)
        self.delay_s = delay_s
        self.requests: list[tuple[str, str, str, dict[str, str], float]] = []
        self._lock = threading.Lock()
        #: source -> what is announced (None: nothing)
        self._notices: dict[str, Any] = {}
        self._tokens: set[str] = set()
        self._closing = threading.Event()
        self._incarnation = 1
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        name="fake-metadata", daemon=True)

    # ------------------------------------------------------------------ life
    def start(self) -> FakeMetadata:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FakeMetadata:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def env(self) -> dict[str, str]:
        """The environment that points pitstop at this server for its services."""
        return {ENV[s]: self.url for s in self.services}

    # ------------------------------------------------------------------ notices
    def announce(self, source: str, in_seconds: float | None = None,
                 action: str = "terminate") -> float:
        """Announce a preemption on ``source``; returns its deadline (unix seconds). GCE:
        30 s from now (GCE publishes no time); AWS: ``in_seconds`` (default 120) from now,
        to the second as AWS gives it; Azure: ``NotBefore`` ``in_seconds`` (default 30)."""
        if source not in self.services:
            raise ValueError(f"this fake answers for {self.services}, not {source!r}")
        now = time.time()
        with self._lock:
            if source == "gce":
                self._notices["gce"] = True
                return now + GCE_NOTICE_S
            deadline = float(int(now + (in_seconds if in_seconds is not None else
                                        120.0 if source == "aws" else 30.0)))
            if source == "aws":
                self._notices["aws"] = {"action": action, "time": time.strftime(
                    "%Y-%m-%dT%H:%M:%SZ", time.gmtime(deadline))}
            else:
                self._incarnation += 1
                self._notices["azure"] = {
                    "EventId": f"602d9444-d2cd-49c7-8624-{self._incarnation:012d}",
                    "EventType": "Preempt", "ResourceType": "VirtualMachine",
                    "Resources": ["pitstop-test-vm"], "EventStatus": "Scheduled",
                    "NotBefore": formatdate(deadline, usegmt=True),
                    "Description": "Virtual machine is being preempted.",
                    "EventSource": "Platform", "DurationInSeconds": -1}
            return deadline

    def withdraw(self, source: str) -> None:
        """The notice of ``source`` is gone (the service answers "nothing" again)."""
        with self._lock:
            self._notices.pop(source, None)
            if source == "azure":
                self._incarnation += 1

    def count(self, source: str, path: str | None = None) -> int:
        """Requests made to ``source`` (only to ``path``, when given)."""
        with self._lock:
            return sum(1 for r in self.requests if r[0] == source and
                       (path is None or r[2].split("?")[0] == path))

    # ------------------------------------------------------------------ answers
    def _answer(self, method: str, path: str, headers: dict[str, str]
                ) -> tuple[int, dict[str, str], bytes]:
        bare = path.split("?")[0]
        source = ("gce" if bare.startswith("/computeMetadata") else
                  "aws" if bare.startswith("/latest") else
                  "azure" if bare.startswith("/metadata") else "")
        with self._lock:
            self.requests.append((source, method, path, headers, time.time()))
        if self.delay_s:
            self._closing.wait(self.delay_s)
        if source not in self.services:
            return 404, {}, b"not found"
        with self._lock:
            if source == "gce":
                return self._gce(method, bare, headers)
            if source == "aws":
                return self._aws(method, bare, headers)
            return self._azure(method, path, headers)

    def _gce(self, method: str, path: str, headers: dict[str, str]
             ) -> tuple[int, dict[str, str], bytes]:
        flavor = {"Metadata-Flavor": "Google"}
        if headers.get("metadata-flavor") != "Google":
            return 403, flavor, (b"Your client does not have permission to get URL "
                                 b"from this server. Missing Metadata-Flavor:Google header.")
        if method != "GET" or path != GCE_PATH:
            return 404, flavor, b"not found"
        return 200, {**flavor, "Content-Type": "application/text"}, \
            b"TRUE" if self._notices.get("gce") else b"FALSE"

    def _aws(self, method: str, path: str, headers: dict[str, str]
             ) -> tuple[int, dict[str, str], bytes]:
        if path == AWS_TOKEN:
            if method != "PUT":
                return 405, {}, b""
            ttl = headers.get("x-aws-ec2-metadata-token-ttl-seconds", "")
            if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return 400, {}, b""
            token = os.urandom(16).hex()
            self._tokens.add(token)
            return 200, {"X-Aws-Ec2-Metadata-Token-Ttl-Seconds": ttl}, token.encode()
        if headers.get("x-aws-ec2-metadata-token") not in self._tokens:
            return 401, {}, b""
        if method != "GET" or path != AWS_PATH or not self._notices.get("aws"):
            return 404, {"Content-Type": "text/html"}, b"<html>404 - Not Found</html>"
        return 200, {"Content-Type": "text/plain"}, json.dumps(self._notices["aws"]).encode()

    def _azure(self, method: str, path: str, headers: dict[str, str]
               ) -> tuple[int, dict[str, str], bytes]:
        if headers.get("metadata") != "true":
            return 400, {}, json.dumps({"error": "Bad request. Required metadata header "
                                                 "not specified"}).encode()
        if method != "GET" or not path.startswith(AZURE_PATH + "?") or \
                "api-version=" not in path:
            return 400, {}, json.dumps({"error": "Bad request. api-version was not "
                                                 "specified"}).encode()
        event = self._notices.get("azure")
        doc = {"DocumentIncarnation": self._incarnation, "Events": [event] if event else []}
        return 200, {"Content-Type": "application/json"}, json.dumps(doc).encode()


def _handler(fake: FakeMetadata) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            if n:
                self.rfile.read(n)
            headers = {k.lower(): v for k, v in self.headers.items()}
            status, extra, body = fake._answer(self.command, self.path, headers)
            try:
                self.send_response(status)
                for k, v in extra.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except OSError:
                pass  # the client gave up (its timeout): nothing to answer

        do_GET = do_PUT = do_POST = _serve

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    return Handler


def main(argv: list[str] | None = None) -> None:
    """Serve until interrupted; print the environment for the job; announce later."""
    ap = argparse.ArgumentParser(prog="python -m pitstop.testing.metadata",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--announce", choices=SOURCES, help="the source to announce on")
    ap.add_argument("--after", type=float, default=10.0,
                    help="seconds from now to announce (default 10)")
    ap.add_argument("--deadline-in", type=float, default=None,
                    help="AWS/Azure: seconds from the notice to the deadline")
    args = ap.parse_args(argv)
    if args.after < 0 or (args.deadline_in is not None and args.deadline_in < 0):
        ap.error("--after and --deadline-in are seconds from now: 0 or more")
    with FakeMetadata() as fake:
        for k, v in fake.env().items():
            print(f"export {k}={v}", flush=True)
        try:
            if args.announce:
                time.sleep(args.after)
                deadline = fake.announce(args.announce, args.deadline_in)
                print(f"announced a {args.announce} preemption; deadline "
                      f"{time.strftime('%H:%M:%S', time.localtime(deadline))}", flush=True)
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
