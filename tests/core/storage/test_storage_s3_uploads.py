"""Unfinished multipart uploads on a real S3 server (moto's, tests/s3_server.py): the ones
no live writer owns — started late by a stalled server, or by a writer that lost its lock —
are aborted by the next writer and by ``pitstop gc``; a live writer's are never touched."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import s3_server
from s3_server import s3_client

import pitstop
from pitstop.cli import main
from pitstop.core.directory.names import step_name
from pitstop.core.storage import FsspecStorage
from pitstop.core.storage.objectstore import upload as s3_upload

#: the test server's fixtures (tests/s3_server.py), used by name
bucket, moto, s3env = s3_server.bucket, s3_server.moto, s3_server.s3env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MiB = 1 << 20
PART = 5 * MiB
BIG = 6 * MiB  # above one part: a multipart upload


def state_of(step: int) -> dict:
    return {"big": np.arange(BIG // 4, dtype=np.float32) + np.float32(step), "epoch": step}


def uploads(endpoint: str, bucket: str) -> list[str]:
    """Keys of the bucket's unfinished multipart uploads, one per upload."""
    r = s3_client(endpoint).list_multipart_uploads(Bucket=bucket)
    return sorted(u["Key"] for u in r.get("Uploads", []))


def keys(endpoint: str, bucket: str, prefix: str) -> list[str]:
    r = s3_client(endpoint).list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in r.get("Contents", []))


def wait_for(what: str, ok: Any, timeout: float = 15.0) -> Any:
    """Poll ``ok()`` until it returns a true value (a state of the server, not a time)."""
    deadline = time.monotonic() + timeout
    while True:
        got = ok()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)


def open_mgr(directory: Any, **kw: Any) -> pitstop.CheckpointManager:
    return pitstop.CheckpointManager(directory, memory_tier=False, save_on_signals=None,
                                     writer_threads=1, **kw)


# =========================================================================== a stalled server
@pytest.fixture
def own_server(s3env: s3_server.MotoServer) -> Iterator[s3_server.MotoServer]:
    """A moto server of this test's own, to SIGSTOP without stalling the other tests."""
    with s3_server.moto_server() as server:
        try:
            yield server
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)


class _ResumeOnRetry(logging.Handler):
    """SIGCONT the stopped server once the start of an upload timed out twice: both of those
    requests sit in the server's sockets and are carried out late, after it resumes."""

    def __init__(self, pid: int) -> None:
        super().__init__(logging.DEBUG)
        self.pid = pid

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) >= 3 and args[1] == "starting an upload" and args[2] >= 2:
            os.kill(self.pid, signal.SIGCONT)


def save_through_a_stall(server: s3_server.MotoServer, url: str) -> None:
    """Save step 1 while the server is stopped (SIGSTOP) just as the data object's multipart
    upload starts and resumed (SIGCONT) after two attempts at starting it timed out."""
    start = s3_upload._S3Writer._start
    stopped: list[int] = []

    async def stop_then_start(self: Any) -> None:
        if not stopped:
            stopped.append(1)
            os.kill(server.proc.pid, signal.SIGSTOP)
        await start(self)

    s3_upload._S3Writer._start = stop_then_start  # type: ignore[method-assign]
    handler = _ResumeOnRetry(server.proc.pid)
    logger = logging.getLogger("pitstop")
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    try:
        storage = FsspecStorage(url, endpoint_url=server.endpoint, part_size=PART,
                                request_timeout=1, max_attempts=4)
        with open_mgr(storage) as mgr:
            mgr.save(1, state_of(1)).wait()
            assert mgr.all_steps() == [1]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        s3_upload._S3Writer._start = start  # type: ignore[method-assign]
    assert stopped


def test_uploads_a_stalled_server_started_late_are_aborted(own_server, capsys, caplog):
    ep = own_server.endpoint
    name = f"pitstop-{os.getpid()}"
    s3_client(ep).create_bucket(Bucket=name)
    data = f"{step_name(1)}/data-000.bin"
    for prefix in ("next-writer", "gc"):
        url = f"s3://{name}/{prefix}"
        save_through_a_stall(own_server, url)
        # the committed save left the two late-started uploads of its data object behind
        def late_ones(p: str = prefix) -> list[str] | None:
            got = [k for k in uploads(ep, name) if k.startswith(p + "/")]
            return got if len(got) >= 2 else None

        late = wait_for("the late uploads", late_ones)
        assert set(late) == {f"{prefix}/{data}"}, late
        if prefix == "next-writer":
            caplog.set_level(logging.WARNING, logger="pitstop")
            with open_mgr(FsspecStorage(url, endpoint_url=ep)) as mgr:
                assert f"{data} (unfinished upload)" in caplog.text
                assert mgr.all_steps() == [1]
        else:
            opt = f"endpoint_url={ep}"
            rc, out = main(["gc", url, "-o", opt, "--dry-run"]), capsys.readouterr().out
            assert rc == 0 and f"would remove {data} (unfinished upload)" in out, out
            assert len(uploads(ep, name)) == len(late)  # a dry run aborts nothing
            rc, out = main(["gc", url, "-o", opt]), capsys.readouterr().out
            assert rc == 0 and f"removed {data} (unfinished upload)" in out, out
        assert [k for k in uploads(ep, name) if k.startswith(prefix + "/")] == []
        with open_mgr(FsspecStorage(url, endpoint_url=ep), read_only=True) as ro:
            t = state_of(0)
            assert ro.restore(t) == 1 and t["big"][0] == 1.0


