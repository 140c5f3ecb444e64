"""A Lightning training job for test_lightning_resume.py, run as a subprocess.

``Trainer.fit(ckpt_path="last")`` with PitstopCheckpoint and ModelCheckpoint(save_last=True,
save_top_k=2, monitor="train_loss", every_n_train_steps=3); dropout, a shuffled DataLoader
with 2 workers, gradient accumulation 2, StepLR stepped every optimizer step,
seed_everything(workers=True). Appends ``loss <batch> <float.hex>`` lines to
``<out>/log.txt`` (one write each), prints ``done <batch>`` after each training batch, and
SIGTERMs itself after batch ``--term-at``; at the end writes the model's and the optimizer's state to ``<out>/final.pt``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pitstop.integrations.lightning import PitstopCheckpoint


class Net(pl.LightningModule):
    def __init__(self, log_path: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.ReLU(), nn.Linear(32, 1))
        self.log_path = log_path

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        n = self.trainer.fit_loop.epoch_loop.batch_progress.total.ready
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, f"loss {n} {loss.item().hex()}\n".encode())
        os.close(fd)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Report(Callback):
    def __init__(self, term_at: int | None) -> None:
        self.term_at = term_at

    def on_train_start(self, trainer, pl_module):
        n = trainer.fit_loop.epoch_loop.batch_progress.total.processed
        fd = os.open(pl_module.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, f"start {n}\n".encode())
        os.close(fd)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        n = trainer.fit_loop.epoch_loop.batch_progress.total.processed
        os.write(1, f"done {n}\n".encode())
        if n == self.term_at:  # a preemption notice: pitstop saves this batch and exits
            os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--term-at", type=int, default=None)
    a = p.parse_args()
    pl.seed_everything(1234, workers=True, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    loader = DataLoader(data, batch_size=4, shuffle=True, num_workers=2)
    model = Net(os.path.join(a.out, "log.txt"))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=a.steps, accumulate_grad_batches=2,
        enable_progress_bar=False, logger=False, enable_model_summary=False,
        default_root_dir=a.dir,
        callbacks=[Report(a.term_at), PitstopCheckpoint(os.path.join(a.dir, "pitstop"), save_every_steps=5),
                   ModelCheckpoint(dirpath=os.path.join(a.dir, "ckpts"), save_last=True,
                                   save_top_k=2, monitor="train_loss", every_n_train_steps=3)])
    trainer.fit(model, loader, ckpt_path="last")
    opt = trainer.optimizers[0]
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
               os.path.join(a.out, "final.pt"))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
