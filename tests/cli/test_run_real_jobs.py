"""``pitstop run`` and its hook, attacked as a user running real jobs would (issue 16
probes). Real processes, real signals, real files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pitstop.core.runtime import supervised

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_the_hook_writes_only_to_a_regular_file_it_does_not_reach_through_a_link(
        tmp_path, monkeypatch):
    """PITSTOP_SUPERVISOR inherited by a process that outlives its supervisor names a path
    in a removed private directory; whatever is found there later (a symlink to a user's
    file, a FIFO, a terminal) is not written to."""
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    (tmp_path / "link").symlink_to(victim)
    os.mkfifo(tmp_path / "fifo")
    reader = os.open(tmp_path / "fifo", os.O_RDONLY | os.O_NONBLOCK)  # a write would succeed
    try:
        for name in ("link", "fifo"):
            monkeypatch.setenv(supervised.ENV, str(tmp_path / name))
            supervised.report("open", dir="/somewhere")
        assert victim.read_text() == "mine\n"
        assert os.read(reader, 100) == b""  # nothing was written to the FIFO
    finally:
        os.close(reader)
    events = tmp_path / "events.jsonl"
    events.write_bytes(b"")
    monkeypatch.setenv(supervised.ENV, str(events))
    supervised.report("open", dir="/somewhere")
    assert b'"dir":"/somewhere"' in events.read_bytes()  # the real one still works


#: a job that holds at step 3 until WORK/go exists; the directory is WORK/ckpt
HOLDING_JOB = r'''
import os, sys, time
import numpy as np
import pitstop
work = sys.argv[1]
state = {"w": np.zeros(8)}
with pitstop.CheckpointManager(os.path.join(work, "ckpt"), save_every_steps=1000) as mgr:
    for step in range(100):
        state["w"] += 1
        if step == 3:
            print("ready", os.getpid(), flush=True)
            while not os.path.exists(os.path.join(work, "go")):
                time.sleep(0.01)
        mgr.step(step, state)
'''


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in ("PITSTOP_DIR", "PITSTOP_SUPERVISOR")}
    e.update(PYTHONPATH=os.pathsep.join([ROOT, *filter(None, [e.get("PYTHONPATH")])]))
    return e


def read_until(stream, text: str, seen: list[str]) -> None:
    for line in stream:
        seen.append(line)
        if text in line:
            return
    raise AssertionError(f"no {text!r} in: {''.join(seen)}")


def test_a_scheduler_signalling_every_process_still_gets_the_save(tmp_path):
    """scancel, a preemption or a time limit SIGTERMs every process of the job: its
    training process gets SIGTERM from Slurm and again from the supervisor's forward. The
    second was taken for an insisting user: the job exited at once, nothing saved, 143."""
    (tmp_path / "job.py").write_text(HOLDING_JOB)
    p = subprocess.Popen([sys.executable, "-m", "pitstop.cli", "run", "--", sys.executable,
                          str(tmp_path / "job.py"), str(tmp_path)], cwd=ROOT, env=env(),
                         text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen: list[str] = []
    try:
        job = int(p.stdout.readline().split()[1])
        os.kill(job, signal.SIGTERM)  # Slurm's, to the training process
        read_until(p.stderr, "SIGTERM received; saving at the next step boundary", seen)
        p.send_signal(signal.SIGTERM)  # Slurm's, to the supervisor: forwarded to the job
        read_until(p.stderr, "pitstop: SIGTERM again, under pitstop run", seen)
        (tmp_path / "go").touch()
        rest = p.communicate(timeout=60)[1]
    finally:
        if p.poll() is None:
            p.kill()
    err = "".join(seen) + rest
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "saved step 3 after SIGTERM" in err, err
    assert (tmp_path / "ckpt" / "step_0000000003").is_dir(), err


def test_a_job_locked_out_by_another_writer_makes_no_progress(tmp_path, capfd, monkeypatch):
    """A second `pitstop run` on a directory another job writes: its job fails at once with
    DirectoryLockedError, while the directory's newest step grows (the other writer's).
    That counted as progress: the back-off stayed at --backoff and the crash-loop rule never
    stopped it (with --max-restarts -1: restarts forever)."""
    import threading

    import numpy as np

    import pitstop
    from pitstop.cli import main

    for name in ("PITSTOP_DIR", "PITSTOP_SUPERVISOR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]))
    d = tmp_path / "ckpt"
    done = threading.Event()
    with pitstop.CheckpointManager(str(d), save_on_signals=None) as other:
        def train() -> None:  # the other job: a new step every few milliseconds
            step = 0
            while not done.is_set():
                other.save(step, {"w": np.zeros(4)}).wait()
                step += 1
                time.sleep(0.02)

        t = threading.Thread(target=train)
        t.start()
        try:
            status = main(["run", "--dir", str(d), "--backoff", "0", "--max-restarts", "2",
                           "--crash-loop", "2", "--", sys.executable, "-c",
                           f"import pitstop; pitstop.CheckpointManager({str(d)!r})"])
        finally:
            done.set()
            t.join()
    err = capfd.readouterr().err
    assert status == 1, err
    assert err.count("is in use by another writer") == 2, err
    assert "crash loop: 2 failures in a row" in err, err


#: run 0 commits steps 0 and 1; run 1 finds step 1 damaged (moved aside, resumes from 0),
#: commits a new step 1; both die of SIGKILL; run 2 finishes
CORRUPTED_JOB = r'''
import glob, os, signal, numpy as np, pitstop
d, run = os.environ["PITSTOP_DIR"], int(os.environ["PITSTOP_RESTART"])
if run == 1:  # the newest checkpoint rotted on disk since
    for f in glob.glob(os.path.join(d, "step_0000000001", "data-*.bin")):
        with open(f, "r+b") as fh:
            fh.write(b"\xff" * 8)
with pitstop.CheckpointManager(d, save_every_steps=1, on_busy="wait") as mgr:
    state = {"w": np.arange(100.0)}
    start = mgr.restore(state)
    start = 0 if start is None else start + 1
    for step in range(start, 2):
        mgr.step(step, state)
    mgr.wait()
    if run < 2:
        os.kill(os.getpid(), signal.SIGKILL)
'''


def test_a_run_that_resumed_below_a_corrupt_newest_step_and_committed_made_progress(
        tmp_path, capfd, monkeypatch):
    """The newest step (1) found corrupt and moved aside: the run resumes from 0 and commits
    a new step 1. The supervisor compared with the newest step before the run (1, the
    corrupt one) and called it a failure without a new checkpoint (a false crash loop)."""
    from pitstop.cli import main

    for name in ("PITSTOP_DIR", "PITSTOP_SUPERVISOR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]))
    (tmp_path / "job.py").write_text(CORRUPTED_JOB)
    status = main(["run", "--dir", str(tmp_path / "ckpt"), "--backoff", "0", "--crash-loop",
                   "1", "--", sys.executable, str(tmp_path / "job.py")])
    err = capfd.readouterr().err
    assert "moved corrupt checkpoint step_0000000001 aside" in err, err
    assert "restart 1 resumed from step 0" in err, err
    assert status == 0, err


def test_the_resumed_step_is_the_one_of_the_supervised_directory(tmp_path, capfd,
                                                                  monkeypatch):
    """A job with a second manager (an EMA copy, another directory) that restores that one
    first: the supervisor reported its step as the job's."""
    import numpy as np

    import pitstop
    from pitstop.cli import main

    for name in ("PITSTOP_DIR", "PITSTOP_SUPERVISOR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]))
    main_dir, ema_dir = tmp_path / "main", tmp_path / "ema"
    for d, step in ((main_dir, 2), (ema_dir, 7)):
        with pitstop.CheckpointManager(str(d), save_on_signals=None) as m:
            m.save(step, {"w": np.zeros(2)})
    job = ("import sys, numpy as np, pitstop\n"
           "main, ema = (pitstop.CheckpointManager(d) for d in sys.argv[1:])\n"
           "ema.restore({'w': np.zeros(2)}); main.restore({'w': np.zeros(2)})\n")
    status = main(["run", "--dir", str(main_dir), "--", sys.executable, "-c", job,
                   str(main_dir), str(ema_dir)])
    err = capfd.readouterr().err
    assert status == 0, err
    assert "job resumed from step 2" in err and "step 7" not in err, err


def test_a_stalled_object_store_does_not_hold_up_the_job(tmp_path, capfd, monkeypatch):
    """--dir on an object store whose endpoint accepts connections and never answers: the
    supervisor's informational read of the newest step blocked before the job's start
    (botocore's timeouts and retries: many minutes). It gives up on it now, as 'cannot be
    read here'."""
    import socket

    from pitstop.cli import main, run

    for name in ("PITSTOP_DIR", "PITSTOP_SUPERVISOR"):
        monkeypatch.delenv(name, raising=False)
    stalled = socket.socket()
    stalled.bind(("127.0.0.1", 0))
    stalled.listen(64)  # connections complete in the backlog; no request is ever answered
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{stalled.getsockname()[1]}")
    for k, v in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(run, "READ_TIMEOUT", 0.5)

    def too_long(signum, frame):
        raise TimeoutError("pitstop run waited for the stalled store")

    previous = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(60)  # the bound of a failure
    try:
        status = main(["run", "--dir", "s3://bucket/run", "--max-restarts", "0", "--",
                       "sh", "-c", f"touch {tmp_path / 'started'}; exit 3"])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        stalled.close()
    err = capfd.readouterr().err
    assert status == 3 and (tmp_path / "started").exists(), err
    assert "not known (s3://bucket/run cannot be read here" in err, err


def test_sighup_to_the_supervisor_gets_the_job_saved(tmp_path):
    job = ("import os, sys, time, numpy as np, pitstop\n"
           "m = pitstop.CheckpointManager(sys.argv[1], save_every_steps=1000)\n"
           "for s in range(10**6):\n"
           "    if s == 3: print('ready', flush=True)\n"
           "    time.sleep(0.01); m.step(s, {'w': np.zeros(3)})\n")
    p = subprocess.Popen([sys.executable, "-m", "pitstop.cli", "run", "--", sys.executable,
                          "-c", job, str(tmp_path / "ckpt")], cwd=ROOT, env=env(), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         # a suite started under nohup ignores SIGHUP, and so, by design, would
                         # the supervisor (and the job): this test is of a terminal hanging up
                         preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    try:
        p.stdout.readline()
        p.send_signal(signal.SIGHUP)
        err = p.communicate(timeout=60)[1]
    finally:
        if p.poll() is None:
            p.kill()
    assert len(list((tmp_path / "ckpt").glob("step_*"))) == 2, err  # step 0 and the signal's
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "SIGHUP (the terminal hung up), as SIGTERM, forwarded" in err, err