# =========================================================================== a live writer
_LIVE_WRITER = textwrap.dedent("""
    import sys
    from pitstop.core.storage import FsspecStorage
    url, name = sys.argv[1], sys.argv[2]
    st = FsspecStorage(url, part_size=5 << 20)
    lease = st.lock()
    txn = st.begin(name)
    w = txn.open_write("data-000.bin")
    w.write(bytes(6 << 20))       # one part up: an unfinished multipart upload
    print("UPLOADING", flush=True)
    sys.stdin.readline()
    w.write(b"end")
    w.close()
    st.verify_held()
    txn.commit(b"{}")
    lease.release()
    print("COMMITTED", flush=True)
""")


def child(script: str, *argv: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", script, *argv], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_an_upload_of_a_live_writer_is_never_aborted(bucket, s3env, capsys):
    ep, url, name = s3env.endpoint, f"s3://{bucket}/run", step_name(1)
    proc = child(_LIVE_WRITER, url, name)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "UPLOADING", proc.stderr.read()  # type: ignore[union-attr]
        mine = [f"run/{name}/data-000.bin"]
        assert uploads(ep, bucket) == mine
        with pytest.raises(pitstop.DirectoryLockedError, match="in use by another writer"):
            open_mgr(url)
        assert main(["gc", url]) != 0
        assert "in use by another writer" in capsys.readouterr().err
        with pytest.raises(pitstop.DirectoryLockedError, match="in use by another writer"):
            FsspecStorage(url).cleanup_incomplete()
        assert uploads(ep, bucket) == mine  # still there, still the writer's
        out, err = proc.communicate("go\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "COMMITTED" in out, err
    assert uploads(ep, bucket) == []
    assert f"run/{name}/manifest.json" in keys(ep, bucket, "run/")


# =========================================================================== a writer paused
_PAUSED_WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    import pitstop
    from pitstop.core.storage import FsspecStorage
    url = sys.argv[1]
    mgr = pitstop.CheckpointManager(FsspecStorage(url, part_size=5 << 20, lock_ttl=2),
                                    memory_tier=False, save_on_signals=None, writer_threads=1)
    mgr.save(1, {"w": np.ones(4), "epoch": 1}).wait()
    def pause(step):
        print("COMMITTING", flush=True)
        sys.stdin.readline()
    mgr.hooks["before_commit"] = pause
    try:
        mgr.save(2, {"w": np.zeros((6 << 20) // 8), "epoch": 2}).wait()
        print("COMMITTED", flush=True)
    except pitstop.CheckpointError as e:
        print("REFUSED", e, flush=True)
    mgr.close()
""")


def test_a_writer_that_lost_its_lock_leaves_nothing_after_gc(bucket, s3env, capsys):
    """A writer paused (SIGSTOP) past its lock's lifetime; the next writer takes over and
    cleans; the paused writer's upload start is carried out late, after the takeover. The
    paused writer commits nothing, and gc leaves no unfinished upload."""
    ep, url = s3env.endpoint, f"s3://{bucket}/run"
    proc = child(_PAUSED_WRITER, url)
    step2 = f"run/{step_name(2)}/"
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "COMMITTING", proc.stderr.read()  # type: ignore[union-attr]
        os.kill(proc.pid, signal.SIGSTOP)  # its lock is no longer renewed

        def take_over() -> pitstop.CheckpointManager | None:
            try:
                return open_mgr(url)
            except pitstop.DirectoryLockedError:
                return None

        nxt = wait_for("the lock's takeover", take_over)
        try:
            # the next writer removed the paused writer's save (marker and objects)
            assert [k for k in keys(ep, bucket, "run/") if k.startswith(step2)
                    or ".tmp-" in k] == []
            # ... whose upload start the server now carries out late, with a part of it
            late = f"{step2}data-001.bin"
            s3 = s3_client(ep)
            up = s3.create_multipart_upload(Bucket=bucket, Key=late)["UploadId"]
            s3.upload_part(Bucket=bucket, Key=late, UploadId=up, PartNumber=1,
                           Body=bytes(PART))
            os.kill(proc.pid, signal.SIGCONT)
            out, err = proc.communicate("go\n", timeout=60)
            assert "REFUSED" in out and "another writer" in out, out + err
            assert nxt.all_steps() == [1]
            nxt.save(3, {"w": np.ones(4), "epoch": 3}).wait()
            assert uploads(ep, bucket) == [late]  # the live writer is not the cleaner
        finally:
            nxt.close()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
    assert not [k for k in keys(ep, bucket, step2) if k.endswith("manifest.json")]
    rc, out = main(["gc", url]), capsys.readouterr().out
    assert rc == 0 and f"removed {step_name(2)}/data-001.bin (unfinished upload)" in out, out
    assert uploads(ep, bucket) == []
    assert keys(ep, bucket, step2) == []
    with open_mgr(url, read_only=True) as ro:
        assert ro.all_steps() == [1, 3]
    assert "run/.pitstop/lock" not in keys(ep, bucket, "run/")  # gc released the lock
