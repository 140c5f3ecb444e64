"""A DeepSpeed ZeRO-2 job stopped twice and started again each time with the same command:
first SIGTERM at a random step (pitstop saves the next optimizer step and exits), then
SIGKILL at a random later step. Every step's loss after each resume, the final weights,
fp32 partitions, moments, lr and counters are bitwise those of an uninterrupted run."""

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


def _run_until(cmd: list[str], env: dict, step: int, sig: int) -> tuple[int, dict[int, float]]:
    """Start the job, send ``sig`` once it printed ``step N``; ``(resumed step, losses)``."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env)
    resumed, losses = -1, {}
    for line in proc.stdout:  # to its end: the steps it ran before the signal took effect
        words = line.split()
        if words[:1] == ["resumed"]:
            resumed = -1 if words[1] == "None" else int(words[1])
        elif words[:1] == ["step"]:
            losses[int(words[1])] = float.fromhex(words[2])
            if int(words[1]) == step:
                proc.send_signal(sig)
    proc.wait(120)
    return resumed, losses


def _parse(out: str) -> tuple[int, dict[int, float]]:
    lines = [ln.split() for ln in out.splitlines() if ln.startswith(("resumed ", "step "))]
    return int(lines[0][1]), {int(s): float.fromhex(x) for _, s, x in lines[1:]}


def test_sigterm_then_sigkill_mid_epoch_resume_bitwise(ds_dist, tmp_path):
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    term_at = rnd.randrange(1, 4)
    kill_at = rnd.randrange(term_at + 3, TOTAL - 1)
    print(f"seed {seed}: SIGTERM after step {term_at}, SIGKILL after step {kill_at}")
    cmd = [sys.executable, str(CHILD), str(tmp_path / "run"), str(STAGE), str(TOTAL),
           str(tmp_path / "final.pt")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # the reference, uninterrupted, in this process
    engine, loader = h.build(STAGE)
    state = {"engine": engine_state(engine), "loader": loader, "rng": pitstop.RNG()}
    ref = h.train(engine, loader, _NoSave(), state, TOTAL)
    want = h.snapshot(engine)

    resumed, first = _run_until(cmd, env, term_at, signal.SIGTERM)
    assert resumed == -1 and first == {k: ref[k] for k in first}, seed
    # SIGTERM saved at the next step boundary after it came (whose line the job no longer
    # printed: pitstop exits inside that step() call)
    resumed, second = _run_until(cmd, env, kill_at, signal.SIGKILL)
    assert resumed == max(first) + 1 and resumed > term_at, (seed, resumed, sorted(first))
    assert sorted(second)[0] == resumed + 1 and second == {k: ref[k] for k in second}, seed

    with pitstop.CheckpointManager(tmp_path / "run", read_only=True) as mgr:
        committed = mgr.all_steps()  # what the killed job had made durable
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed, third = _parse(again.stdout)
    # nothing durable is lost: the newest committed save, or a newer snapshot the memory tier
    # kept. (Not "within 2 steps of the kill": the save before it may still be persisting on
    # a loaded machine, so resuming from the one before that is right; it failed so once.)
    assert committed and committed[-1] <= resumed <= max(second), (seed, resumed, committed)
    assert sorted(third) == list(range(resumed + 1, TOTAL))
    assert third == {k: ref[k] for k in third}, seed
    h.assert_same(want, torch.load(tmp_path / "final.pt"))
