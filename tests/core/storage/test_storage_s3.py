"""Checkpoints on S3, against a real S3 server (moto's, in a subprocess on 127.0.0.1) and,
for broken networks, a TCP proxy in front of it that cuts or stalls connections.

What must hold on an object store as on a local disk: save / restore / listing / retention
/ verification through ``CheckpointManager("s3://bucket/prefix")``; a save that fails part
way (a cut connection, a stalled one, the writer SIGKILLed mid-upload) leaves nothing that is
listed or restored, the previous checkpoint stays the newest, and the next save succeeds; a
stalled transfer ends with an error naming the object; the memory tier restores a killed
job's newest snapshot without reading the network; damaged objects give the same errors as
local files; one writer per prefix.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import warnings
from typing import Any

import numpy as np
import pytest
import s3_server
from s3_server import s3_client

import pitstop
from pitstop.core.directory.names import step_name
from pitstop.core.storage import FsspecStorage, open_storage
from pitstop.core.storage.objectstore import ObjectStoreError

#: the test server's fixtures (tests/s3_server.py), used by name
bucket, moto, proxy, proxy_server, s3env = (s3_server.bucket, s3_server.moto, s3_server.proxy,
                                            s3_server.proxy_server, s3_server.s3env)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MiB = 1 << 20
PART = 5 * MiB  # S3's smallest part: files above it go up as multipart uploads


def state_of(step: int, big: int = 0) -> dict:
    """A small state (and, with ``big``, one float32 array of ``big`` bytes)."""
    rng = np.random.default_rng(step)
    s = {"model": {"w": rng.standard_normal((64, 32)).astype("f4"),
                   "b": rng.standard_normal(32)},
         "opt": [rng.integers(0, 1 << 40, 300), np.float32(step / 3)],
         "epoch": step}
    if big:
        s["big"] = np.arange(big // 4, dtype=np.float32) + np.float32(step)
    return s


def blank(big: int = 0) -> dict:
    s = state_of(0, big)
    for a in (s["model"]["w"], s["model"]["b"], s["opt"][0]):
        a[...] = 0
    if big:
        s["big"][...] = -1
    s["opt"][1] = np.float32(-1)
    s["epoch"] = -1
    return s


def assert_state_is(got: dict, step: int, big: int = 0) -> None:
    want = state_of(step, big)
    assert got["epoch"] == step, f"epoch {got['epoch']}, not step {step}"
    np.testing.assert_array_equal(got["model"]["w"], want["model"]["w"])
    np.testing.assert_array_equal(got["model"]["b"], want["model"]["b"])
    np.testing.assert_array_equal(got["opt"][0], want["opt"][0])
    assert got["opt"][1] == want["opt"][1]
    if big:
        assert got["big"].tobytes() == want["big"].tobytes(), f"big array is not step {step}"


def open_mgr(directory, **kw) -> pitstop.CheckpointManager:
    kw.setdefault("memory_tier", False)
    kw.setdefault("save_on_signals", None)
    return pitstop.CheckpointManager(directory, **kw)


def keys(endpoint: str, bucket: str, prefix: str = "") -> list[str]:
    """Every object of the bucket under ``prefix`` (behind pitstop's back)."""
    r = s3_client(endpoint).list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in r.get("Contents", []))


def uploads(endpoint: str, bucket: str) -> list[str]:
    """Keys of unfinished multipart uploads (they cost storage until aborted)."""
    r = s3_client(endpoint).list_multipart_uploads(Bucket=bucket)
    return sorted(u["Key"] for u in r.get("Uploads", []))


