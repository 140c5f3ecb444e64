"""``pitstop run``: a real training job (numpy state, a CheckpointManager) supervised by the
real command, killed with real signals. Every wait is for a state a process wrote."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import pitstop

PY = sys.executable
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: the job: w <- w / 2 + sin(step + i) for each step (a wrong resume changes the result).
#: argv: STEPS KILLS WORK MODE; the directory is $PITSTOP_DIR, else WORK/ckpt.
#: KILLS: run i (counted in WORK/runs) SIGKILLs itself once step KILLS[i] is committed.
#: MODE "hold": start a child process in the job's group, then train slowly, forever,
#: saving only on a signal; WORK/ready appears once step 3 is done, WORK/last says the step
#: under way.
JOB = r'''
import os, signal, subprocess, sys, time
import numpy as np
import pitstop

steps, kills, work, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
kills = [int(k) for k in kills.split(",") if k]
counter = os.path.join(work, "runs")
run = int(open(counter).read()) if os.path.exists(counter) else 0
with open(counter, "w") as f:
    f.write(str(run + 1))
directory = os.environ.get("PITSTOP_DIR") or os.path.join(work, "ckpt")
if mode == "hold":
    child = subprocess.Popen([sys.executable, "-c", """
import os, signal, sys, time
work = sys.argv[1]
def on_term(signum, frame):
    open(os.path.join(work, "child-got-SIGTERM"), "w").close()
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
open(os.path.join(work, "child-ready"), "w").close()
while True:
    time.sleep(0.05)
""", work])
    while not os.path.exists(os.path.join(work, "child-ready")):
        time.sleep(0.01)
    with open(os.path.join(work, "job.pid"), "w") as f:
        f.write(str(os.getpid()))
state = {"w": np.zeros(64)}
mgr = pitstop.CheckpointManager(directory, save_every_steps=1000 if mode == "hold" else 1,
                                on_busy="wait")
restored = mgr.restore(state)
step = 0 if restored is None else restored + 1
while mode == "hold" or step < steps:
    with open(os.path.join(work, "last.tmp"), "w") as f:
        f.write(str(step))
    os.replace(os.path.join(work, "last.tmp"), os.path.join(work, "last"))
    w = state["w"]
    w *= 0.5
    w += np.sin(step + np.arange(64.0))
    mgr.step(step, state)
    if run < len(kills) and step == kills[run]:
        mgr.wait()
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "hold":
        if step == 3:
            open(os.path.join(work, "ready"), "w").close()
        time.sleep(0.01)
    step += 1
mgr.close()
np.save(os.path.join(work, "out.npy"), state["w"])
'''


def expected(last_step: int) -> np.ndarray:
    w = np.zeros(64)
    for step in range(last_step + 1):
        w *= 0.5
        w += np.sin(step + np.arange(64.0))
    return w


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(JOB)
    return str(path)


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in ("PITSTOP_DIR", "PITSTOP_SUPERVISOR")}
    # the job is a script: it imports the pitstop of this tree as the command does
    path = [ROOT, *filter(None, [e.get("PYTHONPATH")])]
    e.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path), **extra)
    return e


def supervise(*argv: str, **kw) -> subprocess.Popen[str]:
    return subprocess.Popen([PY, "-m", "pitstop.cli", "run", *argv], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=kw.pop("env", None) or env(), **kw)


@pytest.fixture
def here(capfd, monkeypatch):
    """``pitstop run`` in this process (the jobs it runs are real processes, with real
    signals): saves the start of an interpreter per call. Returns (status, stdout, stderr)."""
    from pitstop.cli import main

    for name in ("PITSTOP_DIR", "PITSTOP_SUPERVISOR"):
        monkeypatch.delenv(name, raising=False)

    def call(*argv: str) -> subprocess.CompletedProcess[str]:
        capfd.readouterr()
        status = main(["run", *argv])
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(argv, status, out, err)

    return call


def wait_for(path, what: str, proc: subprocess.Popen[str] | None = None,
             timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the supervisor exited ({proc.returncode}) before {what}: "
                                 f"{proc.communicate()[1]}")
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.02)


def gone(pid: int) -> bool:
    """``pid`` has exited (a zombie no one reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return True
    return raw[raw.rfind(b")") + 2:].split()[0] == b"Z"


def test_sigkilled_job_is_restarted_until_it_finishes_bitwise_equal(job, tmp_path, here,
                                                                   monkeypatch):
    """Killed by SIGKILL after steps 3 and 6: restarted twice, each restart reported with
    the step it resumed from; the directory is the one the job's manager reports."""
    for k, v in env().items():  # the job's environment, as run() gives it
        if os.environ.get(k) != v:
            monkeypatch.setenv(k, v)
    work = tmp_path / "w"
    work.mkdir()
    r = here("--backoff", "0", "--", PY, job, "10", "3,6", str(work), "train")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("pitstop run:")]
    assert re.search(r"job exited with signal SIGKILL .*after [\d.]+ s; newest checkpoint: "
                     r"step 3; restarting in 0.0 s \(restart 1 of 3\)", r.stderr), r.stderr
    assert "pitstop run: restart 1 resumed from step 3" in lines, r.stderr
    assert "newest checkpoint: step 6; restarting in 0.0 s (restart 2 of 3)" in r.stderr
    assert "pitstop run: restart 2 resumed from step 6" in lines, r.stderr
    assert lines[-1] == "pitstop run: job finished (exit status 0) after 2 restarts", r.stderr
    assert (work / "runs").read_text() == "3"
    # what an uninterrupted run of the job ends with, bit for bit
    assert np.load(work / "out.npy").tobytes() == expected(9).tobytes()


