"""A trainer for test_loader_workers.py's process-group tests, run as a subprocess.

A ResumableLoader with worker processes started by ``--context`` (spawn, forkserver; the
workers restart every epoch) over a :class:`torch_helpers.GatedDataset`: with ``--gate``,
each worker waits in its start-up until that file exists. Prints ``workers <pids>`` when
an epoch's iterator has started its workers and ``step <n>`` at every step; a manager saves
at the step boundary after a signal (and every 1000 steps). Runs until it is stopped.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch_helpers import GatedDataset

import pitstop
from pitstop.adapters.torch import ResumableLoader


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--context", required=True)
    p.add_argument("--gate", default="")
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(1)
    loader = ResumableLoader(GatedDataset(32, a.gate), batch_size=4, shuffle=True, seed=0,
                             num_workers=a.workers, multiprocessing_context=a.context)
    state = {"loader": loader}
    with pitstop.CheckpointManager(a.dir, memory_tier=False, save_every_steps=1000) as mgr:
        step = 0
        while True:
            it = iter(loader)
            print("workers", *[w.pid for w in it.it._workers], flush=True)
            for _batch in it:
                print("step", step, flush=True)
                time.sleep(0.02)
                mgr.step(step, state)
                step += 1


if __name__ == "__main__":
    main()
