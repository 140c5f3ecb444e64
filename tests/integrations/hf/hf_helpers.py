"""The tiny model, dataset and callback the in-process Trainer tests share."""

from __future__ import annotations

import torch
import transformers


class Net(torch.nn.Module):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(hidden, 1))

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int = 32) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


class Begin(transformers.TrainerCallback):
    """Records the global step and log history the loop starts with."""

    def on_train_begin(self, args, state, control, **kwargs):
        self.step, self.logged = state.global_step, [h["step"] for h in state.log_history]