def test_crash_loop_stops_with_the_jobs_status(tmp_path, here):
    """A job that dies before committing anything: stopped after --crash-loop failures,
    with the job's status, though --max-restarts would allow more."""
    d = tmp_path / "ckpt"
    r = here("--dir", str(d), "--backoff", "0", "--max-restarts", "-1", "--",
            "sh", "-c", 'echo x >> "$0"; kill -9 $$', str(tmp_path / "runs"))
    assert r.returncode == 128 + 9, r.stderr
    assert (tmp_path / "runs").read_text() == "x\n" * 3
    last = r.stderr.splitlines()[-1]
    assert last.startswith("pitstop run: crash loop: 3 failures in a row without a new "
                           "checkpoint; last exit: signal SIGKILL"), r.stderr
    assert last.endswith("no committed checkpoint yet; look at the job's output above")
    assert "(restart 2)" in r.stderr and "(restart 3)" not in r.stderr


def test_usage_error_sigterm_and_success_are_not_restarted(tmp_path, here):
    r = here("--", "sh", "-c", "exit 2")
    assert r.returncode == 2
    assert len(r.stderr.splitlines()) == 1 and "--no-restart-on: not restarting" in r.stderr
    r = here("--", "sh", "-c", "kill -TERM $$")  # stopped on purpose, not by the supervisor
    assert r.returncode == 128 + signal.SIGTERM
    assert len(r.stderr.splitlines()) == 1 and "on purpose" in r.stderr, r.stderr
    r = here("--", "sh", "-c", "echo done")
    assert (r.returncode, r.stdout, r.stderr) == (0, "done\n", "")


def test_command_not_found_is_one_line_127(tmp_path, here):
    r = here("--", str(tmp_path / "no-such-command"), "--epochs", "3")
    assert r.returncode == 127
    assert r.stderr == (f"pitstop run: cannot start {tmp_path / 'no-such-command'}: no such "
                        "file or command (check the name and PATH)\n")
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\n")
    r = here("--", str(script))
    assert r.returncode == 126 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "cannot start" in r.stderr and "ermission denied" in r.stderr


@pytest.mark.parametrize("argv, says", [
    ([], "no command given; put it after --"),
    (["--backoff", "-1", "--", "true"], "--backoff -1: give a number of seconds"),
    (["--max-restarts", "-2", "--", "true"], "--max-restarts -2"),
    (["--no-restart-on", "x", "--", "true"], "--no-restart-on 'x'"),
])
def test_bad_arguments_are_one_line_status_2(argv, says, capsys):
    from pitstop.cli import main

    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("pitstop: run: ") and says in err


@pytest.mark.parametrize("forward", ["first", "group"])
def test_sigterm_is_forwarded_to_the_group_and_the_job_saves(job, tmp_path, forward):
    """SIGUSR1 reaches the job's first process only: it saves and trains on. SIGTERM to the
    supervisor reaches the job and its child (--forward first: the child once the job has
    exited); the job's manager saves the step it was at and exits; no restart; the
    supervisor exits with the job's status."""
    work = tmp_path / "w"
    work.mkdir()
    d = tmp_path / "ckpt-given"
    p = supervise("--dir", str(d), "--forward", forward, "--", PY, job, "0", "", str(work),
                  "hold")
    try:
        wait_for(work / "ready", "the job's step 3", p)
        p.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 60
        while len([n for n in os.listdir(d) if os.path.exists(d / n / "manifest.json")]) < 2:
            assert time.monotonic() < deadline and p.poll() is None, "no save on SIGUSR1"
            time.sleep(0.02)
        usr1 = int((work / "last").read_text())  # at least the step it saved
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            os.killpg(int((work / "job.pid").read_text()), signal.SIGKILL)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert (work / "child-got-SIGTERM").exists()
    assert (work / "runs").read_text() == "1"
    assert ("pitstop run: SIGTERM forwarded to the job's processes" if forward == "group" else
            "pitstop run: SIGTERM forwarded to the job (") in err, err
    assert err.splitlines()[-1] == ("pitstop run: job exited with signal SIGTERM after "
                                    "SIGTERM; not restarting it"), err
    last = int((work / "last").read_text())
    with pitstop.CheckpointManager(str(d), read_only=True) as m:  # --dir reached the job
        # step 0 (the policy's first save), the one of SIGUSR1, and the step it was at when
        # SIGTERM came
        steps = m.all_steps()
        assert len(steps) == 3 and steps[0] == 0 and 3 < steps[1] <= usr1 and steps[2] == last
        assert last > steps[1], "the job trained on after SIGUSR1"
        assert m.load()["w"].tobytes() == expected(last).tobytes()


