"""``pitstop run``'s preemption options and Slurm's requeue: a real job (numpy state, a
CheckpointManager that saves on SIGUSR1) under the real command, a fake ``scontrol`` on
PATH, real signals. Every wait is for a state a process wrote."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from test_run import expected  # the same job arithmetic as test_run.py's

import pitstop

PY = sys.executable
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB_ID = "4242"

#: the job: w <- w / 2 + sin(step + i) for STEPS steps, resumed from $PITSTOP_DIR. A first
#: Slurm run (no SLURM_RESTART_COUNT) trains slowly, so that signals find it training;
#: WORK/ready appears once step 3 is done, WORK/last says the step under way, WORK/env.json
#: what the supervisor set in its environment. It saves on SIGUSR1 and SIGTERM (pitstop's
#: default signals) and every 100000 steps (the first step only).
JOB = r'''
import json, os, sys, time
import numpy as np
import pitstop

steps, work = int(sys.argv[1]), sys.argv[2]
with open(os.path.join(work, "env.json"), "w") as f:
    json.dump({k: v for k, v in os.environ.items() if k.startswith(("PITSTOP_", "SLURM_"))}, f)
slow = not os.environ.get("SLURM_RESTART_COUNT")
state = {"w": np.zeros(64)}
mgr = pitstop.CheckpointManager(os.environ["PITSTOP_DIR"], save_every_steps=100000,
                                on_busy="wait")
restored = mgr.restore(state)
step = 0 if restored is None else restored + 1
while step < steps:
    with open(os.path.join(work, "last.tmp"), "w") as f:
        f.write(str(step))
    os.replace(os.path.join(work, "last.tmp"), os.path.join(work, "last"))
    w = state["w"]
    w *= 0.5
    w += np.sin(step + np.arange(64.0))
    mgr.step(step, state)
    if step == 3:
        open(os.path.join(work, "ready"), "w").close()
    if slow:
        time.sleep(0.01)
    step += 1
mgr.close()
np.save(os.path.join(work, "out.npy"), state["w"])
'''

#: the fake scontrol: records its argv and the checkpoint directory's committed steps then
#: (SCONTROL_LOG), and exits with SCONTROL_STATUS, saying why on stderr when not 0
SCONTROL = r'''#!/bin/sh
{ echo "$@"; for m in "$PITSTOP_DIR"/step_*/manifest.json; do [ -e "$m" ] && echo "$m"; done; } \
    > "$SCONTROL_LOG.tmp"
mv "$SCONTROL_LOG.tmp" "$SCONTROL_LOG"
if [ "${SCONTROL_STATUS:-0}" != 0 ]; then
    echo "slurm_requeue error: Requested operation is presently disabled for job $2" >&2
fi
exit "${SCONTROL_STATUS:-0}"
'''


@pytest.fixture
def slurm(tmp_path):
    """(the job's path, its work folder, its checkpoint directory, the environment of a
    Slurm job with the fake scontrol on PATH, the file scontrol writes)."""
    job = tmp_path / "job.py"
    job.write_text(JOB)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(SCONTROL)
    scontrol.chmod(0o755)
    work = tmp_path / "w"
    work.mkdir()
    d = tmp_path / "ckpt"
    log = tmp_path / "scontrol.log"
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("PITSTOP_", "SLURM_"))}
    path = [ROOT, *filter(None, [e.get("PYTHONPATH")])]
    e.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path), SLURM_JOB_ID=JOB_ID,
             PATH=f"{bin_dir}{os.pathsep}{e.get('PATH', '')}", SCONTROL_LOG=str(log),
             PITSTOP_DIR=str(d))
    return str(job), work, d, e, log


def supervise(env: dict[str, str], *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen([PY, "-m", "pitstop.cli", "run", *argv], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def wait_for(path, what: str, proc: subprocess.Popen[str], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise AssertionError(f"the supervisor exited ({proc.returncode}) before {what}: "
                                 f"{proc.communicate()[1]}")
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.02)


def committed(d) -> list[int]:
    with pitstop.CheckpointManager(str(d), read_only=True) as m:
        return m.all_steps()


@contextlib.contextmanager
def ended(p: subprocess.Popen[str]):
    try:
        yield
    finally:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.communicate(timeout=30)


def test_requeue_after_the_save_on_sigusr1_and_the_requeued_job_resumes(slurm):
    """Slurm's SIGUSR1 (``--signal=B:USR1@N``): the job saves and trains on; once that save
    is committed, ``scontrol requeue $SLURM_JOB_ID``; Slurm's SIGTERM then ends the run (a
    save of the step it was at), and the same command, started again as Slurm does
    (SLURM_RESTART_COUNT=1), resumes and ends bitwise equal to an uninterrupted run."""
    job, work, d, env, log = slurm
    command = ["--requeue", "--", PY, job, "3000", str(work)]
    p = supervise(env, *command)
    with ended(p):
        wait_for(work / "ready", "the job's step 3", p)
        p.send_signal(signal.SIGUSR1)
        wait_for(log, "scontrol requeue", p)
        argv, *manifests = log.read_text().splitlines()
        assert argv == f"requeue {JOB_ID}"
        # it ran once the save on SIGUSR1 was committed: step 0's and that one
        assert len(manifests) == 2, manifests
        usr1 = committed(d)[1]
        assert 3 < usr1 <= int((work / "last").read_text())
        p.send_signal(signal.SIGTERM)  # Slurm ends the requeued run
        _, err = p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "pitstop run: SIGUSR1 forwarded to the job's first process" in err, err
    assert re.search(rf"pitstop run: step {usr1} is committed: Slurm job {JOB_ID} requeued "
                     rf"\(`scontrol requeue {JOB_ID}`\)", err), err
    assert err.splitlines()[-1] == ("pitstop run: job exited with signal SIGTERM after "
                                    "SIGTERM; not restarting it"), err
    steps = committed(d)
    assert len(steps) == 3 and steps[1] == usr1 < steps[2], steps
    assert not (work / "out.npy").exists()

    env.update(SLURM_RESTART_COUNT="1")  # Slurm starts the requeued job again
    log.unlink()
    again = supervise(env, *command)
    with ended(again):
        _, err = again.communicate(timeout=30)
    assert again.returncode == 0, err
    assert f"pitstop run: job resumed from step {steps[2]}" in err.splitlines(), err
    assert not log.exists(), "requeued without a SIGUSR1"
    assert np.load(work / "out.npy").tobytes() == expected(2999).tobytes()


def test_a_failed_scontrol_is_said_with_its_stderr_and_supervision_goes_on(slurm):
    """scontrol exits 1: its stderr is in the supervisor's log, the job trains on (not
    requeued, so a crash would still be restarted) until SIGTERM."""
    job, work, d, env, log = slurm
    env["SCONTROL_STATUS"] = "1"
    p = supervise(env, "--requeue", "--", PY, job, "3000", str(work))
    with ended(p):
        wait_for(work / "ready", "the job's step 3", p)
        p.send_signal(signal.SIGUSR1)
        wait_for(log, "scontrol requeue", p)
        at = int((work / "last").read_text())
        deadline = time.monotonic() + 30
        while int((work / "last").read_text()) < at + 5:  # it trains on
            assert time.monotonic() < deadline and p.poll() is None, "the job stopped"
            time.sleep(0.02)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert re.search(rf"pitstop run: `scontrol requeue {JOB_ID}` \(step \d+ is committed\) "
                     r"failed with status 1: slurm_requeue error: Requested operation is "
                     rf"presently disabled for job {JOB_ID}; the job is not requeued", err), err
    assert "requeued (" not in err


def test_options_reach_the_job_and_grace_seconds_is_the_kill_wait(slurm):
    """--preemption, --preemption-exit and --grace-seconds are in the job's environment;
    without --grace, the supervisor waits --grace-seconds after SIGTERM before SIGKILL."""
    job, work, d, env, log = slurm
    p = supervise(env, "--preemption", "GCE, aws,gce", "--preemption-exit", "--grace-seconds",
                  "45", "--", PY, job, "1", str(work))
    with ended(p):
        _, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    got = json.loads((work / "env.json").read_text())
    assert (got["PITSTOP_PREEMPTION"], got["PITSTOP_PREEMPTION_EXIT"],
            got["PITSTOP_GRACE_SECONDS"]) == ("gce,aws", "1", "45")
    ready = work / "ignores-term"
    p = supervise(env, "--grace-seconds", "0.3", "--", "sh", "-c",
                  'trap "" TERM; touch "$0"; while :; do sleep 0.05; done', str(ready))
    with ended(p):
        wait_for(ready, "the job's start", p)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGKILL, err
    assert "pitstop run: the job did not exit within --grace 0.3 s of SIGTERM: killing it" \
        in err, err


def test_a_job_that_exits_before_its_save_commits_is_requeued_then_not_restarted(slurm):
    """The job dies (status 3) after SIGUSR1, before a new step commits: requeued at its
    exit, and not restarted by pitstop run (Slurm starts it again)."""
    job, work, d, env, log = slurm
    ready = work / "ready"
    p = supervise(env, "--requeue", "--dir", str(d), "--", "sh", "-c",
                  'trap "exit 3" USR1; touch "$0"; while :; do sleep 0.05; done', str(ready))
    with ended(p):
        wait_for(ready, "the job's start", p)
        p.send_signal(signal.SIGUSR1)
        _, err = p.communicate(timeout=30)
    assert p.returncode == 3, err
    assert log.read_text().splitlines()[0] == f"requeue {JOB_ID}"
    assert f"pitstop run: the job exited (status 3): Slurm job {JOB_ID} requeued" in err, err
    assert err.splitlines()[-1] == (f"pitstop run: job exited with status 3; Slurm job "
                                    f"{JOB_ID} is requeued: not restarting it (Slurm starts "
                                    "it again)"), err


@pytest.mark.parametrize("argv, unset, says", [
    (["--requeue"], "SLURM_JOB_ID", "--requeue requeues a Slurm job and SLURM_JOB_ID is not "
     "set: run pitstop run inside a Slurm job (sbatch), or drop --requeue"),
    (["--requeue"], "PATH", "scontrol is not on PATH: add Slurm's bin directory to PATH, or "
     "drop --requeue"),
    (["--preemption", "gce,gpc"], None, "--preemption 'gce,gpc': not a notice source: gpc; "
     "give auto, or some of gce, aws, azure"),
    (["--grace-seconds", "-5"], None, "--grace-seconds -5: give the seconds a SIGTERM leaves"),
    (["--grace-seconds", "nan"], None, "--grace-seconds nan"),
])
def test_bad_preemption_arguments_are_one_line_status_2(argv, unset, says, slurm, capsys,
                                                        monkeypatch):
    from pitstop.cli import main

    _job, _work, _d, env, _log = slurm
    monkeypatch.setenv("SLURM_JOB_ID", JOB_ID)
    monkeypatch.setenv("PATH", env["PATH"])
    if unset == "PATH":
        monkeypatch.setenv("PATH", os.path.dirname(PY))  # no scontrol there
    elif unset:
        monkeypatch.delenv(unset)
    assert main(["run", *argv, "--", "true"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("pitstop: run: ") and says in err, err
