"""Several ranks, one checkpoint: an FSDP2 training loop with pitstop (docs/distributed.md).

    torchrun --nproc-per-node 2 examples/torch_distributed.py               # trains, saving every 10 steps
    torchrun --nproc-per-node 2 examples/torch_distributed.py               # again: every rank resumes
    torchrun --nproc-per-node 2 examples/torch_distributed.py --dir /tmp/d  # another directory

Each rank writes only the shards it holds; the ranks commit one checkpoint together through
the job's own process group. Restored on another number of ranks, the shards are resharded.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn


def build_model() -> nn.Module:
    """A small model; any nn.Module works."""
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    """One step on this rank's batch, a function of the step and the rank."""
    import torch.distributed as dist
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x = torch.randn(32, 16, generator=g)
    loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="runs/exp1", help="checkpoint directory (shared by the ranks)")
    p.add_argument("--steps", type=int, default=60, help="total training steps")
    args = p.parse_args()
    total_steps = args.steps

    # started with: torchrun --nproc-per-node 2 examples/torch_distributed.py
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import pitstop

    dist.init_process_group("gloo")                # "nccl" on GPUs: pitstop uses gloo groups of its own
    model = build_model()
    fully_shard(model)                             # or DistributedDataParallel(model), or plain tensors
    opt = torch.optim.AdamW(model.parameters())
    state = {"model": model, "opt": opt, "rng": pitstop.RNG()}

    with pitstop.CheckpointManager(args.dir, save_every_steps=10, keep_last=3) as mgr:
        start = mgr.restore(state)                 # every rank resumes from the same step
        if dist.get_rank() == 0:
            print("fresh start" if start is None else f"resuming after step {start}", flush=True)
        for step in range(0 if start is None else start + 1, total_steps):
            train_step(model, opt, step)
            mgr.step(step, state)                  # the ranks decide together whether to save
        if dist.get_rank() == 0:
            print(f"done: checkpoints at steps {mgr.all_steps()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
