"""The CLI beside a live trainer: retention deleting the newest checkpoint between listing
and reading it is never reported as corruption or as "no checkpoint"."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import textwrap
import time

import pytest

from pitstop.cli import main

PY = sys.executable
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_TRAINER = textwrap.dedent("""
    import sys, numpy as np, pitstop
    with pitstop.CheckpointManager(sys.argv[1], save_every_steps=1, keep_last=1,
                                   on_busy="wait", durable=False, memory_tier=False) as mgr:
        state = {f"a{i}": np.ones(1024) for i in range(4)}
        for step in range(10**9):
            state["a0"][:] = step
            mgr.step(step, state)
            if step == 20:
                print("RUNNING", flush=True)
""")


@pytest.fixture
def live_run(tmp_path):
    d = tmp_path / "run"
    p = subprocess.Popen([PY, "-c", _TRAINER, str(d)], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    try:
        assert p.stdout.readline().strip() == "RUNNING"
        yield d
    finally:
        p.kill()
        p.wait()


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_the_cli_never_raises_a_false_alarm_while_a_trainer_writes(live_run):
    seen: dict = {}
    deadline = time.monotonic() + 20
    rounds = 0
    while time.monotonic() < deadline and rounds < 150:
        rounds += 1
        for argv in (["ls", str(live_run)], ["inspect", str(live_run)],
                     ["inspect", str(live_run), "--json"], ["verify", str(live_run)],
                     ["verify", str(live_run), "--all"]):
            rc, out, err = _cli(*argv)
            assert rc == 0, (argv, out, err)
            assert "unreadable" not in out and "CORRUPT" not in out, (argv, out)
            seen[argv[0]] = seen.get(argv[0], 0) + 1
    assert rounds >= 20 and set(seen) == {"ls", "inspect", "verify"}
