"""examples/tf_train.py runs, and a second run resumes from the first one's newest checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def run(tmp_path: Path, steps: int) -> str:
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "tf_train.py"), "--dir", str(tmp_path / "run"),
         "--steps", str(steps), "--save-every", "10"],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(ROOT), os.environ.get("PYTHONPATH", "")])))
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    return r.stdout


def test_the_example_trains_and_resumes(tmp_path):
    first = run(tmp_path, 30)
    assert "starting fresh" in first and first.rstrip().endswith(
        f"['{tmp_path}/run/ckpt-1', '{tmp_path}/run/ckpt-2', '{tmp_path}/run/ckpt-3']")
    second = run(tmp_path, 40)
    assert f"resuming from {tmp_path}/run/ckpt-3 (step 30)" in second
    assert second.rstrip().endswith(f"'{tmp_path}/run/ckpt-4']")
