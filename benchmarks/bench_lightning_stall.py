"""The training thread's stall of one Lightning checkpoint: ModelCheckpoint's own
(``trainer.save_checkpoint`` through Lightning's TorchCheckpointIO: torch.save) against
PitstopCheckpoint's (the same call: Lightning's dump, then pitstop's snapshot; the write
goes on in the background), on the same model and optimizer state.

    python benchmarks/bench_lightning_stall.py --params-m 16 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pitstop.integrations.lightning import PitstopCheckpoint


class Wide(pl.LightningModule):
    def __init__(self, params_m: int) -> None:
        super().__init__()
        width = int((params_m * 1e6 / 2) ** 0.5)
        self.net = nn.Sequential(nn.Linear(width, width), nn.Linear(width, width))
        self.width = width

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)


def _trainer(root: str, *callbacks) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=1, enable_progress_bar=False,
                      logger=False, enable_model_summary=False, enable_checkpointing=False,
                      default_root_dir=root, callbacks=list(callbacks))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--params-m", type=int, default=16, help="millions of parameters")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        model = Wide(a.params_m)
        data = DataLoader(TensorDataset(torch.randn(4, model.width)), batch_size=2)
        plain = _trainer(root)
        plain.fit(model, data)
        pit_cb = PitstopCheckpoint(os.path.join(root, "pit"))
        pit = _trainer(root, pit_cb)
        pit.fit(model, data)
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
        rows = {"torch.save (ModelCheckpoint)": [], "pitstop (PitstopCheckpoint)": []}
        for i in range(a.repeats):
            t0 = time.perf_counter()
            plain.save_checkpoint(os.path.join(root, f"plain-{i}.ckpt"))
            rows["torch.save (ModelCheckpoint)"].append(time.perf_counter() - t0)
            pit.fit_loop.epoch_loop.batch_progress.total.processed += 1  # a new step each
            pit_cb._trainer = pit
            _ = pit_cb.manager  # (closed at the end of fit: opened again)
            t0 = time.perf_counter()
            pit.save_checkpoint(os.path.join(root, f"pit-{i}.ckpt"))
            rows["pitstop (PitstopCheckpoint)"].append(time.perf_counter() - t0)
            pit_cb.manager.wait()
        pit_cb.manager.close()
        print(f"state: {nbytes / 2**20:.0f} MiB (weights + Adam moments), {a.repeats} saves")
        for name, ts in rows.items():
            print(f"{name:32s} stall median {statistics.median(ts):.3f} s  "
                  f"(min {min(ts):.3f}, max {max(ts):.3f})")


if __name__ == "__main__":
    main()
