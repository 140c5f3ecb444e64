"""A real job preempted as a cloud does it (issue 31's check): a fake metadata server on
127.0.0.1 announces the preemption, the job saves at its next step boundary (its only
save), trains on, is SIGKILLed after the deadline (the machine taken), is started again,
resumes from the notice's save and ends bitwise equal to a run that was never interrupted.
For a torch job (model, Adam, torch's RNG) and a numpy one (arrays, a numpy Generator)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pitstop.testing.metadata import FakeMetadata

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
JOB = HERE / "preemption_job.py"
#: steps of each run: the numpy job's steps are quick, and it must outlive AWS's deadline
TOTAL = {"torch": 40, "numpy": 150}
ENVS = ("PITSTOP_PREEMPTION", "PITSTOP_PREEMPTION_EXIT", "PITSTOP_GRACE_SECONDS",
        "KUBERNETES_SERVICE_HOST", "PITSTOP_SUPERVISOR", "PITSTOP_DIR")


class Job:
    """One run of the job as a subprocess, its stdout lines gathered on a thread."""

    def __init__(self, kind: str, directory: Path, out: Path, source: str | None,
                 env: dict[str, str]) -> None:
        e = {k: v for k, v in os.environ.items() if k not in ENVS}
        e["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [e.get("PYTHONPATH")])])
        e.update(env)
        args = [sys.executable, str(JOB), kind, str(directory), str(out), str(TOTAL[kind])]
        self.proc = subprocess.Popen(args + ([source] if source else []), env=e,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.err: list[str] = []
        self._threads = [threading.Thread(target=self._read, args=(s, a), daemon=True)
                         for s, a in ((self.proc.stdout, self.lines),
                                      (self.proc.stderr, self.err))]
        for t in self._threads:
            t.start()

    def _read(self, stream, into: list[str]) -> None:
        for line in stream:
            into.append(line.rstrip("\n"))

    def last_step(self) -> int:
        steps = [int(x.split()[1]) for x in list(self.lines) if x.startswith("STEP ")]
        return steps[-1] if steps else -1

    def finish(self, timeout: float = 30.0) -> int:
        code = self.proc.wait(timeout=timeout)
        for t in self._threads:
            t.join(timeout=5)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.finish()

    def text(self) -> str:
        return "\n".join(self.lines + self.err)


def until(predicate, timeout: float, what: str, job: Job | None = None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        if job is not None and job.proc.poll() is not None:
            break
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}" + (f":\n{job.text()}" if job else ""))


def durable_record(directory: Path) -> dict | None:
    try:
        doc = json.loads((directory / ".pitstop" / "directory.json").read_text())
    except (OSError, ValueError):
        return None
    done = [r for r in doc.get("preemption", []) if r.get("durable_unix")]
    return done[-1] if done else None


@pytest.mark.parametrize("kind, source", [
    pytest.param("torch", "gce", id="torch-gce"),
    pytest.param("numpy", "aws", id="numpy-aws"),
])
def test_a_preempted_job_killed_after_the_deadline_resumes_bitwise_identical(
        tmp_path, kind, source):
    if kind == "torch":
        pytest.importorskip("torch")
    with FakeMetadata(services=(source,)) as fake:
        # the uninterrupted run, meanwhile (a run of its own: the reference)
        reference = Job(kind, tmp_path / "ref", tmp_path / "ref.npz", None, {})
        job = Job(kind, tmp_path / "ck", tmp_path / "out.npz", source, fake.env())
        resumed: Job | None = None
        try:
            until(lambda: job.last_step() >= 5, 60, "the job to train", job)
            deadline = fake.announce(source, in_seconds=2)
            rec = until(lambda: durable_record(tmp_path / "ck"), 30,
                        "the notice's save to be durable", job)
            assert rec["source"] == source and rec["step"] >= 5
            assert rec["deadline_unix"] == pytest.approx(deadline, abs=1e-3 if source != "gce"
                                                         else 30)
            # it trains on after the save, as by default, until the machine is taken: after
            # AWS's deadline; GCE's (30 s) is not waited for, the kill only comes sooner
            until(lambda: job.last_step() >= rec["step"] + 3, 30, "training on", job)
            if source != "gce":
                until(lambda: time.time() > deadline, 5, "the deadline")
            job.proc.send_signal(signal.SIGKILL)
            assert job.finish() == -signal.SIGKILL
            killed_at = job.last_step()
            assert killed_at > rec["step"] and killed_at < TOTAL[kind] - 1, job.text()
            assert f"preemption notice from {source} at" in job.text()
            fake.withdraw(source)  # the new machine has no notice
            resumed = Job(kind, tmp_path / "ck", tmp_path / "out.npz", source, fake.env())
            assert resumed.finish() == 0, resumed.text()
            assert f"START {rec['step']}" in resumed.lines, resumed.text()
            assert reference.finish() == 0, reference.text()
        finally:
            for j in (job, reference, resumed):
                if j is not None:
                    j.kill()
    want, got = np.load(tmp_path / "ref.npz"), np.load(tmp_path / "out.npz")
    assert sorted(want.files) == sorted(got.files)
    for name in want.files:
        assert want[name].dtype == got[name].dtype, name
        assert want[name].tobytes() == got[name].tobytes(), name