# =========================================================================== the basics
def test_save_restore_list_retention_verify_on_s3(bucket, s3env):
    url = f"s3://{bucket}/run"
    with open_mgr(url, keep_last=2) as mgr:
        assert isinstance(mgr.storage, FsspecStorage)
        assert mgr.directory == url
        for s in (1, 2, 3, 4):
            handle = mgr.save(s, state_of(s), metrics={"loss": 1 / s})
            assert handle.result(timeout=60).path == f"{url}/{step_name(s)}"
        assert mgr.all_steps() == [3, 4]
        t = blank()
        assert mgr.restore(t) == 4
        assert_state_is(t, 4)
        assert mgr.metadata(3).metrics == {"loss": 1 / 3}
    # retention deleted every object of the older checkpoints; no marker, no lock is left
    left = keys(s3env.endpoint, bucket, "run/")
    assert {k.split("/")[1] for k in left} == {".pitstop", step_name(3), step_name(4)}, left
    assert "run/.pitstop/lock" not in left
    assert uploads(s3env.endpoint, bucket) == []
    # a new writer sees the same, and a read-only manager loads and verifies
    with open_mgr(url) as ro:
        t = blank()
        assert ro.restore(t, step=3) == 3
        assert_state_is(t, 3)
    ro = open_mgr(url, read_only=True)
    assert ro.all_steps() == [3, 4]
    assert ro.load()["epoch"] == 4
    from pitstop.core.restore.read import CheckpointReader
    CheckpointReader(ro.storage, step_name(4)).verify()
    ro.close()


def test_zstd_and_many_small_tensors_restore_exact(bucket, s3env):
    """Small reads are served from a read-ahead window; compressed payloads too."""
    state = {f"t{i}": np.full(100 + i, i, np.int32) for i in range(300)}
    with open_mgr(f"s3://{bucket}/run", compression="zstd") as mgr:
        mgr.save(7, state).wait()
        target = {k: np.zeros_like(v) for k, v in state.items()}
        assert mgr.restore(target) == 7
    for k, v in state.items():
        np.testing.assert_array_equal(target[k], v)


def test_large_file_goes_up_as_a_parallel_multipart_upload(bucket, s3env):
    big = 12 * MiB + 4096  # three parts of 5 MiB: two full ones and a short last one
    storage = FsspecStorage(f"s3://{bucket}/run", part_size=PART)
    with open_mgr(storage, writer_threads=1) as mgr:
        mgr.save(1, state_of(1, big)).wait()
        m = mgr.metadata(1)
        (fname, length), = m.files.items()
        assert length >= big
        head = s3_client(s3env.endpoint).head_object(Bucket=bucket,
                                                     Key=f"run/{step_name(1)}/{fname}")
        assert head["ContentLength"] == length
        assert head["ETag"].strip('"').endswith("-3"), head["ETag"]  # a 3-part upload
        t = blank(big)
        assert mgr.restore(t) == 1
        assert_state_is(t, 1, big)
    assert uploads(s3env.endpoint, bucket) == []


def test_memory_url(monkeypatch):
    url = f"memory://pitstop-test-{os.getpid()}-{random.randrange(1 << 30)}"
    with open_mgr(url, keep_last=2) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, state_of(s)).wait()
        assert mgr.all_steps() == [2, 3]
        with pytest.raises(pitstop.DirectoryLockedError, match="in use by another writer"):
            open_mgr(url)
        t = blank()
        assert mgr.restore(t) == 3
        assert_state_is(t, 3)
        assert mgr.storage.durable is False  # memory:// dies with the process, and says so
    with open_mgr(url) as mgr:
        assert mgr.latest_step() == 3
        mgr.delete(3)
        assert mgr.all_steps() == [2]


# =========================================================================== failures
def test_upload_cut_part_way_leaves_nothing_and_the_next_save_succeeds(bucket, s3env, proxy):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    big = 6 * MiB + 4096
    url = f"s3://{bucket}/run"
    storage = FsspecStorage(url, endpoint_url=proxy.endpoint, part_size=PART, max_attempts=1,
                            request_timeout=30)
    with open_mgr(storage, writer_threads=1) as mgr:
        mgr.save(1, state_of(1, big)).wait()
        cut = rng.randrange(64 << 10, big)
        proxy.set("cut", cut)  # every connection from here on breaks
        with pytest.raises(pitstop.CheckpointWriteError) as info:
            mgr.save(2, state_of(2, big)).wait()
        assert proxy.tripped.is_set(), f"seed={seed} cut={cut}"
        msg = str(info.value)
        assert f"{url}/{step_name(2)}" in msg, f"seed={seed} cut={cut}: {msg}"
        assert "Committed checkpoints are intact" in msg, f"seed={seed}: {msg}"
        proxy.set("pass")
        # nothing of step 2 is listed or restored; step 1 is still the newest
        assert mgr.all_steps() == [1], f"seed={seed} cut={cut}"
        t = blank(big)
        assert mgr.restore(t) == 1, f"seed={seed} cut={cut}"
        assert_state_is(t, 1, big)
        # the same step again: whatever the failed save left is removed first
        mgr.save(2, state_of(2, big)).wait()
        assert mgr.all_steps() == [1, 2]
    assert uploads(s3env.endpoint, bucket) == [], f"seed={seed} cut={cut}"
    left = keys(s3env.endpoint, bucket, "run/")
    assert not [k for k in left if ".tmp-" in k], f"seed={seed}: {left}"
    with open_mgr(url) as mgr:
        t = blank(big)
        assert mgr.restore(t) == 2
        assert_state_is(t, 2, big)


