"""Restoring torch objects: what load_state_dict would refuse is refused up front (``check``),
as a pitstop error that says what to do; an optimizer restores like its own load_state_dict
(replacing state that has moved on), but keeps each state tensor's saved dtype and object.

Tests that go through CheckpointManager rely on the core calling ``check`` before writing
and honouring ``replace_on_mismatch``.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch_helpers import same_bits

import pitstop
from pitstop.adapters.torch import TensorLeaf
from pitstop.adapters.torch._adapter import ModuleAdapter, OptimizerAdapter, StatefulAdapter
from pitstop.adapters.torch._values import GeneratorAdapter
from pitstop.core.tree import ArraySpec


def specs(tree: Any) -> Any:
    """A loaded checkpoint subtree as ``check`` sees it: arrays as ArraySpec."""
    if isinstance(tree, np.ndarray):
        return ArraySpec(tuple(tree.shape), tree.dtype)
    if isinstance(tree, dict):
        return {k: specs(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [specs(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(specs(v) for v in tree)
    return tree


def batches(seed: int, n: int, shape=(5, 4)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def opt_state(opt: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """A copy of the optimizer's per-parameter state (state_dict() references live tensors)."""
    return copy.deepcopy(opt.state_dict()["state"])


def causes(e: BaseException) -> list[BaseException]:
    out = []
    while e.__cause__ is not None:
        e = e.__cause__
        out.append(e)
    return out


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for i in a:
        assert a[i].keys() == b[i].keys(), i
        for k, v in a[i].items():
            w = b[i][k]
            if isinstance(v, torch.Tensor):
                assert same_bits(v, w), (i, k)
            elif isinstance(v, list):
                assert len(v) == len(w) and all(same_bits(x, y) for x, y in zip(v, w, strict=True)), (i, k)
            else:
                assert v == w, (i, k)


