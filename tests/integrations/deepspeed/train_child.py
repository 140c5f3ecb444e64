"""The DeepSpeed job the kill test runs: ``train_child.py DIR STAGE TOTAL OUT``. It resumes
from DIR when there is a checkpoint, trains to TOTAL optimizer steps saving every 2 (async),
prints ``step N <loss hex>`` after each, and writes the final state to OUT."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ds_helpers as h  # noqa: E402
import torch  # noqa: E402

import pitstop  # noqa: E402
from pitstop.integrations.deepspeed import engine_state  # noqa: E402


def main() -> None:
    directory, stage, total, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    h.init_distributed()
    engine, loader = h.build(stage, seed=len(os.listdir(directory)) if os.path.isdir(directory)
                             else 0)  # a restart builds other weights: the restore must win
    state = {"engine": engine_state(engine), "loader": loader, "rng": pitstop.RNG()}
    with pitstop.CheckpointManager(directory, save_every_steps=2, keep_last=2) as mgr:
        start = mgr.restore(state)
        os.write(1, f"resumed {start}\n".encode())
        h.train(engine, loader, _Restored(mgr, start), state, total)
    torch.save(h.snapshot(engine), out)


class _Restored:
    """The manager, whose restore was made already (to print where it resumed)."""

    def __init__(self, mgr, start):
        self.mgr, self.start = mgr, start

    def restore(self, state):
        return self.start

    def step(self, step, state, metrics=None):
        return self.mgr.step(step, state, metrics=metrics)


if __name__ == "__main__":
    main()
