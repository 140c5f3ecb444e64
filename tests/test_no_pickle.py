"""Nothing on any load path unpickles.

Each framework group runs in a process of its own (tests/no_pickle_child.py; TensorFlow and
torch cannot share one, see tests/test_isolated_suites.py): it writes real checkpoints, then
traps pickle (``pickle``/``_pickle`` load, loads and Unpickler, their pure-Python twins,
``copyreg._reconstructor``, every module attribute that still held one of them and every
Unpickler subclass made before the trap, but pitstop's restricted DCP unpickler) and runs
every restore, ``load``, memory-tier recovery, import / export helper and CLI read command
of the group. A trapped call is recorded even where a caller swallows the exception. The
three groups run at the same time: they mostly wait for imports.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHILD = ROOT / "tests" / "no_pickle_child.py"
#: group -> (modules it needs, its environment, the paths it must have run)
GROUPS = {
    "torch": (("torch",), {}, [
        "trapped torch.load(weights_only=False)", "trapped DCP FileSystemReader.read_metadata",
        "restore", "read_only load", "cli ls", "cli inspect", "cli verify", "cli gc",
        "memory-tier recovery", "import_torch_save", "import_dcp", "export_torch_save",
        "export_safetensors", "torch.load(weights_only=True) of an export"]),
    "tf": (("tensorflow",), {}, [
        "restore", "read_only load", "cli ls", "cli inspect", "cli verify", "cli gc",
        "tf native checkpoint restore", "tf CheckpointManager restore_or_initialize"]),
    "jax": (("jax", "orbax.checkpoint", "keras"), {"KERAS_BACKEND": "jax"}, [
        "restore", "read_only load", "cli ls", "cli inspect", "cli verify", "cli gc",
        "import_orbax", "export_orbax", "keras verify_file", "keras BackupAndRestore resume"]),
}
TIMEOUT = 600


def _missing(modules: tuple[str, ...]) -> str | None:
    for m in modules:
        try:
            if importlib.util.find_spec(m) is None:
                return m
        except ModuleNotFoundError:
            return m
    return None


@pytest.fixture(scope="module")
def children(tmp_path_factory):
    """Every group's child, started together on first use."""
    procs = {}
    for group, (modules, env, _want) in GROUPS.items():
        if _missing(modules) is not None:
            continue
        work = tmp_path_factory.mktemp(f"no-pickle-{group}")
        procs[group] = subprocess.Popen(
            [sys.executable, str(CHILD), group, str(work)], cwd=ROOT, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=dict(os.environ, **env, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3"))
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("group", list(GROUPS))
def test_no_load_path_unpickles(children, group):
    modules, _env, want = GROUPS[group]
    missing = _missing(modules)
    if missing is not None:
        pytest.skip(f"{missing} is not installed")
    out, err = children[group].communicate(timeout=TIMEOUT)
    assert children[group].returncode == 0, f"{group} child failed:\n{out[-5000:]}\n{err[-8000:]}"
    report = json.loads(out.strip().splitlines()[-1])
    assert report["trapped"] == [], "\n\n".join(report["trapped"])
    assert report["ran"] == want
    # the trap reached a binding made before it (tests/no_pickle_child.py: early_bindings)
    assert "pitstop_test_early_pickle.loads" in report["replaced"], report["replaced"]
