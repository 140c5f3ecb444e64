"""Train a small PyTorch model with pitstop: stop it any way you like, run it again, and it
continues exactly where the last checkpoint left it.

    python examples/torch_train.py                 # trains, saving every 20 steps
    python examples/torch_train.py                 # again: "resuming after step 180"
    python examples/torch_train.py --dir /tmp/run  # Ctrl+C / SIGTERM save at the next step

Everything that decides the next step is in ``state``: weights, optimizer moments, the LR
schedule, the data order and position (ResumableLoader, with 2 worker processes), and the
random streams (pitstop.RNG: Python, numpy, torch).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import pitstop
from pitstop.adapters.torch import ResumableLoader


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="runs/torch_example", help="checkpoint directory")
    p.add_argument("--steps", type=int, default=300, help="total training steps")
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    args = p.parse_args()

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    y = (x @ torch.randn(16, generator=g)).sin() + 0.05 * torch.randn(512, generator=g)

    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warmup = 20
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=warmup),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps - warmup),
    ], milestones=[warmup])
    loader = ResumableLoader(TensorDataset(x, y), batch_size=32, shuffle=True, seed=0,
                             num_workers=args.workers)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "loader": loader,
             "rng": pitstop.RNG()}

    with pitstop.CheckpointManager(args.dir, save_every_steps=args.save_every,
                                   keep_last=3) as mgr:
        restored = mgr.restore(state)
        if restored is None:
            print(f"starting fresh in {args.dir}")
            step = 0
        else:
            print(f"resuming after step {restored} (epoch {loader.epoch}, "
                  f"{loader.position} samples into it, lr {sched.get_last_lr()[0]:.2e})")
            step = restored + 1
        model.train()
        while step < args.steps:
            for xb, yb in loader:
                loss = F.mse_loss(model(xb).squeeze(-1), yb)
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                # at the END of step `step`: a resumed run starts at restored + 1
                mgr.step(step, state, metrics={"loss": loss.item()})
                if step % 50 == 0 or step == args.steps - 1:
                    print(f"step {step:4d}  loss {loss.item():.4f}")
                step += 1
                if step == args.steps:
                    break
        if mgr.latest_step() != args.steps - 1:
            mgr.save(args.steps - 1, state, {"loss": loss.item()})  # the final state, too
    print(f"done; checkpoints: {mgr.all_steps()}")


if __name__ == "__main__":
    main()
