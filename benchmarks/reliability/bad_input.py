"""Bad input, counted: the property-based fuzzing of ``tests/core/format/test_fuzz.py`` (random and
mutated manifests, ``index.json`` files, memory-tier descriptions, ``restore`` targets) and
the named defects of ``tests/core/format/test_bad_input.py``, run with many more examples than the
suite's derandomized ones, drawn from the seed.

The promise: whatever a reader is given, only a ``CheckpointError`` escapes, nothing hangs,
nothing is allocated beyond the memory the checkpoint really needs, nothing is read outside
the checkpoint, and what is refused changes nothing. One trial is one example hypothesis
ran; a failure is a property hypothesis found broken (it prints the falsifying example).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from . import Result

ROOT = Path(__file__).resolve().parents[2]
#: the examples the suite runs once (the sum of the properties' max_examples)
BASE_EXAMPLES = 490
DEFAULT_TRIALS = {"bad_input": 10_000}


def bad_input(trials: int, seed: int, workdir: Path) -> Result:
    """Run the fuzzing properties with about ``trials`` examples in all (in a pytest process
    of their own), and count the examples and the broken properties."""
    r = Result("bad_input")
    scale = max(1, round(trials / BASE_EXAMPLES))
    env = dict(os.environ, PITSTOP_FUZZ_SCALE=str(scale),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"--basetemp={workdir / 'pytest'}", f"--hypothesis-seed={seed}",
         "--hypothesis-show-statistics", "tests/core/format/test_fuzz.py",
         "tests/core/format/test_bad_input.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    out = proc.stdout
    # hypothesis's statistics: "- 150 passing, 0 failing, and 19 invalid test cases" per phase
    counts = [(int(a), int(b)) for a, b in re.findall(r"(\d+) passing, (\d+) failing", out)]
    r.trials = sum(a + b for a, b in counts)
    r.bump("properties", len(re.findall(r"^tests/core/test_fuzz\.py::\S+:$", out, re.M)))
    failed = re.findall(r"^FAILED (\S+)", out, re.M)
    for name in failed:
        r.fail(f"seed {seed}, scale {scale}: {name} (pytest output has the falsifying example)")
    if proc.returncode not in (0, 1) or (proc.returncode == 1 and not failed):
        r.fail(f"seed {seed}: pytest ended with status {proc.returncode}: {out[-2000:]}"
               f"{proc.stderr[-2000:]}")
    named = re.search(r"(\d+) passed", out)
    r.bump("named_defect_and_property_tests_passed", int(named.group(1)) if named else 0)
    return r


SCENARIOS = {"bad_input": bad_input}
