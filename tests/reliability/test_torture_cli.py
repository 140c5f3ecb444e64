"""``benchmarks/torture.py``: one ``scenario: trials, failures`` line per scenario, the
failures' descriptions after it, a markdown table on request, exit status 1 on a failure."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks import torture
from benchmarks.reliability import Result

ROOT = Path(__file__).resolve().parents[2]


def test_the_command_prints_a_line_per_scenario_and_a_table(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "torture.py"), "--only", "corruption",
         "--trials", "10", "--seed", "7", "--markdown", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "seed 7"
    assert lines[1].startswith("corruption: 10 trials, 0 failures, "), lines
    assert "| corruption | 10 | 0 |" in out.stdout
    assert list(tmp_path.iterdir()) == []  # its work directory is removed


def test_a_failure_is_printed_with_its_details_and_exits_1(monkeypatch, capsys):
    def broken(trials: int, seed: int, workdir: Path) -> Result:
        res = Result("broken", trials=trials)
        res.fail(f"trial 0 (seed {seed}): a promise broken on purpose")
        assert workdir.is_dir()
        return res

    def raises(trials: int, seed: int, workdir: Path) -> Result:
        raise RuntimeError("the scenario itself is broken")

    monkeypatch.setattr(torture, "scenarios",
                        lambda: {"broken": (broken, 3), "raises": (raises, 3)})
    assert torture.main(["--seed", "3"]) == 1
    out = capsys.readouterr().out
    assert "broken: 3 trials, 1 failures" in out
    assert "  - trial 0 (seed 3): a promise broken on purpose" in out
    assert "raises: 0 trials, 1 failures" in out and "RuntimeError" in out


def test_every_scenario_module_present_is_found_with_its_full_count():
    found = torture.scenarios()
    assert found["crash"][1] == 200 and found["corruption"][1] == 200
    for name, (fn, full) in found.items():
        assert callable(fn) and full > 0, name
