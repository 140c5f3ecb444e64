"""The conformance battery (pitstop.testing.AdapterSuite) for PyTorch: modules, optimizers,
schedulers, tensors of every dtype and layout, generators and pitstop.RNG()."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from pitstop.testing import AdapterSuite, Bits

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import pitstop  # noqa: E402


def _model(hidden: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(hidden, 1))


class TestTorchConformance(AdapterSuite):
    def _state(self, hidden: int) -> dict[str, Any]:
        torch.manual_seed(0)  # every generator pitstop.RNG() holds starts the same
        np.random.seed(0)
        random.seed(0)
        model = _model(hidden)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"model": model, "optimizer": opt, "scheduler": sched,
                "data": torch.Generator().manual_seed(1), "rng": pitstop.RNG()}

    def make_state(self) -> dict[str, Any]:
        return self._state(16)

    def train_step(self, state: dict[str, Any], step: int) -> float:
        x = torch.randn(8, 8, generator=state["data"])
        y = x.sum(dim=1, keepdim=True)
        loss = ((state["model"](x) - y) ** 2).mean()  # dropout draws from the global generator
        state["optimizer"].zero_grad()
        loss.backward()
        state["optimizer"].step()
        state["scheduler"].step()
        return loss.item()

    def wrong_shape_target(self) -> dict[str, Any]:
        return self._state(17)

    def to_host(self, obj: Any) -> Any:
        if isinstance(obj, torch.Generator):
            return obj.get_state().numpy()
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            return Bits(f"tensor[{t.dtype}]", tuple(t.shape), data)
        return NotImplemented

    def leaf_examples(self, seed: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(seed)
        dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16,
                  torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64, torch.complex128]
        ints = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
        base = torch.randn(4, 6, generator=g)
        return {
            **{str(d): torch.randn(5, generator=g).to(d) for d in dtypes},
            **{str(d): torch.randint(0, 100, (5,), generator=g).to(d) for d in ints},
            "bool": torch.randint(0, 2, (7,), generator=g).bool(),
            "0-d": torch.tensor(float(seed)),
            "empty": torch.zeros(0, 3),
            "transposed (non-contiguous)": torch.randn(3, 5, generator=g).t(),
            "slice view of a base": base[1:3, ::2],
            "parameter": nn.Parameter(torch.randn(4, generator=g)),
            "module": nn.Linear(3, 2).requires_grad_(False).apply(
                lambda m: [p.copy_(torch.randn(p.shape, generator=g)) for p in m.parameters()]),
            "numpy beside tensors": np.arange(4, dtype=np.float32) * seed,
            "int": seed, "float": seed / 7, "str": f"run {seed}",
            "tuple": (seed, [seed * 0.5]),
            "torch.Generator": torch.Generator().manual_seed(100 + seed),
            "numpy Generator": np.random.default_rng(seed),
        }
