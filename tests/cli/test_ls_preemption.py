"""``pitstop ls`` on a directory whose writer saved on preemption notices: the notice, the
step, when the save was durable and the margin before the deadline, read tolerantly from
``.pitstop/directory.json``'s ``"preemption"`` record (written here as the writer does)."""

from __future__ import annotations

import calendar
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import pitstop
from pitstop.core.directory.records import PreemptionSave, read_record
from pitstop.core.storage.local import LocalStorage

PY = sys.executable
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: 2026-12-02 17:00:01 UTC
NOTICED = calendar.timegm((2026, 12, 2, 17, 0, 1))


def notice(source: str, step: int, *, deadline: float | None, durable: float | None,
           expected: float | None = 1.5, fits: bool | None = True) -> dict:
    """One entry of the record, as the contract specifies it (times after NOTICED)."""
    return {"source": source, "noticed_unix": NOTICED, "step": step,
            "deadline_unix": None if deadline is None else NOTICED + deadline,
            "durable_unix": None if durable is None else NOTICED + durable,
            "expected_persist_s": expected, "fits": fits}


def run_dir(tmp_path, steps=(100, 120, 140), record=None) -> str:
    """A real checkpoint directory with ``steps`` committed and ``record`` as its
    ``"preemption"`` entry."""
    d = tmp_path / "run"
    with pitstop.CheckpointManager(str(d), memory_tier=False, save_on_signals=None) as m:
        for s in steps:
            m.save(s, {"w": np.full(4, float(s))}).wait()
    path = d / ".pitstop" / "directory.json"
    doc = json.loads(path.read_text())
    doc["preemption"] = record
    path.write_text(json.dumps(doc))
    return str(d)


def ls(*argv: str) -> str:
    env = dict(os.environ, TZ="UTC", PYTHONPATH=os.pathsep.join(
        [ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]))
    r = subprocess.run([PY, "-m", "pitstop.cli", "ls", *argv], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr
    return r.stdout


def test_ls_shows_each_save_on_a_notice_with_its_margin(tmp_path):
    """Durable before the deadline, after it (the expected persist time did not fit),
    failed, a SIGTERM without a deadline, and a step retention has deleted since."""
    d = run_dir(tmp_path, record=[
        notice("aws", 90, deadline=120.0, durable=2.0),
        notice("gce", 100, deadline=30.0, durable=4.25),
        notice("azure", 120, deadline=10.0, durable=13.1, expected=40.0, fits=False),
        notice("gce", 130, deadline=30.0, durable=None, expected=None, fits=None),
        notice("SIGTERM", 140, deadline=None, durable=0.5, expected=None, fits=None),
    ])
    lines = ls(d).splitlines()
    assert lines[-5:] == [
        "step 90: saved on a preemption notice from aws (at 2026-12-02 17:00:01), durable at "
        "17:00:03.0, 118.0 s before the deadline (no longer in the directory)",
        "step 100: saved on a preemption notice from gce (at 2026-12-02 17:00:01), durable at "
        "17:00:05.2, 25.8 s before the deadline",
        "step 120: saved on a preemption notice from azure (at 2026-12-02 17:00:01), durable "
        "at 17:00:14.1, 3.1 s after the deadline (17:00:11.0); its expected persist time "
        "(40.0 s, from earlier saves) did not fit before the deadline: saved by the fastest "
        "path",
        "step 130: saved on a preemption notice from gce (at 2026-12-02 17:00:01), failed: the "
        "save did not become durable (see the job's log)",
        "step 140: saved on SIGTERM (at 2026-12-02 17:00:01), durable at 17:00:01.5, no "
        "deadline given",
    ], "\n".join(lines)
    # a checkpoint's own path: its own notice only
    own = ls(os.path.join(d, "step_0000000100")).splitlines()
    assert [ln for ln in own if "saved on" in ln] == [lines[-4]], own


def test_ls_shows_the_newest_notices_and_counts_the_rest(tmp_path):
    d = run_dir(tmp_path, steps=range(100, 108), record=[
        notice("gce", s, deadline=30.0, durable=1.0) for s in range(100, 108)])
    lines = ls(d).splitlines()
    assert "(3 earlier saves on preemption notices recorded)" in lines
    shown = [ln.split(":")[0] for ln in lines if "preemption notice from gce" in ln]
    assert shown == [f"step {s}" for s in range(103, 108)]


@pytest.mark.parametrize("record", [
    None, "gce", {"source": "gce"}, [1, None, "x", [], {"step": 5}],
    [{"source": "gce", "noticed_unix": "soon", "step": 100},
     {"source": "gce", "noticed_unix": NOTICED, "step": True},
     {"source": 7, "noticed_unix": NOTICED, "step": 100}],
])
def test_a_damaged_record_shows_nothing_and_breaks_nothing(tmp_path, record):
    d = tmp_path / "d"
    d.mkdir()
    with pitstop.CheckpointManager(str(d), memory_tier=False, save_on_signals=None) as m:
        m.save(100, {"w": np.zeros(2)}).wait()
    path = d / ".pitstop" / "directory.json"
    doc = json.loads(path.read_text())
    doc["preemption"] = record
    path.write_text(json.dumps(doc))
    rec = read_record(LocalStorage(str(d), create=False))
    assert rec.preemption_saves() == []
    assert rec.naming().name(100) == "step_0000000100"  # the rest of it still read
    out = ls(str(d))
    assert "saved on" not in out and "1 checkpoint" in out, out


def test_the_reader_keeps_what_it_can_of_an_entry(tmp_path):
    """Odd optional fields read as not known; the entry stays."""
    got = PreemptionSave.from_json({"source": "aws", "noticed_unix": 10, "step": 3,
                                    "deadline_unix": "x", "durable_unix": 12.5,
                                    "expected_persist_s": [], "fits": "yes"})
    assert got == PreemptionSave("aws", 10.0, 3, None, 12.5, None, None)
    assert got.margin_s is None and got.line().endswith("no deadline given")
    late = PreemptionSave("gce", 0.0, 1, deadline_unix=30.0, durable_unix=31.5)
    assert late.margin_s == -1.5
