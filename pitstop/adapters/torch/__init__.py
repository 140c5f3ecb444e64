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

from pitstop.adapters.registry import exception_hints, register_adapter, staging_hooks
from pitstop.adapters.rng import register_rng_provider
from pitstop.adapters.torch import _rng
from pitstop.adapters.torch._adapter import (
    ModuleAdapter,
    OptimizerAdapter,
    StatefulAdapter,
    TensorAdapter,
    unwrap_module,
)
from pitstop.adapters.torch._leaf import TensorLeaf, numpy_dtype, pin_staging, torch_dtype
from pitstop.adapters.torch._sampler import ResumableLoader, ResumableSampler
from pitstop.adapters.torch._values import DataLoaderHint, GeneratorAdapter, SamplerAdapter
from pitstop.adapters.torch._workers import worker_death_hint
from pitstop.adapters.torch.convert import (
    export_safetensors,
    export_torch_save,
    import_dcp,
    import_torch_save,
)
from pitstop.adapters.torch.distributed import ProcessGroupCoordinator

for _adapter in (TensorAdapter(), ModuleAdapter(), OptimizerAdapter(), GeneratorAdapter(),
                 SamplerAdapter()):
    register_adapter(_adapter)
# after the specific ones (it would also match modules and optimizers), before the generic
register_adapter(StatefulAdapter(), first=False)
register_adapter(DataLoaderHint(), first=False)
register_rng_provider("torch", _rng.get_state, _rng.set_state, module="torch")
if pin_staging not in staging_hooks:
    staging_hooks.append(pin_staging)
if worker_death_hint not in exception_hints:
    exception_hints.append(worker_death_hint)

__all__ = ["ResumableSampler", "ResumableLoader", "TensorLeaf", "unwrap_module",
           "numpy_dtype", "torch_dtype",
           "import_torch_save", "import_dcp", "export_torch_save", "export_safetensors",
           "ProcessGroupCoordinator"]
