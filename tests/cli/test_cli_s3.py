"""The `pitstop` command on object-store URLs (a real S3 server: moto's, in a subprocess):
ls, inspect, verify and gc work on ``s3://bucket/prefix`` as on a directory, with the same
exit statuses, and say clearly what is wrong with a URL."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import s3_server
from s3_server import s3_client

import pitstop
from pitstop.cli import main
from pitstop.core.directory.names import step_name
from pitstop.core.storage import FsspecStorage

#: the test server's fixtures (tests/s3_server.py), used by name
bucket, moto, s3env = (s3_server.bucket, s3_server.moto, s3_server.s3env)

MiB = 1 << 20


def _state(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"model": {"w": rng.standard_normal((64, 32), dtype=np.float32),
                      "b": np.arange(32, dtype=np.float32)},
            "opt": {"m": np.zeros((64, 32), np.float32), "lr": 0.001}, "epoch": step}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def url(bucket, s3env) -> str:
    """s3://<bucket>/run with checkpoints of steps 10, 20 and 30."""
    u = f"s3://{bucket}/run"
    with pitstop.CheckpointManager(u, memory_tier=False, save_on_signals=None) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, _state(step), metrics={"loss": 1.0 / step}).wait()
    return u


def test_ls_inspect_verify_on_a_url(url, capsys):
    rc, out, err = run(capsys, "ls", url)
    assert rc == 0, err
    assert out.startswith(f"{url}: 3 checkpoints")
    lines = [ln for ln in out.splitlines() if ln.strip().startswith(("*", "10", "20", "30"))]
    assert [ln.split()[-1] for ln in lines] == ["loss=0.1", "loss=0.05", "loss=0.0333333"]
    assert lines[-1].startswith("*")
    # the retention the writer recorded in the bucket: none, so every checkpoint stays
    assert "retention: none (keeps every checkpoint)" in out
    assert all("kept: no retention" in ln for ln in lines)

    rc, out, err = run(capsys, "inspect", url, "--step", "20")
    assert rc == 0, err
    assert out.startswith(f"step 20: {url}/{step_name(20)}")
    assert "model/w" in out and "<f4" in out and "[64, 32]" in out
    rc, out, _ = run(capsys, "inspect", url, "--json")
    assert rc == 0 and json.loads(out)["step"] == 30

    rc, out, err = run(capsys, "verify", url, "--all")
    assert rc == 0, err
    assert [ln.split(":")[0] for ln in out.splitlines()] == ["step 10", "step 20", "step 30"]
    assert all(": ok (" in ln for ln in out.splitlines())


def test_verify_names_the_corrupt_object_and_tensor(url, bucket, s3env, capsys):
    client = s3_client(s3env.endpoint)
    base = f"run/{step_name(30)}"
    entry = json.loads(client.get_object(Bucket=bucket, Key=f"{base}/manifest.json")["Body"]
                       .read())["arrays"]["model/w"]
    key = f"{base}/{entry['file']}"
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[entry["offset"] + entry["length"] // 2] ^= 1
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    rc, out, err = run(capsys, "verify", url)
    assert rc == 1, out + err
    assert f"file {entry['file']}, tensor model/w" in out
    assert "hash mismatch" in out and "failed verification" in err
    rc, out, err = run(capsys, "verify", url, "--step", "20")
    assert rc == 0, err


def test_gc_removes_an_interrupted_save_and_only_it(url, bucket, s3env, capsys):
    client = s3_client(s3env.endpoint)
    client.put_object(Bucket=bucket, Key="run/notes.txt", Body=b"mine")
    storage = FsspecStorage(url, part_size=5 * MiB)
    txn = storage.begin(step_name(40))
    w = txn.open_write("data-000.bin")
    w.write(np.zeros(6 * MiB, np.uint8))  # a part up, the upload unfinished; then "killed"
    marker = txn.marker  # type: ignore[attr-defined]

    rc, out, err = run(capsys, "ls", url)
    assert rc == 0, err
    row = next(ln for ln in out.splitlines() if marker in ln)
    assert row.split()[0] == "40" and "incomplete: interrupted save" in row
    assert "not pitstop's: notes.txt" in out
    assert step_name(40) not in out.replace(marker, "")  # the save's own objects: no entry

    with pitstop.CheckpointManager(FsspecStorage(url), memory_tier=False,
                                   save_on_signals=None) as mgr:
        # a live writer: gc refuses (the writer removed the leftover when it opened, too)
        rc, out, err = run(capsys, "gc", url)
        assert rc == 2 and "in use by another writer" in err, out + err
        assert mgr.latest_step() == 30
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []

    txn = storage.begin(step_name(40))  # again, with no writer this time
    txn.open_write("data-000.bin").write(np.zeros(6 * MiB, np.uint8))
    marker = txn.marker  # type: ignore[attr-defined]
    rc, out, err = run(capsys, "gc", url, "--dry-run")
    assert rc == 0, err
    assert f"would remove {marker}" in out
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) != []
    rc, out, err = run(capsys, "gc", url)
    assert rc == 0, err
    assert f"removed {marker}" in out
    assert "committed checkpoints untouched (3 in" in out
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    left = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="run/")["Contents"]]
    assert "run/notes.txt" in left and not [k for k in left if ".tmp-" in k]
    rc, out, _ = run(capsys, "ls", url)
    assert "incomplete" not in out


def test_url_mistakes_are_one_clear_line(bucket, s3env, capsys, monkeypatch, tmp_path):
    rc, out, err = run(capsys, "ls", "s3://no-such-bucket/run")
    assert rc == 2 and "bucket 'no-such-bucket' does not exist" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    rc, out, err = run(capsys, "inspect", f"s3://{bucket}/nothing-here")
    assert rc == 2 and "not a pitstop checkpoint directory" in err, err
    rc, out, err = run(capsys, "ls", str(tmp_path), "-o", "anon=true")
    assert rc == 2 and "-o/--storage-option is for object-store URLs" in err
    rc, out, err = run(capsys, "ls", f"s3://{bucket}/run", "-o", "nonsense")
    assert rc == 2 and "KEY=VALUE" in err
    # the endpoint as a storage option instead of the environment
    endpoint = os.environ.pop("AWS_ENDPOINT_URL")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    rc, out, err = run(capsys, "ls", f"s3://{bucket}/run", "-o", f"endpoint_url={endpoint}")
    assert rc == 0, err


def test_one_checkpoint_given_instead_of_its_directory(url, capsys):
    rc, out, err = run(capsys, "inspect", f"{url}/{step_name(20)}")
    assert rc == 0 and out.startswith("step 20:"), err
    rc, out, err = run(capsys, "verify", f"{url}/{step_name(20)}/")
    assert rc == 0 and "step 20: ok" in out, err
    rc, out, err = run(capsys, "ls", f"{url}/{step_name(20)}")
    assert rc == 0 and out.startswith(f"{url}/{step_name(20)}: the checkpoint of step 20"), err
    rows = [ln for ln in out.splitlines() if ln.strip()[:1].isdigit()]
    assert len(rows) == 1 and rows[0].split()[0] == "20" and "loss=0.05" in rows[0]


def test_memory_url(capsys):
    u = f"memory://pitstop-cli-{os.getpid()}-{random.randrange(1 << 30)}"
    with pitstop.CheckpointManager(u, memory_tier=False, save_on_signals=None) as mgr:
        mgr.save(1, _state(1)).wait()
    rc, out, err = run(capsys, "verify", u)
    assert rc == 0 and "step 1: ok" in out, err
    rc, out, err = run(capsys, "gc", u)
    assert rc == 0 and "removed 0 leftover(s)" in out, err