# ----------------------------------------------------------------- optimizer: saved dtypes
class MasterMomentum(torch.optim.Optimizer):
    """Momentum SGD that keeps its momentum in float32 for low-precision parameters (as
    mixed-precision optimizers do): ``load_state_dict`` would cast it to bfloat16."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "m" not in st:
                    st["m"] = torch.zeros_like(p, dtype=torch.float32)
                st["m"].mul_(0.9).add_(p.grad.float())
                p.sub_((group["lr"] * st["m"]).to(p.dtype))


def bf16_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(4, 3).to(torch.bfloat16)


def train_bf16(model, opt, data) -> None:
    for x in data:
        opt.zero_grad()
        model(x.to(torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("target_stepped", [False, True], ids=["fresh", "stepped"])
def test_optimizer_state_keeps_the_dtype_it_was_saved_with(manager, target_stepped):
    model = bf16_model(0)
    opt = MasterMomentum(model.parameters())
    train_bf16(model, opt, batches(1, 3))
    mgr = manager()
    mgr.save(3, {"model": model, "opt": opt})
    train_bf16(model, opt, batches(2, 3))  # the run that was never interrupted

    model2 = bf16_model(5)
    opt2 = MasterMomentum(model2.parameters())
    if target_stepped:
        train_bf16(model2, opt2, batches(9, 1))  # state present: restored in place
    live = [opt2.state[p].get("m") for p in model2.parameters()]
    mgr.restore({"model": model2, "opt": opt2})
    for p, before in zip(model2.parameters(), live, strict=True):
        m = opt2.state[p]["m"]
        assert m.dtype == torch.float32  # not cast to the parameter's bfloat16
        if target_stepped:
            assert m is before  # the tensor restored in place is the one in the state
    train_bf16(model2, opt2, batches(2, 3))
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert same_bits(a, b)  # training goes on exactly as the uninterrupted run


# ----------------------------------------------------------------- optimizer: replace
def two_layer(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def train_first_layer_only(model, opt, data) -> None:
    """Only layer 0 gets gradients (layer 1 is frozen for a warm-up, say)."""
    for x in data:
        opt.zero_grad()
        model[0](x).pow(2).mean().backward()
        opt.step()


def train_all(model, opt, data) -> None:
    for x in data:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def test_optimizer_apply_takes_a_rebuilt_or_mixed_tree(manager):
    """What the core hands ``apply`` under ``replace_on_mismatch``: the checkpoint's subtree
    with fresh numpy arrays (here next to a live tensor lr restored in place)."""
    assert OptimizerAdapter.replace_on_mismatch is True
    model = two_layer(0)
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    train_first_layer_only(model, opt, batches(1, 2))
    mgr = manager()
    mgr.save(2, {"opt": opt})
    saved = opt_state(opt)
    train_all(model, opt, batches(2, 2))  # now layer 1 has state too
    assert len(opt_state(opt)) == 4

    tree = mgr.load()["opt"]
    lr = opt.param_groups[0]["lr"]
    tree["param_groups"][0]["lr"] = TensorLeaf(lr)  # in place, as the core leaves it
    OptimizerAdapter().apply(opt, tree)
    assert_same_state(opt_state(opt), saved)  # layer 1's newer state is gone, as torch does
    assert opt.param_groups[0]["lr"] is lr


def test_restore_into_an_optimizer_that_stepped_further_replaces_its_state(manager):
    model = two_layer(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = {"model": model, "opt": opt}
    train_first_layer_only(model, opt, batches(1, 2))
    mgr = manager()
    mgr.save(2, state)
    saved = opt_state(opt)
    train_all(model, opt, batches(2, 3))  # layer 1 got its first gradients since

    assert mgr.restore(state) == 2  # e.g. a rollback after a loss spike
    assert_same_state(opt_state(opt), saved)
    train_all(model, opt, batches(3, 2))
    fresh, fresh_opt = two_layer(7), None
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    mgr.restore({"model": fresh, "opt": fresh_opt})
    train_all(fresh, fresh_opt, batches(3, 2))
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert same_bits(a, b)


def lbfgs_run(seed: int) -> tuple[nn.Module, torch.optim.LBFGS]:
    model = two_layer(seed)
    return model, torch.optim.LBFGS(model.parameters(), lr=0.5, history_size=20, max_iter=2)


def lbfgs_steps(model, opt, data) -> None:
    for x in data:
        def closure(x=x):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss
        opt.step(closure)


def test_lbfgs_apply_takes_history_lists_of_another_length(manager):
    model, opt = lbfgs_run(0)
    lbfgs_steps(model, opt, batches(1, 1))
    mgr = manager()
    mgr.save(1, {"opt": opt})
    saved = opt_state(opt)
    lbfgs_steps(model, opt, batches(2, 2))
    assert len(opt_state(opt)[0]["old_dirs"]) != len(saved[0]["old_dirs"])
    OptimizerAdapter().apply(opt, mgr.load()["opt"])
    assert_same_state(opt_state(opt), saved)


def test_lbfgs_restore_after_more_steps(manager):
    model, opt = lbfgs_run(0)
    lbfgs_steps(model, opt, batches(1, 1))
    mgr = manager()
    mgr.save(1, {"model": model, "opt": opt})
    saved = opt_state(opt)
    lbfgs_steps(model, opt, batches(2, 2))
    assert mgr.restore({"model": model, "opt": opt}) == 1
    assert_same_state(opt_state(opt), saved)


# ----------------------------------------------------------------- optimizer: preconditions
def test_optimizer_with_other_parameter_groups_is_refused_up_front(manager):
    model = two_layer(0)
    opt = torch.optim.SGD([{"params": model[0].parameters()},
                           {"params": model[1].parameters(), "lr": 0.5}], lr=0.1, momentum=0.9)
    train_all(model, opt, batches(1, 1))
    mgr = manager()
    mgr.save(1, {"model": model, "opt": opt})
    tree = specs(mgr.load()["opt"])

    one_group = torch.optim.SGD(two_layer(1).parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(pitstop.IncompatibleTargetError, match="2 parameter groups, this one has 1"):
        OptimizerAdapter().check(one_group, tree)
    m2 = two_layer(1)
    other_sizes = torch.optim.SGD([{"params": [m2[0].weight]},
                                   {"params": [m2[0].bias, *m2[1].parameters()]}], lr=0.1)
    with pytest.raises(pitstop.IncompatibleTargetError, match="group 0 .* 2 parameters.* 1"):
        OptimizerAdapter().check(other_sizes, tree)
    with pytest.raises(pitstop.IncompatibleTargetError, match="not an optimizer state dict"):
        OptimizerAdapter().check(one_group, {"last_epoch": 3})
    OptimizerAdapter().check(torch.optim.SGD([{"params": m2[0].parameters()},
                                              {"params": m2[1].parameters()}], lr=0.1), tree)

    target = {"model": two_layer(1), "opt": None}
    target["opt"] = torch.optim.SGD(target["model"].parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(pitstop.IncompatibleTargetError, match="parameter groups"):
        mgr.restore(target)


def test_optimizer_refusal_leaves_the_model_untouched(manager):
    model = two_layer(0)
    opt = torch.optim.SGD([{"params": model[0].parameters()},
                           {"params": model[1].parameters()}], lr=0.1)
    mgr = manager()
    mgr.save(1, {"model": model, "opt": opt})
    other = two_layer(1)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(pitstop.IncompatibleTargetError, match="parameter groups"):
        mgr.restore({"model": other, "opt": torch.optim.SGD(other.parameters(), lr=0.1)})
    for k, v in other.state_dict().items():
        assert same_bits(v, before[k]), k


# ----------------------------------------------------------------- GradScaler, schedulers
def test_enabled_grad_scaler_from_a_disabled_ones_state_is_refused(manager):
    mgr = manager()
    mgr.save(1, {"w": torch.ones(2), "scaler": torch.amp.GradScaler("cpu", enabled=False)})
    enabled = torch.amp.GradScaler("cpu")
    with pytest.raises(pitstop.IncompatibleTargetError, match="disabled.*enabled=False"):
        StatefulAdapter().check(enabled, {})
    with pytest.raises(pitstop.IncompatibleTargetError, match="disabled"):
        mgr.restore({"w": torch.zeros(2), "scaler": enabled})
    StatefulAdapter().check(torch.amp.GradScaler("cpu", enabled=False), {})  # ignores any
    assert StatefulAdapter.replace_on_mismatch is True


def test_grad_scaler_refusal_leaves_the_rest_untouched(manager):
    mgr = manager()
    mgr.save(1, {"w": torch.ones(2), "scaler": torch.amp.GradScaler("cpu", enabled=False)})
    target = {"w": torch.zeros(2), "scaler": torch.amp.GradScaler("cpu")}
    with pytest.raises(pitstop.IncompatibleTargetError, match="disabled"):
        mgr.restore(target)
    assert torch.equal(target["w"], torch.zeros(2))


def sequential(opt, n: int):
    scheds = [torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2)
              for _ in range(n)]
    return torch.optim.lr_scheduler.SequentialLR(opt, scheds, milestones=list(range(2, 2 * n, 2)))


@pytest.mark.parametrize("saved_n,target_n", [(3, 2), (2, 3)])
def test_scheduler_chain_of_another_length_is_refused(manager, saved_n, target_n):
    """torch raises IndexError for a longer saved chain and silently loads part of a shorter
    one; both are refused, naming what differs."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = sequential(opt, saved_n)
    mgr = manager()
    mgr.save(1, {"sched": sched})
    opt2 = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    target = sequential(opt2, target_n)
    match = f"{saved_n} schedulers, this one has {target_n}"
    with pytest.raises(pitstop.IncompatibleTargetError, match=match):
        StatefulAdapter().check(target, specs(mgr.load()["sched"]))
    with pytest.raises(pitstop.IncompatibleTargetError, match=match):
        mgr.restore({"sched": target})


