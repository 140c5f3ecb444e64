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
#: other pytest process (TensorFlow and torch's triton cannot share one; JAX reads its
#: device count from XLA_FLAGS once per process)
ISOLATED = {"tf": "tensorflow", "keras": "keras", "jax": "jax"}
#: (folder, environment) of each run: the Keras folder once per backend (Keras fixes its
#: backend per process, from KERAS_BACKEND)
RUNS = [("tf", {}), ("jax", {}),
        *(("keras", {"KERAS_BACKEND": b}) for b in ("jax", "torch", "tensorflow"))]
_BACKEND_MODULE = {"jax": "jax", "torch": "torch", "tensorflow": "tensorflow"}


@pytest.mark.parametrize(("folder", "env"), RUNS,
                         ids=[f"{f}-{e.get('KERAS_BACKEND', '')}".rstrip("-") for f, e in RUNS])
def test_folder_in_its_own_process(folder: str, env: dict[str, str]) -> None:
    for module in (ISOLATED[folder], _BACKEND_MODULE.get(env.get("KERAS_BACKEND", ""))):
        if module and importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"tests/{folder}"],
        cwd=ROOT, capture_output=True, text=True, timeout=1500,
        env=dict(os.environ, **env, PYTHONPATH=os.pathsep.join(
            [str(ROOT), os.environ.get("PYTHONPATH", "")])))
    summary = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
    print(f"tests/{folder} {env}: {summary}")
    assert r.returncode == 0, f"tests/{folder} {env} failed:\n{r.stdout[-30000:]}\n{r.stderr[-5000:]}"
