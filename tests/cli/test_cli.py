"""The `pitstop` command on real checkpoint directories: ls, inspect, verify, gc."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import pitstop
from pitstop.cli import main


def _state(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "model": {
            "w": rng.standard_normal((64, 32), dtype=np.float32),
            "b": np.arange(32, dtype=np.float32).astype(ml_dtypes.bfloat16),
        },
        "optimizer": {"m": np.zeros((64, 32), np.float32), "lr": 0.001},
        "epoch": 2,
    }


@pytest.fixture
def ckdir(tmp_path):
    """A directory with checkpoints of steps 10, 20 and 30 (memory tier off)."""
    d = tmp_path / "run"
    state = _state()
    with pitstop.CheckpointManager(d, memory_tier=False) as mgr:
        for step in (10, 20, 30):
            state["model"]["w"] += 1
            mgr.save(step, state, metrics={"loss": 1.0 / step}).wait()
    return d


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _flip_byte(ckdir, step: int, key: str) -> str:
    """Flip one byte inside array ``key`` of ``step``; returns the data file's name."""
    ck = ckdir / f"step_{step:010d}"
    entry = json.loads((ck / "manifest.json").read_text())["arrays"][key]
    path = ck / entry["file"]
    data = bytearray(path.read_bytes())
    data[entry["offset"] + entry["length"] // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return entry["file"]


def test_ls_lists_steps_metrics_and_marks_newest(ckdir, capsys):
    rc, out, _ = run(capsys, "ls", ckdir)
    assert rc == 0
    lines = out.splitlines()
    assert "3 checkpoints" in lines[0]
    rows = [line for line in lines if line.lstrip("* ").split(" ")[0] in ("10", "20", "30")]
    assert len(rows) == 3
    assert rows[-1].startswith("*") and " 30 " in rows[-1]
    assert not rows[0].startswith("*") and not rows[1].startswith("*")
    assert "loss=0.1" in rows[0] and "loss=0.0333333" in rows[-1]
    assert "KiB" in rows[0]  # 2 x 8 KiB of float32 plus 64 B of bfloat16


def test_ls_and_inspect_of_missing_directory_exit_2(tmp_path, capsys):
    rc, _, err = run(capsys, "ls", tmp_path / "nope")
    assert rc == 2 and "no such directory" in err
    rc, _, err = run(capsys, "inspect", tmp_path)
    assert rc == 2 and "no committed checkpoint" in err


def test_inspect_shows_arrays_values_and_metrics(ckdir, capsys):
    rc, out, _ = run(capsys, "inspect", ckdir)
    assert rc == 0
    assert out.startswith("step 30:")
    assert "loss=0.0333333" in out
    w = next(line for line in out.splitlines() if line.strip().startswith("model/w "))
    assert "<f4" in w and "[64, 32]" in w and "8.0 KiB" in w
    b = next(line for line in out.splitlines() if line.strip().startswith("model/b "))
    assert "bfloat16" in b and "[32]" in b and "64 B" in b
    assert "optimizer/lr" in out and "0.001" in out and "epoch" in out

    rc, out, _ = run(capsys, "inspect", ckdir, "--step", "10")
    assert rc == 0 and out.startswith("step 10:") and "loss=0.1" in out

    rc, out, _ = run(capsys, "inspect", ckdir, "--step", "20", "--json")
    doc = json.loads(out)
    assert doc["step"] == 20 and doc["format"] == "pitstop-checkpoint"

    rc, _, err = run(capsys, "inspect", ckdir, "--step", "11")
    assert rc == 2 and "no checkpoint of step 11" in err


def test_verify_ok(ckdir, capsys):
    rc, out, _ = run(capsys, "verify", ckdir)
    assert rc == 0 and out.startswith("step 30: ok")
    rc, out, _ = run(capsys, "verify", ckdir, "--all")
    assert rc == 0 and [line.split(":")[0] for line in out.splitlines()] == [
        "step 10",
        "step 20",
        "step 30",
    ]


def test_verify_names_file_and_tensor_after_a_flipped_byte(ckdir, capsys):
    fname = _flip_byte(ckdir, 20, "model/w")
    rc, out, _ = run(capsys, "verify", ckdir, "--step", "20")
    assert rc == 1
    assert "CORRUPT" in out and fname in out and "'model/w'" in out and "hash mismatch" in out
    # --all reports it among healthy ones; the newest alone is fine
    rc, out, _ = run(capsys, "verify", ckdir, "--all")
    assert rc == 1 and "step 10: ok" in out and "step 30: ok" in out
    assert "1 of 3 checkpoint(s) failed" in out
    assert run(capsys, "verify", ckdir)[0] == 0


def test_verify_reports_a_truncated_file(ckdir, capsys):
    ck = ckdir / "step_0000000030"
    entry = json.loads((ck / "manifest.json").read_text())["arrays"]["model/w"]
    path = ck / entry["file"]
    os.truncate(path, os.path.getsize(path) - 1)
    rc, out, _ = run(capsys, "verify", ckdir)
    assert rc == 1 and entry["file"] in out and "truncated" in out


def test_read_commands_work_while_a_writer_holds_the_directory(ckdir, capsys):
    with pitstop.CheckpointManager(ckdir, memory_tier=False) as mgr:
        mgr.save(40, _state(), metrics={"loss": 0.01}).wait()
        rc, out, _ = run(capsys, "ls", ckdir)
        assert rc == 0 and "4 checkpoints" in out
        assert run(capsys, "inspect", ckdir)[0] == 0
        rc, out, _ = run(capsys, "verify", ckdir, "--all")
        assert rc == 0 and "step 40: ok" in out


def test_gc_removes_leftovers_but_not_checkpoints(ckdir, capsys):
    # what an interrupted save leaves: .tmp-<checkpoint name>-<8 hex>
    leftover = ckdir / ".tmp-step_0000000040-1a2b3c4d"
    leftover.mkdir()
    (leftover / "data-000.bin").write_bytes(b"partial")
    before = sorted(p.name for p in ckdir.iterdir() if p.name.startswith("step_"))
    rc, out, _ = run(capsys, "ls", ckdir)
    assert leftover.name in out  # ls points at it

    rc, out, _ = run(capsys, "gc", ckdir, "--dry-run", "--memory-tier", ckdir.parent)
    assert rc == 0 and f"would remove {leftover.name}" in out and leftover.exists()

    rc, out, _ = run(capsys, "gc", ckdir, "--memory-tier", ckdir.parent)
    assert rc == 0 and f"removed {leftover.name}" in out
    assert not leftover.exists()
    assert sorted(p.name for p in ckdir.iterdir() if p.name.startswith("step_")) == before
    assert run(capsys, "verify", ckdir, "--all")[0] == 0


def test_gc_refuses_while_a_writer_holds_the_directory(ckdir, capsys):
    leftover = ckdir / ".tmp-step_0000000050-0badcafe"
    with pitstop.CheckpointManager(ckdir, memory_tier=False):
        leftover.mkdir()  # what an in-flight save looks like
        rc, _, err = run(capsys, "gc", ckdir)
        assert rc == 2 and "in use by another writer" in err
        assert leftover.exists()


def test_gc_memory_tier_drops_stale_files_keeps_recoverable(ckdir, tmp_path, capsys):
    from pitstop.core.runtime.host import boot_id
    from pitstop.core.save import memtier

    shm = tmp_path / "shm"
    shm.mkdir()
    ident = json.loads((ckdir / ".pitstop" / "directory.json").read_text())["directory_id"]
    tier = memtier.MemoryTier(str(shm), str(ckdir), ident)
    name = os.path.basename(tier.prefix)  # pitstop-<directory_id>-<hash of the real path>
    assert name.startswith(f"pitstop-{ident}-")
    base = {
        "host": __import__("socket").gethostname(),
        "boot_id": boot_id(),
        "directory": os.path.realpath(ckdir),
        "directory_id": ident,
        # a well-formed description of a snapshot of one float64 array of 8 elements
        "layout": {"total": 64, "group_starts": [0], "arrays": [["w", "<f8", [8], 0, 64]]},
        "values": {},
        "structure": {},
        "hashes": None,
    }
    # slot 0: already committed (stale); slot 1: newer than anything on disk (recoverable);
    # slot 2: an unsealed buffer (stale); another directory's files are never touched
    for slot, meta in (
        (0, {**base, "step": 30, "committed": True}),
        (1, {**base, "step": 35, "committed": False}),
    ):
        (shm / f"{name}-{slot}.json").write_text(json.dumps(meta))
        (shm / f"{name}-{slot}.buf").write_bytes(b"\0" * 64)
    (shm / f"{name}-2.buf").write_bytes(b"\0" * 64)
    (shm / "pitstop-otherdirectory-0.buf").write_bytes(b"\0" * 64)

    rc, out, _ = run(capsys, "gc", ckdir, "--memory-tier", shm)
    assert rc == 0
    assert sorted(p.name for p in shm.iterdir()) == sorted(
        [f"{name}-1.json", f"{name}-1.buf", "pitstop-otherdirectory-0.buf"]
    )
    assert "snapshot of step 35" in out

    rc, out, _ = run(capsys, "gc", ckdir, "--memory-tier", shm, "--drop-recoverable")
    assert rc == 0
    assert [p.name for p in shm.iterdir()] == ["pitstop-otherdirectory-0.buf"]
    assert len([p for p in ckdir.iterdir() if p.name.startswith("step_")]) == 3


def test_python_dash_m_entry_point(ckdir):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}
    r = subprocess.run(
        [sys.executable, "-m", "pitstop.cli", "verify", str(ckdir)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert "step 30: ok" in r.stdout


def test_a_broken_manifest_is_reported_not_crashed_on(ckdir, capsys):
    (ckdir / "step_0000000020" / "manifest.json").write_text("{not json")
    rc, out, _ = run(capsys, "ls", ckdir)
    assert rc == 0 and "unreadable" in out and "3 checkpoints" in out
    rc, _, err = run(capsys, "inspect", ckdir, "--step", "20")
    assert rc == 1 and "not valid JSON" in err
    rc, out, _ = run(capsys, "verify", ckdir, "--all")
    assert rc == 1 and "step 20: CORRUPT" in out and "step 30: ok" in out