def test_a_load_state_dict_that_raises_becomes_a_checkpoint_error(manager):
    class Strict:
        def state_dict(self):
            return {"version": 1}

        def load_state_dict(self, sd):
            if sd["version"] != 2:
                raise ValueError("version 2 expected")

    with pytest.raises(pitstop.IncompatibleTargetError, match="version 2 expected") as e:
        StatefulAdapter().apply(Strict(), {"version": 1})
    assert isinstance(e.value.__cause__, ValueError)


class Versioned(nn.Module):
    def __init__(self, version: int) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.version = version

    def get_extra_state(self):
        return {"version": self.version}

    def set_extra_state(self, state):
        if state["version"] != self.version:
            raise ValueError(f"this module reads version {self.version} only")


def test_module_extra_state_refusal_is_a_checkpoint_error_with_the_cause(manager):
    mgr = manager()
    mgr.save(1, {"m": Versioned(1)})
    # refused in apply (no check could know it): the error says the target is partly restored
    with pytest.raises(pitstop.CheckpointError, match="version 2 only") as e:
        mgr.restore({"m": Versioned(2)})
    assert "partly restored" in str(e.value)
    assert not isinstance(e.value, pitstop.IncompatibleTargetError)  # that one means untouched
    assert any(isinstance(c, ValueError) for c in causes(e.value))
    with pytest.raises(pitstop.IncompatibleTargetError):
        ModuleAdapter().apply(Versioned(2), {"_extra_state": {"version": 1}})


