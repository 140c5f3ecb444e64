"""A DeepSpeed ZeRO-2 job SIGKILLed at a random optimizer step and started again with the
same command: every later step's loss, the final weights, fp32 partitions, moments, lr and
counters are bitwise those of an uninterrupted run."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import ds_helpers as h
import torch

import pitstop
from pitstop.integrations.deepspeed import engine_state

CHILD = Path(__file__).with_name("train_child.py")
TOTAL, STAGE = 12, 2


class _NoSave:
    def restore(self, state):
        return None

    def step(self, step, state, metrics=None):
        return None


def _lines(proc: subprocess.Popen, until: str | None = None) -> list[str]:
    seen = []
    for raw in proc.stdout:
        seen.append(raw.strip())
        if raw.strip().split(" ")[:2] == (until or "").split(" ")[:2]:
            break
    return seen


def test_sigkill_mid_epoch_resumes_bitwise(ds_dist, tmp_path):
    seed = random.randrange(1 << 30)
    kill_at = random.Random(seed).randrange(3, TOTAL - 2)
    print(f"seed {seed}: SIGKILL after step {kill_at}")
    cmd = [sys.executable, str(CHILD), str(tmp_path / "run"), str(STAGE), str(TOTAL),
           str(tmp_path / "final.pt")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             env=env)
    # the reference meanwhile, in this process (the same job, never interrupted)
    engine, loader = h.build(STAGE)
    state = {"engine": engine_state(engine), "loader": loader, "rng": pitstop.RNG()}
    ref = h.train(engine, loader, _NoSave(), state, TOTAL)
    want = h.snapshot(engine)
    seen = _lines(first, f"step {kill_at}")
    first.send_signal(signal.SIGKILL)
    first.wait(60)
    assert seen[-1].startswith(f"step {kill_at} "), seen

    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    lines = [ln for ln in again.stdout.splitlines() if ln.startswith(("resumed ", "step "))]
    resumed = int(lines[0].split()[1])
    assert kill_at - 2 <= resumed <= kill_at, (seed, lines[0])  # saves every 2 steps, async
    losses = {int(s): float.fromhex(x) for _, s, x in (ln.split() for ln in lines[1:])}
    assert sorted(losses) == list(range(resumed + 1, TOTAL))
    assert losses == {k: ref[k] for k in losses}, seed
    h.assert_same(want, torch.load(tmp_path / "final.pt"))