def test_sigkilled_supervisor_leaves_no_job_behind(job, tmp_path):
    """The supervisor dies of SIGKILL: its job gets SIGTERM (PR_SET_PDEATHSIG), saves and
    exits rather than run on orphaned."""
    work = tmp_path / "w"
    work.mkdir()
    p = supervise("--", PY, job, "0", "", str(work), "hold")
    try:
        wait_for(work / "ready", "the job's step 3", p)
        pid = int((work / "job.pid").read_text())
        p.kill()
        p.wait(timeout=30)  # (its pipes: the job holds them while it runs)
        deadline = time.monotonic() + 60
        while not gone(pid):
            assert time.monotonic() < deadline, "the job runs on without its supervisor"
            time.sleep(0.02)
    finally:
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            os.killpg(int((work / "job.pid").read_text()), signal.SIGKILL)
        p.stdout.close()
        p.stderr.close()
    last = int((work / "last").read_text())
    with pitstop.CheckpointManager(str(work / "ckpt"), read_only=True) as m:
        assert m.all_steps() == [0, last] and last > 3


@pytest.mark.parametrize("how", ["second signal", "grace"])
def test_a_job_that_does_not_exit_is_killed(tmp_path, how):
    """A job that ignores SIGTERM: SIGKILLed at a second stop signal, or after --grace."""
    ready = tmp_path / "ready"
    p = supervise("--grace", "inf" if how == "second signal" else "0.2", "--",
                  "sh", "-c", 'trap "" TERM; touch "$0"; while :; do sleep 0.05; done',
                  str(ready))
    try:
        wait_for(ready, "the job's start", p)
        p.send_signal(signal.SIGTERM)
        if how == "second signal":
            assert "SIGTERM forwarded to the job" in p.stderr.readline()
            p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            p.kill()
    assert p.returncode == 128 + signal.SIGKILL, err
    why = "SIGINT received again" if how == "second signal" else \
        "the job did not exit within --grace 0.2 s of SIGTERM"
    assert f"pitstop run: {why}: killing it (SIGKILL to all its processes)" in err, err
    assert err.splitlines()[-1].startswith("pitstop run: job exited with signal SIGKILL")


def test_manager_reports_to_the_supervisor_and_never_fails(tmp_path, monkeypatch):
    """The hook: one JSON line per open and per restore/load; a file that cannot be written
    (gone, a directory) changes nothing for the manager."""
    import json

    events = tmp_path / "events.jsonl"
    events.write_bytes(b"")
    state = {"w": np.arange(4.0)}
    for where in (tmp_path / "missing", tmp_path, events):  # the last one works
        monkeypatch.setenv("PITSTOP_SUPERVISOR", str(where))
        d = tmp_path / f"ckpt-{where.name}"
        with pitstop.CheckpointManager(str(d)) as m:
            assert m.restore(state) is None
            m.save(5, state)
        with pitstop.CheckpointManager(str(d)) as m:
            assert m.restore(state) == 5
            assert m.load()["w"].tobytes() == state["w"].tobytes()
    assert not (tmp_path / "missing").exists()
    got = [json.loads(line) for line in events.read_text().splitlines()]
    assert [(e["event"], e.get("step")) for e in got] == [
        ("open", None), ("restore", None), ("open", None), ("restore", 5), ("restore", 5)]
    assert {e["dir"] for e in got} == {str(tmp_path / "ckpt-events.jsonl")}
    assert {e["pid"] for e in got} == {os.getpid()} and not any(e["read_only"] for e in got)


def test_max_restarts_and_the_processes_a_job_leaves_behind(tmp_path, here, monkeypatch):
    """Given up after --max-restarts with the job's status. The job's first process exits, a
    child of it runs on in its group: a second later (here 0.1 s: it never exits on its
    own) it is SIGKILLed, said in one line (it would hold the lock and the GPU in a
    restart)."""
    from pitstop.cli import run as run_module

    monkeypatch.setattr(run_module, "LEFTOVER_WAIT", 0.1)
    pidfile = tmp_path / "child.pid"
    r = here("--max-restarts", "0", "--", "sh", "-c", 'sleep 300 & echo $! > "$0"; exit 5',
             str(pidfile))
    assert r.returncode == 5, r.stderr
    child = int(pidfile.read_text())
    assert f"pitstop run: the job's leader exited; killing its remaining processes ({child})" \
        in r.stderr, r.stderr
    assert gone(child)
    last = r.stderr.splitlines()[-1]
    assert last.startswith("pitstop run: job exited with status 5 after ")
    assert last.endswith("giving up after 0 restarts (--max-restarts 0)")
