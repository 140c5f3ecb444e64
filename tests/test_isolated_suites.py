"""Framework test folders that need a process of their own (tests/conftest.py, ISOLATED),
each run here as one pytest subprocess, so `pytest tests` covers them too."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: test folder -> the framework it needs; tests/conftest.py keeps these folders out of any
#: other pytest process (TensorFlow and torch's triton cannot share one)
ISOLATED = {"tf": "tensorflow"}


@pytest.mark.parametrize("folder", sorted(ISOLATED))
def test_folder_in_its_own_process(folder: str) -> None:
    if importlib.util.find_spec(ISOLATED[folder]) is None:
        pytest.skip(f"{ISOLATED[folder]} is not installed")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"tests/{folder}"],
        cwd=ROOT, capture_output=True, text=True, timeout=1500,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(ROOT), os.environ.get("PYTHONPATH", "")])))
    summary = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
    print(f"tests/{folder}: {summary}")
    assert r.returncode == 0, f"tests/{folder} failed:\n{r.stdout[-30000:]}\n{r.stderr[-5000:]}"