def test_one_cut_connection_is_retried(bucket, s3env, proxy):
    big = 11 * MiB
    storage = FsspecStorage(f"s3://{bucket}/run", endpoint_url=proxy.endpoint,
                            part_size=PART, max_attempts=3, request_timeout=30)
    with open_mgr(storage, writer_threads=1) as mgr:
        proxy.set("cut1", 3 * MiB)  # one connection breaks mid-part, the retry goes through
        mgr.save(1, state_of(1, big)).wait()
        assert proxy.tripped.is_set()
        t = blank(big)
        assert mgr.restore(t) == 1
        assert_state_is(t, 1, big)


def test_stalled_upload_times_out_naming_the_object(bucket, s3env, proxy):
    big = 6 * MiB
    url = f"s3://{bucket}/run"
    with open_mgr(FsspecStorage(url, endpoint_url=proxy.endpoint, part_size=PART),
                  writer_threads=1) as mgr:
        mgr.save(1, state_of(1, big)).wait()
    # a writer with a short deadline per request (its other requests are small ones)
    short = FsspecStorage(url, endpoint_url=proxy.endpoint, part_size=PART, request_timeout=1,
                          max_attempts=1, read_timeout=1, connect_timeout=1)
    with open_mgr(short, writer_threads=1) as mgr:
        proxy.set("stall", MiB)  # the server stops answering in the middle of a part
        with pytest.raises(pitstop.CheckpointWriteError) as info:
            mgr.save(2, state_of(2, big)).wait()
        msg = str(info.value)
        assert f"{url}/{step_name(2)}/data-000.bin" in msg, msg
        assert "uploading part 1 (5.0 MiB) did not finish within 1 s on any of 1 attempt(s)" \
            in msg, msg
        assert "request_timeout" in msg
        assert isinstance(info.value.__cause__, ObjectStoreError)
        proxy.set("pass")
        assert mgr.all_steps() == [1]
    # the next writer removes what the stalled save left behind, and saves that step
    with open_mgr(FsspecStorage(url, endpoint_url=proxy.endpoint, part_size=PART),
                  writer_threads=1) as mgr:
        mgr.save(2, state_of(2, big)).wait()
        t = blank(big)
        assert mgr.restore(t) == 2
        assert_state_is(t, 2, big)
    assert uploads(s3env.endpoint, bucket) == []
    assert not [k for k in keys(s3env.endpoint, bucket, "run/") if ".tmp-" in k]


