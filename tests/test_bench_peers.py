"""benchmarks/bench_peers.py keeps working: a smoke run prints the table with its columns and
finite figures, and the table's ratios are what they say.

Speed itself is never asserted here (benchmarks/ measures it): a 1 MiB state, pitstop only,
one rep, each step in its own process, as the full run does it.
"""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ["size", "peer", "stall", "lost / save", "lost / save (passes)", "save → durable",
           "restore warm", "restore cold", "peak mem", "retained mem", "disk", "bg CPU-s/GiB",
           "numpy rate", "notes"]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_peers",
                                                  ROOT / "benchmarks" / "bench_peers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _table(text: str) -> list[list[str]]:
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    assert [c.strip() for c in lines[0].strip("|").split("|")] == COLUMNS
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]


def test_quick_run_prints_the_table_with_finite_figures(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "out.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_peers.py"), "--quick", "--sizes", "1M",
         "--peers", "pitstop", "--reps", "1", "--lost-seconds", "0",
         "--workdir", str(tmp_path / "w"), "--json", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = _table(r.stdout)
    assert row[:2] == ["1M", "pitstop"] and len(row) == len(COLUMNS), row
    for c in row[2:-1]:  # "ratio to floor · ratio to best peer" (no peer ran: "—")
        assert math.isfinite(float(c.split("·")[0])), (row, c)
    assert "failed" not in row[-1] and "MISMATCH" not in row[-1], row
    assert "floors: memcpy" in r.stdout
    (size,) = json.loads(out.read_text())["sizes"]
    assert all(math.isfinite(v) and v > 0 for v in size["floors"].values())
    (res,) = size["rows"]
    assert res["restored_ok"] is True
    for k in ("stall_s", "commit_s", "lost_s", "restore_warm_s", "restore_cold_s",
              "lost_passes_s", "write_floor_interleaved_s", "bg_cpu_s_per_gib", "numpy_rate"):
        assert math.isfinite(res[k]), k
    assert res["numpy_rate"] > 0 and res["write_floor_interleaved_s"] > 0
    assert res["pass_threads"] >= 1
    assert res["commit_s"] >= res["stall_s"] > 0
    assert res["disk_bytes"] >= 1 << 20


def test_cells_are_ratios_to_the_floor_and_to_the_best_peer_without_pitstop() -> None:
    bench = _bench()
    spec = bench.spec_of("64M")
    floors = {"memcpy": 0.1, "write": 1.0, "read_warm": 0.2, "read_cold": 1.0}

    def row(peer: str, stall: float) -> dict:
        return {"peer": peer, "state_bytes": spec["bytes"], "stall_s": stall, "lost_s": stall,
                "commit_s": 2.0, "restore_warm_s": 0.4, "restore_cold_s": 1.0,
                "peak_mem": spec["bytes"], "retained_mem": 0, "disk_bytes": spec["bytes"],
                "lost_passes_s": stall, "bg_cpu_s_per_gib": 1.234, "numpy_rate": 0.5}

    rows = [row("torch.save", 0.4), row("dcp.save", 0.2), row("pitstop", 0.05)]
    rows[2]["write_floor_interleaved_s"] = 4.0  # its own floor, taken between its saves
    results = {"facts": {"cpus": "2"}, "command": "x", "elapsed_s": 1.0, "extra": [],
               "sizes": [{"spec": spec, "floors": floors, "rows": rows,
                          "best": bench.best_of(rows)}]}
    table = {r[1]: r for r in _table(bench.render(results))}
    assert table["pitstop"][2] == "0.50 · 0.25"  # 0.05 s / memcpy 0.1 s; / dcp.save's 0.2 s
    assert table["torch.save"][2] == "4.00 · 2.00"
    assert table["pitstop"][4] == "0.50 · 0.25"  # lost / save (passes), the same floors
    assert table["dcp.save"][5] == "2.00 · 1.00"  # save -> durable / write + fsync
    assert table["pitstop"][5] == "0.50 · 1.00"  # ... / the row's own interleaved floor
    assert table["dcp.save"][9] == "0.00 · —"  # a best of zero has no ratio
    assert table["pitstop"][11:13] == ["1.23", "0.50"]  # bg CPU-s/GiB, numpy rate: as they are
