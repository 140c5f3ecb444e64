"""A small DeepSpeed training job, the same in the test process and in the killed child:
a model with dropout, AdamW, WarmupLR, gradient accumulation 2, a shuffling loader with two
worker processes; ``train`` runs its loop with pitstop and returns every step's loss."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch

MICRO, ACCUMULATION = 4, 2


def skip_shm_kernel() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory allreduce kernel (C++, tens of
    seconds on two cores, behind a lock file in ~/.cache/torch_extensions that a process killed
    while compiling leaves behind, and every later start waits on forever). gloo does the same
    allreduce, so the tests go without it: the checkpoint paths under test do not touch it."""
    import importlib

    # by its module's name: ``import deepspeed.comm.torch as m`` gives torch itself (the
    # package deepspeed.comm binds the name ``torch`` to it)
    backend = importlib.import_module("deepspeed.comm.torch")
    assert hasattr(backend, "build_shm_op"), "DeepSpeed moved build_shm_op: update this"
    backend.build_shm_op = lambda: None


def init_distributed() -> None:
    """One gloo rank, as the deepspeed launcher would set it up (before deepspeed imports)."""
    import deepspeed
    import torch.distributed as dist

    skip_shm_kernel()
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def build(stage: int, *, seed: int = 0, dataloader: bool = False) -> Any:
    """``(engine, loader)``: the weights of ``seed``, always the same data and shuffle."""
    import deepspeed

    from pitstop.adapters.torch import ResumableLoader

    g = torch.Generator().manual_seed(0)  # the same data whatever the seed
    data = torch.utils.data.TensorDataset(torch.randn(96, 8, generator=g),
                                          torch.randn(96, 1, generator=g))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.ReLU(),
                                torch.nn.Linear(16, 1))
    config = {"train_micro_batch_size_per_gpu": MICRO,
              "gradient_accumulation_steps": ACCUMULATION,
              "gradient_clipping": 1.0,
              "scheduler": {"type": "WarmupLR",
                            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                       "warmup_num_steps": 6}},
              "zero_optimization": {"stage": stage}}
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config,
                                      training_data=data if dataloader else None)
    loader = ResumableLoader(data, batch_size=MICRO, shuffle=True, seed=0, num_workers=2)
    return engine, loader


def train(engine: Any, loader: Any, mgr: Any, state: Any, total: int,
          stop_at: int | None = None) -> dict[int, float]:
    """Restore, then train to ``total`` optimizer steps (or return after ``stop_at``);
    ``{step: loss}`` of the steps run here, where a step's loss is its micro-batches' sum.
    Prints ``step N`` after pitstop's step call of each (the killer waits for it)."""
    restored = mgr.restore(state)
    if restored is not None:  # the engine's counters came back with the step
        assert engine.global_steps == restored + 1, (restored, engine.global_steps)
    losses: dict[int, float] = {}
    acc = 0.0
    while engine.global_steps < total:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            before = engine.global_steps
            engine.step()
            acc += loss.item()
            if engine.global_steps == before:
                continue
            step = engine.global_steps - 1
            losses[step] = acc
            acc = 0.0
            mgr.step(step, state, metrics={"loss": losses[step]})
            os.write(1, f"step {step} {losses[step].hex()}\n".encode())
            if engine.global_steps >= total or step == stop_at:
                return losses
    return losses


def snapshot(engine: Any) -> dict[str, torch.Tensor]:
    """Copies of everything an exact resume must reproduce."""
    out = {f"w/{k}": v.detach().clone() for k, v in engine.module.state_dict().items()}
    opt = engine.optimizer
    base = getattr(opt, "optimizer", opt)
    for i, st in base.state.items():
        for k, v in st.items():
            out[f"o/{i}/{k}"] = torch.as_tensor(v).clone()
    for i, t in enumerate(getattr(opt, "single_partition_of_fp32_groups", [])):
        out[f"fp32/{i}"] = t.detach().clone()
    out["lr"] = torch.tensor([g["lr"] for g in base.param_groups], dtype=torch.float64)
    out["counters"] = torch.tensor([engine.global_steps, engine.global_samples,
                                    engine.skipped_steps, engine.micro_steps])
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
