"""pitstop.integrations.hf.Trainer: a real Trainer job killed and started again resumes
exactly (issue 29).

One scenario covers the list: a tiny GPT-2 with dropout, a shuffled dataset read by two
worker processes, gradient accumulation 2, the linear schedule with warm-up, saves every 2
steps with ``save_total_limit=2``. The job is SIGKILLed (its whole process group) after a
random step, started again (a fresh process running the same script: hf_zygote.py forks
it), stopped with SIGTERM a few steps later
(pitstop saves that step and exits), and started again to the end. Every per-micro-batch
loss after each resume, the logged losses, the final weights and every optimizer moment are
bitwise those of an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
STEPS = 12


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]),
               HF_JOB_STEPS=str(STEPS), TRANSFORMERS_VERBOSITY="error", PYTHONUNBUFFERED="1")
    env.pop("PITSTOP_MEMORY_TIER", None)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):  # a one-process job, whatever process group the tests have
        env.pop(name, None)
    return env


class Job:
    """One start of the job: a fresh process forked by the zygote (see hf_zygote.py)."""

    def __init__(self, zygote: subprocess.Popen[str], out: Path) -> None:
        self.zygote = zygote
        fifo = out.parent / f"{out.name}.{len(list(out.parent.glob('*.fifo')))}.fifo"
        os.mkfifo(fifo)
        self.pid = int(_ask(zygote, f"run {out} {fifo}").split()[1])
        self.stdout = open(fifo)  # noqa: SIM115 (read line by line while it runs)

    def wait(self) -> int:
        rest = self.stdout.read()
        self.stdout.close()
        self.tail = rest.splitlines()
        return int(_ask(self.zygote, f"wait {self.pid}").split()[2])


def _ask(zygote: subprocess.Popen[str], command: str) -> str:
    assert zygote.stdin is not None and zygote.stdout is not None
    zygote.stdin.write(command + "\n")
    zygote.stdin.flush()
    return zygote.stdout.readline()


@pytest.fixture()
def zygote() -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, str(HERE / "hf_zygote.py")], env=_env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    yield proc
    proc.stdin.close()
    proc.wait(timeout=60)


def _losses(lines: list[str]) -> dict[tuple[int, int], str]:
    found = {}
    for line in lines:
        if line.startswith("loss "):
            _, step, micro, value = line.split()
            found[(int(step), int(micro))] = value
    return found


def _until_step(job: Job, step: int) -> list[str]:
    """Read the job's lines until it printed ``step <step>`` (then it is past that step)."""
    lines = []
    for line in job.stdout:
        lines.append(line.rstrip("\n"))
        if line.strip() == f"step {step}":
            return lines
    job.wait()
    raise AssertionError(f"the job ended before step {step}:\n" + "\n".join(lines[-30:]))


def _finish(job: Job) -> list[str]:
    code = job.wait()
    assert code == 0, "\n".join(job.tail[-40:])
    return job.tail


def _final(out: Path) -> dict:
    return torch.load(out / "final.pt", weights_only=True)


def _uninterrupted(out: Path) -> tuple[dict, dict]:
    """The job's uninterrupted run, in this process (the job's code seeds everything it
    uses; a subprocess would only add another start of Python and transformers)."""
    import hf_job

    text = io.StringIO()
    old = hf_job.MAX_STEPS
    hf_job.MAX_STEPS = STEPS
    try:
        with contextlib.redirect_stdout(text):
            hf_job.main(str(out))
    finally:
        hf_job.MAX_STEPS = old
    lines = text.getvalue().splitlines()
    assert "done" in lines, lines[-20:]
    return _losses(lines), _final(out)


def _assert_same_state(got: dict, want: dict) -> None:
    assert got["model"].keys() == want["model"].keys()
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), f"weight {k} differs"
    for pid, moments in want["optimizer"]["state"].items():
        for name, v in moments.items():
            g = got["optimizer"]["state"][pid][name]
            assert torch.equal(g, v), f"optimizer state {pid}/{name} differs"
    assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
    assert got["log"] == want["log"], "the logged losses differ"


def test_sigkill_then_sigterm_resume_exactly(tmp_path: Path, zygote) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    kill_at = rng.randint(2, STEPS - 6)
    print(f"seed {seed}: SIGKILL after step {kill_at}")
    out = tmp_path / "out"

    first = Job(zygote, out)
    _until_step(first, kill_at)
    os.killpg(first.pid, signal.SIGKILL)      # the job and its DataLoader workers
    assert first.wait() == -signal.SIGKILL
    # under load the SIGKILL lands some steps after the line read: the last step it printed
    done = max([kill_at] + [int(x.split()[1]) for x in first.tail if x.startswith("step ")])

    second = Job(zygote, out)
    lines = _until_step(second, STEPS - 2)
    os.killpg(second.pid, signal.SIGTERM)     # the whole group, as a scheduler does
    code = second.wait()
    lines += second.tail
    assert code in (-signal.SIGTERM, 128 + signal.SIGTERM), "\n".join(lines[-30:])
    resumed = _losses(lines)
    assert resumed, "\n".join(lines[-30:])
    first_step = min(s for s, _ in resumed)
    assert first_step <= done + 1, f"resumed at {first_step}, killed after step {done}"
    ref_losses, ref_final = _uninterrupted(tmp_path / "whole")
    for key, value in resumed.items():
        assert value == ref_losses[key], f"seed {seed}: loss of step/micro {key} differs"
    sigterm_step = max(s for s, _ in resumed) + 1

    third = _finish(Job(zygote, out))
    again = _losses(third)
    # the SIGTERM save was of the step the job was in: the third start goes on right after it
    assert min(s for s, _ in again) == sigterm_step, (seed, sigterm_step, sorted(again)[:2])
    for key, value in again.items():
        assert value == ref_losses[key], f"seed {seed}: loss of step/micro {key} differs"
    _assert_same_state(_final(out), ref_final)
    # save_total_limit=2: the Trainer's rotation, over pitstop's checkpoints
    kept = sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))
    assert kept == [f"checkpoint-{STEPS - 2}", f"checkpoint-{STEPS}"], kept
