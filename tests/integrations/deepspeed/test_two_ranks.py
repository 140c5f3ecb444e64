"""Two gloo ranks of a ZeRO-2 engine save one pitstop checkpoint together: each rank's fp32
partition and moments are kept for that rank, and a restore on two ranks resumes each
bitwise (the checks run in the ranks, two_ranks_child.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

CHILD = Path(__file__).with_name("two_ranks_child.py")


def test_two_ranks_resume_their_own_partitions(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [subprocess.Popen(
        [sys.executable, str(CHILD), str(tmp_path / "run")],
        env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
             "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in ranks]
    for r, (p, (out, err)) in enumerate(zip(ranks, outs, strict=True)):
        assert p.returncode == 0, f"rank {r}:\n{err[-3000:]}"
        line = [ln for ln in out.splitlines() if ln.startswith(f"rank {r} ok ")]
        assert line, out[-2000:]
    # each rank held half of the 161 parameters (padded to the alignment), not all of them
    assert all(int(ln.split()[-1]) < 161 for o, _ in outs for ln in o.splitlines()
               if " ok " in ln)
