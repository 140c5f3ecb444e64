"""`pitstop diff` on what a real training state holds: RNG states of kilobytes as values."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

import pitstop

ROOT = Path(__file__).resolve().parents[3]


def test_a_large_value_that_differs_is_shown_in_one_short_line(tmp_path: Path) -> None:
    """Two steps of a state with `pitstop.RNG()`: the numpy and Python generator states
    (some 20 KB of numbers each) differ, and the text output printed them all on one line."""
    d = tmp_path / "ck"
    rng = np.random.default_rng(0)
    with pitstop.CheckpointManager(d, memory_tier=False) as mgr:
        for step in (1, 2):
            np.random.random(), rng.random()
            state = {"w": np.zeros(4), "rng": pitstop.RNG(), "big": list(range(step, 3000))}
            mgr.save(step, state).wait()
    args = [sys.executable, "-m", "pitstop.cli", "diff", str(d / "step_0000000001"),
            str(d / "step_0000000002")]
    p = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 1, p.stderr
    lines = p.stdout.splitlines()
    assert max(map(len, lines)) <= 240, [ln[:120] for ln in lines if len(ln) > 240]
    assert any(ln.startswith("value: rng: ") for ln in lines), lines
    assert any(ln.startswith("value: big: [1,2,3,") and "--json" in ln for ln in lines), lines
    # --json keeps each value whole
    p = subprocess.run([*args, "--json"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 1, p.stderr
    assert "2999" in json.dumps(json.loads(p.stdout))
