"""``ResumableLoader.from_loader``: the arguments of an equivalent loader, read off a
``DataLoader`` that a trainer (Lightning, the HF Trainer, Accelerate, Ray) built."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from pitstop.adapters.torch._workers import WorkerInit

#: DataLoader arguments copied as they are
_COPIED = ("num_workers", "collate_fn", "pin_memory", "timeout", "multiprocessing_context",
           "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")

_MASK = (1 << 63) - 1


def loader_arguments(loader: DataLoader, seed: int | None) -> dict[str, Any]:
    """Keyword arguments of ``ResumableLoader`` equivalent to ``loader``'s."""
    if not isinstance(loader, DataLoader):
        raise TypeError(f"from_loader needs a torch DataLoader, got {type(loader).__name__}")
    kw: dict[str, Any] = {k: getattr(loader, k) for k in _COPIED if hasattr(loader, k)}
    init = getattr(loader, "worker_init_fn", None)
    kw["worker_init_fn"] = init.fn if isinstance(init, WorkerInit) else init
    if not kw.get("num_workers"):
        kw.pop("multiprocessing_context", None)
        kw.pop("prefetch_factor", None)
        kw["persistent_workers"] = False
    gen = loader.generator
    if seed is None:
        seed = (gen.initial_seed() if isinstance(gen, torch.Generator)
                else torch.initial_seed()) & _MASK
    kw.update(dataset=loader.dataset, seed=int(seed))
    if isinstance(loader.dataset, IterableDataset):
        kw.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
        return kw
    if loader.batch_size is None and loader.batch_sampler is not None:
        kw["batch_sampler"] = loader.batch_sampler  # the user's own
        return kw
    kw.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
    sampler = loader.sampler
    if type(sampler) is RandomSampler and not sampler.replacement and (
            sampler._num_samples is None):
        kw["shuffle"] = True
    elif type(sampler) is not SequentialSampler:
        kw["sampler"] = sampler
    return kw
