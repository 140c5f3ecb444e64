"""`import pitstop` / `import pitstop.core` must import no framework (core is neutral)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAMEWORKS = ["torch", "tensorflow", "keras", "jax", "jaxlib", "flax", "optax", "orbax"]


def frameworks_loaded_by(code: str) -> list[str]:
    """Run ``code`` (which prints the loaded framework modules last) in a fresh interpreter."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "module", ["pitstop", "pitstop.core", "pitstop.core.manager", "pitstop.cli"]
)
def test_import_pulls_in_no_framework(module):
    code = (
        f"import json, sys, {module}\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        f"{FRAMEWORKS!r})))"
    )
    assert frameworks_loaded_by(code) == []


def test_numpy_save_restore_and_cli_import_no_framework(tmp_path):
    code = f"""
import json, sys
import numpy as np
import pitstop
from pitstop.cli import main
state = {{"w": np.ones(4, np.float32), "rng": pitstop.RNG(), "n": 1}}
with pitstop.CheckpointManager({str(tmp_path)!r}, memory_tier=False) as mgr:
    mgr.save(0, state).wait()
    assert mgr.restore(state) == 0
assert main(["verify", {str(tmp_path)!r}]) == 0
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r})))
"""
    assert frameworks_loaded_by(code) == []


def test_test_modules_collected_together_have_distinct_names():
    """pytest's default (rootdir-relative, no __init__.py) import mode fails the whole run's
    collection on two test modules of one name in folders collected by one process; the
    folders run in processes of their own (tests/test_isolated_suites.py) are apart."""
    from test_isolated_suites import ISOLATED

    seen: dict[str, str] = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "tests")):
        rel = os.path.relpath(folder, os.path.join(ROOT, "tests"))
        parts = rel.split(os.sep)
        if (parts[0] == "adapters" and len(parts) > 1 and parts[1] in ISOLATED) or os.path.exists(os.path.join(folder, "__init__.py")):
            continue
        for f in files:
            if f.startswith("test_") and f.endswith(".py"):
                assert f not in seen, f"tests/{rel}/{f} and {seen[f]} share a name"
                seen[f] = f"tests/{rel}/{f}"


def test_framework_test_folders_cannot_shadow_the_frameworks():
    """A test folder named after a framework (tests/torch) is importable as that framework when
    it is missing (pytest puts tests/ on sys.path), so ``importorskip("torch")`` succeeded and
    the test failed. The folders live under tests/adapters/, which pytest never puts on
    sys.path: it holds no test module and no conftest.py of its own."""
    frameworks = {"torch", "tensorflow", "tf", "keras", "jax", "flax", "optax", "orbax"}
    tests = os.path.join(ROOT, "tests")
    for folder, dirs, files in os.walk(tests):
        rel = os.path.relpath(folder, tests)
        if rel == "adapters":
            assert not [f for f in files if f.endswith(".py")], files
            continue
        shadowing = frameworks.intersection(dirs)
        assert not shadowing, f"tests/{rel}/{sorted(shadowing)[0]} would shadow the framework"


def test_a_float32_job_and_the_command_do_not_import_ml_dtypes(tmp_path):
    """ml_dtypes takes about a second to import (more than the rest of pitstop): a process
    that holds none of its types (bfloat16, float8, int4) never pays for it; one that does
    saves and restores them (tests/core/test_roundtrip.py)."""
    code = f"""
import json, sys
import numpy as np
import torch
import pitstop
from pitstop.cli import main
state = {{"w": np.ones(4, np.float32), "t": torch.ones(3), "n": 1}}
with pitstop.CheckpointManager({str(tmp_path)!r}, memory_tier=False) as mgr:
    mgr.save(0, state).wait()
    assert mgr.restore(state) == 0
assert main(["verify", {str(tmp_path)!r}]) == 0
assert main(["inspect", {str(tmp_path)!r}]) == 0
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == "ml_dtypes")))
"""
    assert frameworks_loaded_by(code) == []
