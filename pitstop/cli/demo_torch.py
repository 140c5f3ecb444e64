"""The PyTorch trainer of ``pitstop demo``: a 3-layer MLP classifier with dropout, AdamW, a
warm-up + cosine LR schedule, a shuffling ResumableLoader over a synthetic data set, and
input noise from a torch.Generator every step. The checkpointed state is all of it: model,
optimizer, scheduler, loader position, the noise generator, torch's global RNG (dropout)
and the per-step losses."""

from __future__ import annotations

from typing import Any

import numpy as np

from pitstop.cli.demo import ChildRun

D_IN, HIDDEN, CLASSES, SAMPLES, BATCH = 256, 1024, 10, 4096, 64
PARAMS = D_IN * HIDDEN + HIDDEN + HIDDEN * HIDDEN + HIDDEN + HIDDEN * CLASSES + CLASSES
DESCRIPTION = (f"a PyTorch MLP ({PARAMS / 1e6:.2f} M parameters, dropout), AdamW, warm-up + "
               "cosine LR, a shuffling DataLoader over synthetic data, input noise from a "
               "seeded torch.Generator every step")
PEER = ("torch.save", "model, optimizer, scheduler, loader and RNG state_dicts to one file, "
        "no fsync")


def state_mib(steps: int) -> float:
    return (3 * PARAMS * 4 + steps * 8) / 2**20


def train(c: ChildRun) -> int:
    """One training run; with a checkpoint directory it resumes from it when it can."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import TensorDataset

    import pitstop
    from pitstop.adapters.torch import ResumableLoader

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(c.seed)
    g = torch.Generator().manual_seed(c.seed)  # the data set: a random teacher's labels
    x = torch.randn(SAMPLES, D_IN, generator=g)
    teacher = torch.randn(D_IN, CLASSES, generator=g)
    y = (torch.tanh(x) @ teacher).argmax(dim=1)

    model = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.GELU(), nn.Dropout(0.1),
                          nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, CLASSES))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    warmup = max(1, c.steps // 10)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=warmup),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=c.steps - warmup),
    ], milestones=[warmup])
    loader = ResumableLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True,
                             seed=c.seed, drop_last=True)
    noise = torch.Generator().manual_seed(c.seed + 1)
    losses = torch.zeros(c.steps, dtype=torch.float64)
    state: dict[str, Any] = {"model": model, "optimizer": opt, "scheduler": sched,
                             "loader": loader, "noise": noise, "rng": pitstop.RNG(),
                             "losses": losses}
    mgr = c.manager()
    restored = None
    if mgr is not None:
        restored = mgr.restore(state)
        if restored is not None and c.wrong_resume:  # on purpose: forget the random streams
            torch.manual_seed(c.seed + 99)
            noise.manual_seed(c.seed + 98)
    step = c.restored(restored)

    def peer_save(path: str) -> None:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(), "loader": loader.state_dict(),
                    "noise": noise.get_state(), "rng": torch.get_rng_state(),
                    "losses": losses}, path + ".pt")

    model.train()
    while step < c.steps:
        for xb, yb in loader:
            xb = xb + 0.1 * torch.randn(xb.shape, generator=noise)
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses[step] = loss.item()
            c.end_of_step(step, mgr, state, float(losses[step]), peer_save)
            step += 1
            if step == c.steps:
                break
    arrays = {f"model.{k}": v.detach().numpy() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            arrays[f"optimizer.{i}.{k}"] = np.asarray(v.numpy())
    arrays["lr"] = np.array(sched.get_last_lr(), np.float64)
    arrays["losses"] = losses.numpy()
    return c.finish(mgr, arrays)
