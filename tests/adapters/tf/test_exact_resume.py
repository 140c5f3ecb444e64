"""Exact resume with TensorFlow: a job SIGKILLed at a random step (also right after a save
returned, before its commit) and restarted prints the same loss at every step and ends with
every variable bitwise identical to an uninterrupted run. Real processes; the random plan's
seed is in every failure message."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tensorflow")

CHILD = Path(__file__).with_name("train_child.py")
ROOT = Path(__file__).resolve().parents[3]
STEPS, SAVE_EVERY = 24, 4


def start(out: Path, *args: str) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", TF_NUM_INTEROP_THREADS="1",
               TF_NUM_INTRAOP_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(
        [sys.executable, str(CHILD), "--dir", str(out / "ckpt"), "--out", str(out),
         "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True)


def finish(proc: subprocess.Popen, note: str) -> tuple[int, str]:
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out + "\n--- stderr ---\n" + err[-3000:]


def losses(text: str) -> dict[int, str]:
    """Step -> loss; a repeated step (after a restart) must repeat its loss exactly."""
    seen: dict[int, str] = {}
    for line in text.splitlines():
        if line.startswith("STEP "):
            _, n, hexloss = line.split()
            assert seen.setdefault(int(n), hexloss) == hexloss, f"step {n} differs: {text}"
    return seen


class Reference:
    """The uninterrupted run, one for the module's tests (the same job: the same result),
    started with the first test's job and read when first needed."""

    def __init__(self, out: Path) -> None:
        self.out, self.proc = out, None
        self.result: tuple[int, str] | None = None

    def start(self) -> None:
        if self.proc is None:
            self.proc = start(self.out)

    def finish(self, note: str) -> tuple[int, str]:
        self.start()
        if self.result is None:
            self.result = finish(self.proc, note)
        return self.result


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref = Reference(tmp_path_factory.mktemp("ref"))
    yield ref
    if ref.proc is not None and ref.proc.poll() is None:
        ref.proc.kill()
        ref.proc.communicate()


@pytest.mark.parametrize("where", ["random step", "right after a save"])
def test_sigkill_and_restart_is_bitwise_identical(tmp_path, where, reference):
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    kill = (rnd.randrange(SAVE_EVERY, STEPS - 1) if where == "random step"
            else SAVE_EVERY * rnd.randrange(1, STEPS // SAVE_EVERY))
    note = f"kill at step {kill} ({where}), seed {seed}"
    reference.start()
    job = start(tmp_path / "job", "--kill-at", str(kill))
    rc_ref, out_ref = reference.finish(note)
    rc_job, out_job = finish(job, note)
    assert rc_ref == 0, f"{note}\n{out_ref}"
    assert rc_job == -9, f"{note}: the job was not killed\n{out_job}"
    rc2, out2 = finish(start(tmp_path / "job"), note)
    assert rc2 == 0, f"{note}\n{out2}"
    resumed = next(line for line in out2.splitlines() if line.startswith("RESUMED"))
    assert resumed.split()[-1] == str(kill - kill % SAVE_EVERY), f"{note}: {resumed}"
    assert losses(out_job + "\n" + out2) == losses(out_ref), note
    a, b = np.load(reference.out / "final.npz"), np.load(tmp_path / "job" / "final.npz")
    assert sorted(a) == sorted(b), note
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), f"{note}: {k}"