_KILLED_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    import numpy as np
    import pitstop
    from pitstop.core.storage import FsspecStorage
    from pitstop.core.storage.objectstore import upload as s3_upload
    url, tier, big = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
    KILL = []
    upload = s3_upload._S3Writer._upload
    async def upload_then_die(self, pieces):
        await upload(self, pieces)
        if KILL:  # a part is up, the upload is unfinished, the manifest is not written
            print("KILLED", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    s3_upload._S3Writer._upload = upload_then_die
    def state_of(step):
        rng = np.random.default_rng(step)
        s = {"model": {"w": rng.standard_normal((64, 32)).astype("f4"),
                       "b": rng.standard_normal(32)},
             "opt": [rng.integers(0, 1 << 40, 300), np.float32(step / 3)], "epoch": step}
        s["big"] = np.arange(big // 4, dtype=np.float32) + np.float32(step)
        return s
    mgr = pitstop.CheckpointManager(FsspecStorage(url, part_size=5 << 20), memory_tier=tier,
                                    save_on_signals=None, writer_threads=1)
    print("ID", mgr.directory_id, flush=True)
    mgr.save(1, state_of(1)).wait()
    KILL.append(1)
    st = state_of(2)
    mgr.save(2, st)
    st["big"][:] = -5   # training goes on: the snapshot is what counts
    time.sleep(60)
""")


def run_killed_child(url: str, tier: bool, big: int) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _KILLED_CHILD, url, "1" if tier else "0",
                        str(big)], capture_output=True, text=True, timeout=120, env=env,
                       cwd=os.getcwd())
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert "KILLED" in r.stdout, r.stdout + r.stderr
    return r.stdout.split("ID ", 1)[1].split()[0]


def test_writer_killed_mid_upload_leaves_nothing_listed(bucket, s3env, caplog):
    big = 11 * MiB
    url = f"s3://{bucket}/run"
    run_killed_child(url, False, big)
    # the killed writer left its marker, a data object's unfinished upload and its lock
    left = keys(s3env.endpoint, bucket, "run/")
    assert f"run/.tmp-{step_name(2)}" in " ".join(left), left
    assert uploads(s3env.endpoint, bucket) != []
    ro = open_mgr(url, read_only=True)
    assert ro.all_steps() == [1]  # readers never see the interrupted save
    ro.close()
    caplog.set_level(logging.WARNING, logger="pitstop")
    with open_mgr(url) as mgr:  # the dead holder's lock is taken over at once (same host)
        assert "took over the writer lock" in caplog.text
        assert "leftover(s) of interrupted saves" in caplog.text
        assert uploads(s3env.endpoint, bucket) == []
        assert not [k for k in keys(s3env.endpoint, bucket, "run/") if ".tmp-" in k]
        t = blank(big)
        assert mgr.restore(t) == 1
        assert_state_is(t, 1, big)
        mgr.save(2, state_of(2, big)).wait()
        assert mgr.all_steps() == [1, 2]


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="no writable /dev/shm")
def test_killed_mid_upload_restores_from_the_memory_tier_without_the_network(bucket, s3env):
    big = 11 * MiB
    url = f"s3://{bucket}/run"
    ident = run_killed_child(url, True, big)
    storage = FsspecStorage(url)
    reads: list[str] = []
    real_read_into = storage.read_into

    def no_network(name, relpath, *args):
        reads.append(f"{name}/{relpath}")
        raise AssertionError(f"read {name}/{relpath} from the network")

    try:
        mgr = open_mgr(storage, memory_tier=None)
        storage.read_into = no_network  # type: ignore[method-assign]
        t = blank(big)
        assert mgr.restore(t) == 2  # the snapshot of the killed save, from RAM
        assert_state_is(t, 2, big)
        assert reads == []
        storage.read_into = real_read_into  # type: ignore[method-assign]
        mgr.wait()  # ... and its persist to S3 finishes in the background
        assert mgr.all_steps() == [1, 2]
        mgr.close()
    finally:
        for f in os.listdir("/dev/shm"):
            if f.startswith(f"pitstop-{ident}-"):
                os.unlink(os.path.join("/dev/shm", f))
    assert uploads(s3env.endpoint, bucket) == []
    with open_mgr(url, read_only=True) as ro:
        t = blank(big)
        assert ro.restore(t) == 2
        assert_state_is(t, 2, big)


# =========================================================================== damage
def _obj(endpoint, bucket, key) -> bytes:
    return s3_client(endpoint).get_object(Bucket=bucket, Key=key)["Body"].read()


def _put(endpoint, bucket, key, data: bytes) -> None:
    s3_client(endpoint).put_object(Bucket=bucket, Key=key, Body=data)


def _data_key(endpoint, bucket, step) -> str:
    return [k for k in keys(endpoint, bucket, f"run/{step_name(step)}/") if "data-" in k][-1]


def flip_byte(endpoint, bucket, step):
    """One bit of array model/w, in the middle of its bytes."""
    doc = json.loads(_obj(endpoint, bucket, f"run/{step_name(step)}/manifest.json"))
    entry = doc["arrays"]["model/w"]
    key = f"run/{step_name(step)}/{entry['file']}"
    data = bytearray(_obj(endpoint, bucket, key))
    data[entry["offset"] + entry["length"] // 2] ^= 1
    _put(endpoint, bucket, key, bytes(data))


def truncate(endpoint, bucket, step):
    key = _data_key(endpoint, bucket, step)
    _put(endpoint, bucket, key, _obj(endpoint, bucket, key)[:-1])


def delete_data(endpoint, bucket, step):
    s3_client(endpoint).delete_object(Bucket=bucket, Key=_data_key(endpoint, bucket, step))


def garbage_manifest(endpoint, bucket, step):
    _put(endpoint, bucket, f"run/{step_name(step)}/manifest.json", os.urandom(300))


def dotdot_path(endpoint, bucket, step):
    from pitstop.core.format.seal import seal
    key = f"run/{step_name(step)}/manifest.json"
    doc = json.loads(_obj(endpoint, bucket, key))
    doc.pop("manifest_hash", None)
    name = sorted(doc["files"])[0]
    doc["files"]["../" + name] = doc["files"].pop(name)
    for e in doc["arrays"].values():
        if e["file"] == name:
            e["file"] = "../" + name
    _put(endpoint, bucket, key, seal(json.dumps(doc, separators=(",", ":")).encode(),
                                     doc["hash_algorithm"]))


@pytest.mark.parametrize("damage", [flip_byte, truncate, delete_data, garbage_manifest,
                                    dotdot_path], ids=lambda f: f.__name__)
def test_damaged_objects_give_the_local_errors_and_fall_back(bucket, s3env, damage):
    url = f"s3://{bucket}/run"
    with open_mgr(url) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, state_of(s)).wait()
    damage(s3env.endpoint, bucket, 3)
    with open_mgr(url) as mgr:
        with pytest.raises(pitstop.CorruptCheckpointError) as info:
            mgr.restore(blank(), step=3)
        assert f"{url}/{step_name(3)}" in str(info.value)
        assert info.value.checkpoint == f"{url}/{step_name(3)}"
        if damage in (flip_byte, truncate, delete_data):
            assert info.value.file and info.value.file.startswith("data-")
        if damage is flip_byte:
            assert info.value.key == "model/w", str(info.value)
            assert "hash mismatch" in str(info.value)
        t = blank()
        with pytest.warns(UserWarning, match=step_name(3)):
            assert mgr.restore(t) == 2
        assert_state_is(t, 2)
        # moved aside whole (a server-side copy, manifest last), no longer listed
        assert mgr.all_steps() == [1, 2]
        aside = {k.split("/")[1] for k in keys(s3env.endpoint, bucket, "run/")
                 if ".corrupt-" in k}
        assert len(aside) == 1 and next(iter(aside)).startswith(step_name(3) + ".corrupt-")
        assert keys(s3env.endpoint, bucket, f"run/{step_name(3)}/") == []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert mgr.restore(blank()) == 2
        mgr.save(3, state_of(3)).wait()  # the step can be saved again
        t = blank()
        assert mgr.restore(t) == 3
        assert_state_is(t, 3)


# =========================================================================== the lock
def test_one_writer_per_prefix(bucket, s3env):
    url = f"s3://{bucket}/run"
    with open_mgr(url) as first:
        first.save(1, state_of(1)).wait()
        with pytest.raises(pitstop.DirectoryLockedError, match="in use by another writer") as e:
            open_mgr(url)
        assert f"pid {os.getpid()}" in str(e.value) and "read_only=True" in str(e.value)
        with open_mgr(url, read_only=True) as ro:  # readers need no lock
            assert ro.latest_step() == 1
        with open_mgr(f"s3://{bucket}/other") as other:  # another prefix is another directory
            other.save(1, state_of(1)).wait()
    with open_mgr(url) as second:  # released by close()
        second.save(2, state_of(2)).wait()


def test_a_lost_lock_stops_commits(bucket, s3env):
    """Another writer took the lock over (this one was partitioned away for longer than the
    lock's lifetime): this writer commits nothing more."""
    url = f"s3://{bucket}/run"
    with open_mgr(url) as mgr:
        mgr.save(1, state_of(1)).wait()
        _put(s3env.endpoint, bucket, "run/.pitstop/lock", json.dumps(
            {"token": "someone-else", "host": "elsewhere", "pid": 1}).encode())
        with pytest.raises(pitstop.CheckpointWriteError, match="another writer holds its lock"):
            mgr.save(2, state_of(2)).wait()
        assert mgr.all_steps() == [1]
    # close() leaves the other writer's lock alone
    assert json.loads(_obj(s3env.endpoint, bucket, "run/.pitstop/lock"))["token"] == \
        "someone-else"


def test_a_lock_not_renewed_in_time_is_taken_over(bucket, s3env):
    _put(s3env.endpoint, bucket, "run/.pitstop/lock", json.dumps(
        {"token": "gone", "host": "another-host", "pid": 1, "ttl_s": 6}).encode())
    with pytest.raises(pitstop.DirectoryLockedError, match="pid 1 on another-host"):
        open_mgr(f"s3://{bucket}/run")
    import time
    time.sleep(7.1)  # the holder's lifetime (6 s by the server's clock, in whole seconds) ends
    with open_mgr(f"s3://{bucket}/run") as mgr:
        mgr.save(1, state_of(1)).wait()


# =========================================================================== the user's mistakes
def test_missing_bucket_and_no_credentials_are_clear_errors(s3env, monkeypatch, tmp_path):
    with pytest.raises(pitstop.CheckpointError, match="bucket 'no-such-bucket' does not exist"):
        open_mgr("s3://no-such-bucket/run")
    with pytest.raises(pitstop.CheckpointError, match="does not exist"):
        open_mgr("s3://no-such-bucket/run", read_only=True).all_steps()
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(pitstop.CheckpointError, match="no AWS credentials found"):
        open_mgr("s3://any-bucket/run")
    # ... and the shared credentials file of botocore's chain is read
    creds = tmp_path / "credentials"
    creds.write_text("[default]\naws_access_key_id = a\naws_secret_access_key = b\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    s3_client(s3env.endpoint).create_bucket(Bucket="from-the-file")
    with open_mgr("s3://from-the-file/run") as mgr:
        mgr.save(1, state_of(1)).wait()


def test_endpoint_from_the_s3_variable_or_an_explicit_option(bucket, s3env, monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3env.endpoint)
    with open_mgr(f"s3://{bucket}/run") as mgr:
        mgr.save(1, state_of(1)).wait()
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    storage = open_storage(f"s3://{bucket}/run",
                           storage_options={"endpoint_url": s3env.endpoint, "part_size": PART})
    assert isinstance(storage, FsspecStorage) and storage.opts.part_size == PART
    with open_mgr(storage) as mgr:
        assert mgr.latest_step() == 1


def test_bad_urls_and_options_are_refused_before_anything_is_written():
    with pytest.raises(pitstop.InvalidArgumentError, match="part_size"):
        FsspecStorage("s3://b/run", part_size=1024)
    with pytest.raises(pitstop.InvalidArgumentError, match="request_timeout"):
        FsspecStorage("s3://b/run", request_timeout=0)
    with pytest.raises(pitstop.InvalidArgumentError, match="name a bucket"):
        FsspecStorage("s3:///run")
    with pytest.raises(pitstop.CheckpointError, match="nosuchproto"):
        open_mgr("nosuchproto://x/run")
    with pytest.raises(pitstop.InvalidArgumentError, match="object-store URLs"):
        open_storage("/tmp/x", storage_options={"endpoint_url": "http://x"})


def test_a_prefix_holding_other_objects(bucket, s3env):
    ep = s3env.endpoint
    foreign = {"run/notes.txt": b"mine", "run/step_5/x": b"not pitstop's name",
               f"run/{step_name(9)}/data-000.bin": b"no manifest: not a checkpoint",
               f"run/.tmp-{step_name(4)}-0123abcd": b"not a marker pitstop wrote",
               "run/.pitstop/my-own-file": b"kept", "runner/x": b"another prefix"}
    for k, v in foreign.items():
        _put(ep, bucket, k, v)
    with open_mgr(f"s3://{bucket}/run", keep_last=1) as mgr:
        for s in (1, 2):
            mgr.save(s, state_of(s)).wait()
        assert mgr.all_steps() == [2]
    for k, v in foreign.items():  # nothing pitstop did not make is touched
        assert _obj(ep, bucket, k) == v, k


def test_step_exists_and_a_concurrent_commit_is_never_overwritten(bucket, s3env):
    url = f"s3://{bucket}/run"
    with open_mgr(url) as mgr:
        mgr.save(1, state_of(1)).wait()
        with pytest.raises(pitstop.StepExistsError):
            mgr.save(1, state_of(1))
        theirs = b'{"written by": "another writer"}'

        def another_writer_commits_first(step):
            _put(s3env.endpoint, bucket, f"run/{step_name(step)}/manifest.json", theirs)

        mgr.hooks["before_commit"] = another_writer_commits_first
        with pytest.raises(pitstop.CheckpointWriteError, match="already exists"):
            mgr.save(2, state_of(2)).wait()
        mgr.hooks.clear()
    assert _obj(s3env.endpoint, bucket, f"run/{step_name(2)}/manifest.json") == theirs


def test_an_interrupted_save_is_cleaned_by_the_next_writer_only(bucket, s3env):
    """At the storage level: a save that never committed (its process gone) is invisible,
    and cleanup removes exactly its objects, its unfinished upload and its marker."""
    url = f"s3://{bucket}/run"
    st = FsspecStorage(url, part_size=PART)
    txn = st.begin(step_name(5))
    w = txn.open_write("data-000.bin")
    w.write(np.zeros(6 * MiB, np.uint8))  # one part up, a multipart upload unfinished
    small = txn.open_write("data-001.bin")
    small.write(b"x" * 100)
    small.close()  # a whole object, but no manifest
    assert st.list_checkpoints() == []
    assert uploads(s3env.endpoint, bucket) != []
    other = FsspecStorage(url)
    found = other.leftovers()
    assert [item.entry for item in found] == [txn.marker]  # type: ignore[attr-defined]
    removed = other.cleanup_incomplete()
    assert txn.marker in removed  # type: ignore[attr-defined]
    assert f"{step_name(5)}/data-001.bin" in removed
    assert uploads(s3env.endpoint, bucket) == []
    assert keys(s3env.endpoint, bucket, "run/") == []


def test_ranks_of_a_distributed_job_save_one_checkpoint_to_a_bucket(bucket: str) -> None:
    """Several ranks (threads joined by an in-memory coordinator, tests/core/
    test_coordination.py) write their parts under one prefix; the leader's manifest commits
    them. A rank whose write fails leaves nothing of the step behind."""
    from thread_ranks import ranks

    url = f"s3://{bucket}/dist"

    def job(rank: int, coord: Any) -> Any:
        state = {"w": np.arange(1000.0), "mine": np.full(3, rank)}
        with pitstop.CheckpointManager(url, distributed=coord, save_on_signals=None,
                                       memory_tier=False) as mgr:
            mgr.save(1, state).wait()
            if rank == 1:
                def full(step: int) -> None:
                    raise OSError(28, "No space left on device")
                mgr.hooks["before_write"] = full
            with pytest.raises(pitstop.CheckpointWriteError, match="rank 1"):
                mgr.save(2, state).wait()
            mgr.hooks.clear()
            restored = {"w": np.zeros(1000), "mine": np.zeros(3, int)}
            return mgr.restore(restored), restored["mine"].tolist()

    assert ranks(2, job) == [(1, [0, 0, 0]), (1, [1, 1, 1])]
    keys = sorted(o["Key"] for o in s3_client(os.environ["AWS_ENDPOINT_URL"]).list_objects_v2(
        Bucket=bucket, Prefix="dist/step_").get("Contents", []))
    assert {k.split("/")[1] for k in keys} == {"step_0000000001"}
    assert any("data-r00001-" in k for k in keys)  # rank 1 wrote its own part
    everything = s3_client(os.environ["AWS_ENDPOINT_URL"]).list_objects_v2(
        Bucket=bucket, Prefix="dist/").get("Contents", [])
    assert not [o["Key"] for o in everything if ".tmp-" in o["Key"]]  # no marker is left
