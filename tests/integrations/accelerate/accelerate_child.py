"""An Accelerate training job as a user writes it, with pitstop's Checkpointing: a shuffled
DataLoader with two worker processes, dropout, gradient accumulation (2, over an epoch of an
odd number of batches, so accelerate's end-of-dataloader sync is in it too), AdamW and a
warm-up + cosine schedule. Run with the same arguments again after a kill, it resumes.

Prints ``batch N loss <hex>`` after each batch (N counts every batch of the run) and
``done`` at the end; writes the final weights and optimizer state to ``--out/final.pt``.
``--no-pitstop``: the same loop without checkpointing (the uninterrupted reference).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed

EPOCHS, BATCH, SAMPLES = 2, 4, 44  # 11 batches an epoch, 6 optimizer steps (the last after 1)


class Batches:
    """The run's batch counter, checkpointed with the rest (extra_state)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.n = int(sd["n"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--project", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-pitstop", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2,
                              project_config=ProjectConfiguration(
                                  project_dir=args.project, automatic_checkpoint_naming=True,
                                  total_limit=3))
    set_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 8), torch.randn(SAMPLES, 1))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2),
                                torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    total = EPOCHS * 6
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=2)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - 2)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[2])
    dl = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True, num_workers=2)
    model, opt, dl, sched = accelerator.prepare(model, opt, dl, sched)
    batches = Batches()
    ckpt = None
    if not args.no_pitstop:
        from pitstop.integrations.accelerate import Checkpointing

        ckpt = Checkpointing(accelerator, save_every_steps=2, extra_state={"batches": batches})
        print(f"restored {ckpt.restore()}", flush=True)
    for _epoch in range(dl.iteration, EPOCHS):
        for x, y in dl:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            batches.n += 1
            os.write(1, f"batch {batches.n} loss {loss.item().hex()}\n".encode())
            if ckpt is not None:
                ckpt.step(metrics={"loss": loss.item()})
    if ckpt is not None:
        ckpt.save()
        ckpt.close()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict()}, os.path.join(args.out, "final.pt"))
    os.write(1, b"done\n")
    sys.exit(0)


if __name__ == "__main__":
    main()
