"""PyTorch support: put torch objects straight into the state you give the manager.

>>> import pitstop
>>> from pitstop.adapters.torch import ResumableLoader
>>> loader = ResumableLoader(dataset, batch_size=32, shuffle=True, seed=0, num_workers=2)
>>> state = {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler,
...          "loader": loader, "rng": pitstop.RNG()}
>>> start = mgr.restore(state)               # None on a fresh run
>>> step = 0 if start is None else start + 1
>>> for batch in loader: ...                 # continues with the batch that comes next

Captured in place, by reference (no copies): ``nn.Module`` parameters and buffers (also DDP
and ``torch.compile`` wrapped; keys are the unwrapped module's), any ``Optimizer`` (state
and param groups), LR schedulers, ``GradScaler``, plain tensors of every dtype numpy or
ml_dtypes can hold (bfloat16 and float8 included), ``torch.Generator`` objects, and torch's
global CPU/CUDA generators through :class:`pitstop.RNG`. This module is imported by the
adapter registry the first time a torch object shows up in a state.
"""

from __future__ import annotations

from typing import Any

from pitstop.adapters.torch import _rng
from pitstop.adapters.torch._adapter import (
    ModuleAdapter,
    OptimizerAdapter,
    StatefulAdapter,
    TensorAdapter,
    unwrap_module,
)
from pitstop.adapters.torch._ambient import ambient_coordinator, ambient_rank
from pitstop.adapters.torch._hints import DataLoaderHint
from pitstop.adapters.torch._leaf import TensorLeaf, numpy_dtype, pin_staging, torch_dtype
from pitstop.adapters.torch._loader import ResumableLoader
from pitstop.adapters.torch._sampler import ResumableSampler
from pitstop.adapters.torch._values import GeneratorAdapter, SamplerAdapter
from pitstop.adapters.torch._workers import worker_death_hint
from pitstop.adapters.torch.distributed import ProcessGroupCoordinator
from pitstop.core.adapter import Plugin, RNGProvider, register

register(Plugin(
    "torch", modules=("torch",),
    adapters=(SamplerAdapter(), GeneratorAdapter(), OptimizerAdapter(), ModuleAdapter(),
              TensorAdapter()),
    # after the specific ones (it would also match modules and optimizers), before the generic
    fallbacks=(StatefulAdapter(), DataLoaderHint()),
    rng=RNGProvider("torch", "torch", _rng.get_state, _rng.set_state),
    staging_hook=pin_staging, exception_hint=worker_death_hint,
    coordinator=ambient_coordinator, rank=ambient_rank))

__all__ = ["ResumableSampler", "ResumableLoader", "TensorLeaf", "unwrap_module",
           "numpy_dtype", "torch_dtype",
           "import_torch_save", "import_dcp", "export_torch_save", "export_safetensors",
           "ProcessGroupCoordinator"]


def __getattr__(name: str) -> Any:
    # the converters (pitstop.interop) are imported by those who convert; eagerly they would
    # make a cycle: pitstop.interop.torch_save reads this package's key rules (_adapter)
    if name == "import_dcp":
        from pitstop.interop.dcp import import_dcp

        return import_dcp
    if name in ("import_torch_save", "export_torch_save", "export_safetensors"):
        from pitstop.interop import torch_save

        return getattr(torch_save, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
