"""The command's exit status when its reader goes away (`pitstop verify DIR | head -1`).

A broken pipe cuts the output short, and the verdict with it: the status must not say
"fine" (0) for a checkpoint that failed verification, or for two checkpoints that differ."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import pitstop

ROOT = Path(__file__).resolve().parents[3]


def _run_into_a_closed_pipe(*args: str) -> int:
    """The command with stdout a pipe whose read end is already closed: every write fails
    with EPIPE, as after `| head -1` has read its line and exited."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "pitstop.cli", *args], stdout=w,
                           stderr=subprocess.DEVNULL, cwd=ROOT, timeout=120)
    finally:
        os.close(w)
    return p.returncode


def test_a_broken_pipe_never_turns_a_failed_verdict_into_success(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    with pitstop.CheckpointManager(d, memory_tier=False) as mgr:
        mgr.save(1, {"w": np.arange(1000.0)}).wait()
        mgr.save(2, {"w": np.arange(1000.0) + 1}).wait()
    # what a shell reports for a command killed by SIGPIPE (128 + 13): output cut, no verdict
    assert _run_into_a_closed_pipe("diff", str(d / "step_0000000001"),
                                   str(d / "step_0000000002")) == 141
    data = d / "step_0000000002" / "data-000.bin"
    with open(data, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert _run_into_a_closed_pipe("verify", str(d), "--step", "2") == 141
