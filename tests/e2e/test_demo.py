"""`pitstop demo` end to end: a real child process is SIGKILLed, restarted, and must resume
bitwise identical to an uninterrupted reference run."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_demo_resumes_identically(tmp_path):
    work = tmp_path / "demo"
    r = subprocess.run(
        [sys.executable, "-m", "pitstop.cli", "demo", "--dir", str(work)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "identical: yes" in r.stdout
    assert "killed with SIGKILL" in r.stdout
    m = re.search(r"restored step (\d+).*resumed at step (\d+)", r.stdout)
    assert m and int(m.group(2)) == int(m.group(1)) + 1
    # --dir keeps the work directory: the checkpoints are there and verify cleanly
    from pitstop.cli import main

    assert main(["verify", str(work / "checkpoints"), "--all"]) == 0


def test_demo_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "something").write_text("x")
    r = subprocess.run(
        [sys.executable, "-m", "pitstop.cli", "demo", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert r.returncode == 2 and "not empty" in r.stderr
