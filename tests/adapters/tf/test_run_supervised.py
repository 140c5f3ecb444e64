"""`pitstop run` over a tf.train-style job: the supervisor sees its resume."""

from __future__ import annotations

import json
import sys
import textwrap

import tensorflow as tf

from pitstop.adapters.tf import Checkpoint, CheckpointManager
from pitstop.cli import main

# what `ckpt.restore(latest_checkpoint(d))` then `CheckpointManager(ckpt, d)` does to the
# directory (a read-only manager restores, then a writer opens), without TensorFlow's import
# in the job (seconds)
JOB = textwrap.dedent("""
    import sys
    import pitstop
    d = sys.argv[1]
    naming = dict(step_prefix="ckpt-", step_digits=0)
    pitstop.CheckpointManager(d, read_only=True, **naming).load(4)
    pitstop.CheckpointManager(d, **naming).close()
""")


def test_restore_before_the_manager_is_reported_as_the_resume(tmp_path, capfd):
    """`ckpt.restore(latest_checkpoint(d))` before `CheckpointManager(ckpt, d)` reads through
    a read-only manager, whose reports the supervisor skipped: no "resumed from" line."""
    d = str(tmp_path / "run")
    ckpt = Checkpoint(w=tf.Variable(tf.fill([2], 3.0)))
    mgr = CheckpointManager(ckpt, d, max_to_keep=2)
    mgr.save(checkpoint_number=4)
    mgr.close()
    script = tmp_path / "job.py"
    script.write_text(JOB)
    capfd.readouterr()
    assert main(["run", "--backoff", "0", "--", sys.executable, str(script), d]) == 0
    err = capfd.readouterr().err
    assert "pitstop run: job resumed from step 4" in err, err


def test_restore_or_initialize_reports_a_fresh_start(tmp_path, monkeypatch):
    """With nothing to restore, `restore_or_initialize()` told `pitstop run` nothing: a
    restart had no "started from scratch" line (a plain manager's restore() says so)."""
    events = tmp_path / "events.jsonl"
    events.write_text("")
    monkeypatch.setenv("PITSTOP_SUPERVISOR", str(events))
    mgr = CheckpointManager(Checkpoint(w=tf.Variable(1.0)), str(tmp_path / "run"),
                            max_to_keep=1)
    assert mgr.restore_or_initialize() is None
    mgr.close()
    told = [json.loads(line) for line in events.read_text().splitlines()]
    assert [(e["event"], e.get("step")) for e in told if e["event"] == "restore"] == \
        [("restore", None)], told
