"""A real S3 server for tests: moto's standalone server in a subprocess, and a small TCP
proxy that can cut or stall the connections between a client and it.

Used by tests/core/storage/test_storage_s3.py and tests/cli/test_cli_s3.py (as s3fs's own tests do:
a real HTTP server on 127.0.0.1, never mocked calls). Nothing here imports pitstop.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

#: what tests set for botocore's default credential chain (moto accepts any)
TEST_ENV = {"AWS_ACCESS_KEY_ID": "pitstop-test", "AWS_SECRET_ACCESS_KEY": "pitstop-test",
            "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MotoServer:
    """``python -m moto.server`` on a free port of 127.0.0.1, stopped by :meth:`stop`."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        # the server logs every request to stderr: a file, never a pipe nobody reads (a full
        # pipe would block the server)
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=self.log,
            env=dict(os.environ, **TEST_ENV))
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"moto server exited: {self.log.read()[-2000:]!r}")
            try:
                with urllib.request.urlopen(self.endpoint + "/", timeout=1):
                    break
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("moto server did not answer within 60 s") from None
                time.sleep(0.1)

    def reset(self) -> None:
        """Forget every bucket and object (moto's reset endpoint)."""
        req = urllib.request.Request(self.endpoint + "/moto-api/reset", method="POST")
        with urllib.request.urlopen(req, timeout=10):
            pass

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


class Proxy:
    """A TCP proxy from a free port of 127.0.0.1 to ``target_port``.

    ``mode``: "pass" forwards everything; "cut" closes a connection once ``limit`` more bytes
    went from client to server (counted from when the mode was set, across connections), and
    every connection after it; "cut1" cuts that one connection only, then passes everything;
    "stall" stops forwarding (in both directions) at that point and keeps the connection
    open, so the client waits for an answer that never comes (as do later connections).
    """

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = int(self.sock.getsockname()[1])
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.mode = "pass"
        self.limit = 0
        self.sent = 0          # client -> server bytes since the mode was set
        self.tripped = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def set(self, mode: str, limit: int = 0) -> None:
        with self._lock:
            self.mode, self.limit, self.sent = mode, limit, 0
            self.tripped.clear()
        if mode == "pass":
            self.drop_all()

    def drop_all(self) -> None:
        """Close every open connection (stalled ones too)."""
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            with contextlib.suppress(OSError):
                c.close()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.close()
        self.drop_all()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        stalled = False
        try:
            while not self._closed:
                try:
                    ready, _, _ = select.select([client, upstream], [], [], 0.2)
                except (OSError, ValueError):
                    return
                if stalled:
                    continue  # hold the connection open, forward nothing
                for src in ready:
                    try:
                        data = src.recv(1 << 16)
                    except OSError:
                        return
                    if not data:
                        return
                    if src is client:
                        with self._lock:
                            mode, left = self.mode, self.limit - self.sent
                            if mode != "pass":
                                self.sent += len(data)
                        if mode != "pass" and left <= len(data):
                            self.tripped.set()
                            if mode == "cut1":
                                with self._lock:
                                    self.mode = "pass"
                            if mode in ("cut", "cut1"):
                                with contextlib.suppress(OSError):
                                    upstream.sendall(data[:max(left, 0)])
                                return
                            stalled = True
                            break
                        upstream.sendall(data)
                    else:
                        client.sendall(data)
        except OSError:
            return
        finally:
            if not stalled or self._closed:
                for s in (client, upstream):
                    with contextlib.suppress(OSError):
                        s.close()


@contextlib.contextmanager
def moto_server() -> Iterator[MotoServer]:
    server = MotoServer()
    try:
        yield server
    finally:
        server.stop()


# ---------------------------------------------------------------------- pytest fixtures
# (imported by the test modules that use them; one server for the whole pytest session,
# emptied after each module, as if each module had its own)

#: the session's server, started by the first module that asks for one
_shared: MotoServer | None = None


def _session_server(config: pytest.Config) -> MotoServer:
    global _shared
    if _shared is None or _shared.proc.poll() is not None:
        _shared = MotoServer()
        config.add_cleanup(_shared.stop)
    return _shared

def s3_client(endpoint: str) -> Any:
    """A plain boto3 client of the test server, for setting up and looking behind pitstop."""
    import boto3
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id="pitstop-test", aws_secret_access_key="pitstop-test")


@pytest.fixture(scope="module")
def moto(request: pytest.FixtureRequest) -> Iterator[MotoServer]:
    """The session's S3 server (moto's start-up is seconds of imports), empty for each
    module: every bucket and object of the module before is gone."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    server = _session_server(request.config)
    server.reset()
    yield server
    if server.proc.poll() is None:
        server.reset()


@pytest.fixture
def s3env(moto: MotoServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> MotoServer:
    """The standard AWS environment pointing at the test server, and nothing from this
    machine's own AWS configuration (no ~/.aws files, no instance metadata)."""
    for k in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3",
              "AWS_SECURITY_TOKEN", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"):
        monkeypatch.delenv(k, raising=False)
    for k, v in TEST_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.endpoint)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return moto


@pytest.fixture
def bucket(s3env: MotoServer) -> str:
    """A new, empty bucket on the test server."""
    name = f"pitstop-{uuid.uuid4().hex[:12]}"
    s3_client(s3env.endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="module")
def proxy_server(moto: MotoServer) -> Iterator[Proxy]:
    p = Proxy(moto.port)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def proxy(proxy_server: Proxy) -> Iterator[Proxy]:
    """The proxy to the test server, forwarding everything when the test starts and ends."""
    proxy_server.set("pass")
    yield proxy_server
    proxy_server.set("pass")
