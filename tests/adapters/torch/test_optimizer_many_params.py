"""An optimizer over many parameters restores as its own ``load_state_dict`` would, without
that method's list scan per state tensor (``param_id in group["params"]``, quadratic in the
parameters): pitstop hands it each saved group's ids as a list whose ``in`` is a set lookup.
The figures are in benchmarks/bench_small.py and docs/performance.md; here, what it must keep."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pitstop
from pitstop.adapters.torch._adapter import _ParamIds


def build(n: int, seed: int = 0, lr: float = 1e-3) -> tuple[nn.ParameterList, torch.optim.Adam]:
    torch.manual_seed(seed)
    model = nn.ParameterList([nn.Parameter(torch.randn(3)) for _ in range(n)])
    params = list(model.parameters())
    half = n // 2
    opt = torch.optim.Adam([{"params": params[:half]}, {"params": params[half:], "lr": lr * 10}],
                           lr=lr)
    return model, opt


def train(model: nn.ParameterList, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def test_ids_answer_in_as_a_list_does() -> None:
    ids = _ParamIds([3, 1, 2, 3])
    assert 3 in ids and 1 in ids and 4 not in ids and "3" not in ids
    ids.append(4)  # grown after the first lookup: the set follows
    assert 4 in ids
    twin = copy.deepcopy(ids)
    assert type(twin) is _ParamIds and list(twin) == [3, 1, 2, 3, 4] and 4 in twin and 5 not in twin
    odd = _ParamIds([[1], 2])  # an unhashable id falls back to the list's own answer
    assert [1] in odd and 2 in odd and [2] not in odd
    assert {1} not in _ParamIds([1, 2])  # an unhashable probe, hashable ids


@pytest.mark.parametrize("n", [1, 7, 3000])
def test_many_parameter_optimizer_restores_as_load_state_dict(tmp_path, n: int) -> None:
    model, opt = build(n)
    train(model, opt, 2, seed=1)
    with pitstop.CheckpointManager(tmp_path / "ck", memory_tier=False) as mgr:
        mgr.save(2, {"model": model, "opt": opt}).wait()

    # through torch's own load_state_dict, and through pitstop, into fresh objects
    ref_model, ref_opt = build(n, seed=5, lr=0.5)
    ref_model.load_state_dict(model.state_dict())
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    seen: list[type] = []
    new_model, new_opt = build(n, seed=5, lr=0.5)
    new_opt.register_load_state_dict_pre_hook(
        lambda o, sd: seen.append(type(sd["param_groups"][0]["params"])))
    with pitstop.CheckpointManager(tmp_path / "ck", read_only=True) as mgr:
        assert mgr.restore({"model": new_model, "opt": new_opt}) == 2
    assert seen == [_ParamIds]  # the user's hook ran, on a list

    for g_new, g_ref in zip(new_opt.param_groups, ref_opt.param_groups, strict=True):
        # the live groups hold the live parameters in a plain list, as load_state_dict leaves
        assert type(g_new["params"]) is list
        assert {k: v for k, v in g_new.items() if k != "params"} == \
            {k: v for k, v in g_ref.items() if k != "params"}
    live = list(new_model.parameters())
    assert [p for g in new_opt.param_groups for p in g["params"]] == live
    for p_new, p_ref in zip(new_model.parameters(), ref_model.parameters(), strict=True):
        s_new, s_ref = new_opt.state[p_new], ref_opt.state[p_ref]
        assert s_new.keys() == s_ref.keys()
        for k in s_ref:
            assert torch.equal(s_new[k], s_ref[k]), k
    # and both train on identically
    train(new_model, new_opt, 1, seed=9)
    train(ref_model, ref_opt, 1, seed=9)
    for a, b in zip(new_model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b)
