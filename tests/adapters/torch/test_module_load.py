"""A module gets its restored state through its own load_state_dict, as after torch.load:
load hooks and ``_load_from_state_dict`` overrides run (derived caches are refreshed,
quantization observers resize their buffers), extra state of any kind is taken as torch
takes it, and parameters restored in place stay the very same tensors."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch_helpers import same_bits

import pitstop
from pitstop.adapters.torch._adapter import ModuleAdapter

# torch.compile's import of dynamo warns about torch.jit; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:.*script_method.*:DeprecationWarning")


class Fused(nn.Module):
    """Keeps a derived buffer (``qk``, not saved) that a load_state_dict post-hook refreshes,
    as fused/packed weights, tied copies and EMA shadows do."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)
        self.k = nn.Linear(4, 4)
        self.register_buffer("qk", torch.empty(8, 4), persistent=False)
        self.register_load_state_dict_post_hook(lambda mod, keys: mod.refresh())
        self.pre_hook_calls = 0
        self.register_load_state_dict_pre_hook(self._count)
        self.refresh()

    def _count(self, *args) -> None:
        self.pre_hook_calls += 1

    @torch.no_grad()
    def refresh(self) -> None:
        self.qk.copy_(torch.cat([self.q.weight, self.k.weight]))

    def forward(self, x):
        return x @ self.qk.t()


class Scaled(nn.Linear):
    """Overrides _load_from_state_dict (as modules that migrate old checkpoints do)."""

    def __init__(self) -> None:
        super().__init__(3, 3)
        self.loads = 0

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.loads += 1


def test_restore_runs_load_hooks_and_overrides_and_keeps_the_tensors(manager):
    torch.manual_seed(0)
    src = nn.ModuleDict({"fused": Fused(), "scaled": Scaled()})
    with torch.no_grad():
        src["fused"].q.weight.mul_(3)
    src["fused"].refresh()
    x = torch.randn(2, 4)
    want = src["fused"](x)
    mgr = manager()
    mgr.save(1, {"model": src})

    torch.manual_seed(1)
    target = nn.ModuleDict({"fused": Fused(), "scaled": Scaled()})
    params = list(target.parameters())
    ptrs = [p.data_ptr() for p in params]
    mgr.restore({"model": target})
    assert same_bits(target["fused"](x), want)  # the derived cache was refreshed
    assert target["fused"].pre_hook_calls == 1 and target["scaled"].loads == 1
    # tensors restored in place are handed back as themselves: same objects, same memory
    assert all(a is b for a, b in zip(params, target.parameters(), strict=True))
    assert [p.data_ptr() for p in target.parameters()] == ptrs
    for a, b in zip(src.parameters(), target.parameters(), strict=True):
        assert same_bits(a, b)


@pytest.mark.parametrize("cls", [nn.Linear, Scaled], ids=["plain", "override"])
def test_restore_into_a_module_of_inference_tensors(manager, cls):
    """Inference tensors take in-place writes only inside inference mode, also the no-op
    copies of the module's own load_state_dict."""
    torch.manual_seed(0)
    src = nn.Linear(3, 3)
    mgr = manager()
    mgr.save(1, {"model": src})
    with torch.inference_mode():
        target = cls(3, 3) if cls is nn.Linear else cls()
    mgr.restore({"model": target})
    assert same_bits(target.weight, src.weight) and same_bits(target.bias, src.bias)


class ExtraTensor(nn.Module):
    """``get_extra_state`` returns a tensor whose length varies (TransformerEngine keeps its
    fp8 metadata as a uint8 tensor of pickled bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.meta = b"\0"

    def get_extra_state(self):
        return torch.frombuffer(bytearray(self.meta), dtype=torch.uint8).clone()

    def set_extra_state(self, state):
        self.meta = bytes(state.numpy())


@pytest.mark.parametrize("strict", [True, False])
def test_extra_state_tensor_of_another_length_is_taken_as_torch_takes_it(manager, strict):
    src = ExtraTensor()
    src.meta = b"amax-history-v2"
    mgr = manager()
    mgr.save(1, {"model": src})
    torch_loaded = ExtraTensor()
    torch_loaded.load_state_dict(src.state_dict())
    target = ExtraTensor()
    r = mgr.restore({"model": target}, strict=strict)
    assert target.meta == torch_loaded.meta == b"amax-history-v2"
    assert r.mismatched_keys == [] and r.missing_keys == []
    assert same_bits(target.lin.weight, src.lin.weight)


def qat_model() -> nn.Module:
    tq = pytest.importorskip("torch.ao.quantization")
    torch.manual_seed(0)
    m = nn.Sequential(tq.QuantStub(), nn.Linear(4, 4), nn.ReLU(), tq.DeQuantStub())
    m.qconfig = tq.get_default_qat_qconfig("fbgemm")
    m.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notices
        return tq.prepare_qat(m)


def test_quantization_aware_training_resumes_with_resized_observers(manager):
    """Observers and FakeQuantize start with empty (or 1-element) buffers and resize them in
    their own _load_from_state_dict; the restore hands those entries to it, strict, and the
    model then computes exactly what the same model loaded by torch computes."""
    src = qat_model()
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        src(torch.randn(8, 4, generator=g))
    obs = src[1].weight_fake_quant.activation_post_process
    obs.eps.fill_(1e-3)  # a buffer an observer re-creates when it sees an old version
    sd = copy.deepcopy(src.state_dict())
    mgr = manager()
    mgr.save(1, {"model": src})

    by_torch = qat_model()
    assert by_torch.load_state_dict(sd) is not None
    target = qat_model()
    assert mgr.restore({"model": target}) == 1  # strict
    mine, theirs = target.state_dict(), by_torch.state_dict()
    assert list(mine) == list(theirs)
    for k in theirs:
        assert same_bits(mine[k], theirs[k]), k
    assert float(target[1].weight_fake_quant.activation_post_process.eps) == pytest.approx(1e-3)
    x = torch.randn(5, 4, generator=g)
    target.eval()
    by_torch.eval()
    assert same_bits(target(x), by_torch(x))  # (each observes its first input here)


class Migrating(nn.Linear):
    """A user module overriding _load_from_state_dict that does not resize anything."""

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)


def test_replaceable_names_extra_state_and_self_loading_submodules():
    tq = pytest.importorskip("torch.ao.quantization")
    model = nn.ModuleDict({"bn": nn.BatchNorm1d(3), "extra": ExtraTensor(),
                           "obs": tq.MinMaxObserver(), "user": Migrating(2, 2)})
    names = set(ModuleAdapter().replaceable(torch.compile(model)))
    # torch.nn's own overrides (BatchNorm) keep torch's shape check: not named
    assert names == {"extra._extra_state", "obs.min_val", "obs.max_val", "obs.eps",
                     "user.weight", "user.bias"}
    assert names <= set(model.state_dict())


def test_a_real_mismatch_in_a_self_loading_module_is_refused_by_its_load_state_dict(manager):
    """What the module's own load_state_dict refuses is refused, with torch's reason: the
    restore then says that the target was partly restored (nothing could know before)."""
    mgr = manager()
    mgr.save(1, {"model": nn.Sequential(Migrating(2, 3))})
    with pytest.raises(pitstop.CheckpointError, match="size mismatch.*partly restored|"
                                                      "partly restored.*size mismatch") as e:
        mgr.restore({"model": nn.Sequential(Migrating(2, 4))})
    assert not isinstance(e.value, pitstop.IncompatibleTargetError)