def test_generator_state_of_another_device_or_size_is_refused():
    g = torch.Generator()
    with pytest.raises(pitstop.IncompatibleTargetError, match="cuda torch.Generator"):
        GeneratorAdapter().check(g, {"device": "cuda:0", "state": bytes(16)})
    with pytest.raises(pitstop.IncompatibleTargetError, match="16 bytes"):
        GeneratorAdapter().apply(g, {"device": "cpu", "state": bytes(16)})
    GeneratorAdapter().check(g, GeneratorAdapter().capture(torch.Generator()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_optimizer_state_rebuilt_on_cuda_keeps_its_dtype(manager):
    model = bf16_model(0).cuda()
    opt = MasterMomentum(model.parameters())
    train_bf16(model, opt, [x.cuda() for x in batches(1, 2)])
    mgr = manager()
    mgr.save(2, {"model": model, "opt": opt})
    model2 = bf16_model(5).cuda()
    opt2 = MasterMomentum(model2.parameters())
    mgr.restore({"model": model2, "opt": opt2})
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        m = opt2.state[q]["m"]
        assert m.dtype == torch.float32 and m.device == q.device
        assert same_bits(m.cpu(), opt.state[p]["m"].cpu())


def test_another_kind_of_generator_saved_there_is_named(manager):
    mgr = manager()
    mgr.save(1, {"g": np.random.default_rng(0)})
    with pytest.raises(pitstop.IncompatibleTargetError, match="numpy generator's state"):
        mgr.restore({"g": torch.Generator()})
    with pytest.raises(pitstop.IncompatibleTargetError, match="random.Random state"):
        GeneratorAdapter().check(torch.Generator(), (3, (1, 2), None))


def test_a_tensor_metric_must_be_one_number(manager):
    mgr = manager()
    model = torch.nn.Linear(2, 1)
    with pytest.raises(pitstop.InvalidArgumentError, match="'loss'.*single number"):
        mgr.save(1, {"model": model}, metrics={"loss": torch.ones(3)})
    assert mgr.all_steps() == []
    mgr.save(1, {"model": model}, metrics={"loss": torch.tensor(0.5)}).wait()
    assert mgr.metadata(1).metrics == {"loss": 0.5}
