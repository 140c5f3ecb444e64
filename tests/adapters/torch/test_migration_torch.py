"""docs/migration.md, "From torch.save" and "From DCP": every row, the same loop through the
peer and through pitstop side by side in this process: the same steps kept, the same values
restored. (The DCP row "the same calls on every rank" is proved with real ranks in
tests/adapters/torch/test_distributed.py, whose workers restore what DCP restores: ``dcp_agrees``.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import pitstop
from pitstop.adapters.torch import (
    export_safetensors,
    export_torch_save,
    import_dcp,
    import_torch_save,
)


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.rand(4, 3)).square().sum().backward()
    opt.step()


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Tensors equal bit for bit (state dicts, nested), everything else equal."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, set(a), set(b))
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}/{i}")
    else:
        assert a == b, (where, a, b)


def by_hand(directory: Path, steps: range, every: int, keep_last: int,
            keep_every: int | None) -> list[int]:
    """The torch.save loop users write: "is it time to save?", file names, old files
    deleted by hand (all but the newest ``keep_last`` and the multiples of ``keep_every``).
    The global RNG's state goes along by hand too."""
    directory.mkdir()
    model, opt = make()
    for step in steps:
        train_step(model, opt)
        if step % every == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "epoch": step // 4, "rng": torch.get_rng_state()},
                       directory / f"ckpt_{step}.pt")
            saved = sorted(int(p.stem[5:]) for p in directory.glob("ckpt_*.pt"))
            for old in saved[:-keep_last]:
                if keep_every is None or old % keep_every:
                    (directory / f"ckpt_{old}.pt").unlink()
    return sorted(int(p.stem[5:]) for p in directory.glob("ckpt_*.pt"))


def with_pitstop(directory: Path, steps: range, **kwargs: Any) -> list[int]:
    model, opt = make()
    with pitstop.CheckpointManager(directory, on_busy="wait", **kwargs) as mgr:
        for step in steps:
            train_step(model, opt)
            mgr.step(step, {"model": model, "optimizer": opt, "epoch": step // 4,
                            "rng": pitstop.RNG(only=["torch"])})
        mgr.wait()
        return mgr.all_steps()


@pytest.mark.parametrize("keep", [{"keep_last": 2}, {"keep_last": 1, "keep_every_steps": 6}])
def test_torch_save_loop_and_its_resume_are_step_and_restore(tmp_path: Path,
                                                             keep: dict[str, int]) -> None:
    """``torch.save`` every 3 steps with old files deleted by hand, then ``torch.load`` +
    ``load_state_dict`` + ``torch.set_rng_state``; and ``mgr.step()`` with
    ``save_every_steps=3`` + ``keep_last`` / ``keep_every_steps``, then ``mgr.restore()``:
    the same steps kept, the same model, optimizer, epoch and random stream after resume."""
    kept = by_hand(tmp_path / "pt", range(14), 3, keep["keep_last"],
                   keep.get("keep_every_steps"))
    assert with_pitstop(tmp_path / "ps", range(14), save_every_steps=3, **keep) == kept
    assert kept == ([9, 12] if len(keep) == 1 else [0, 6, 12])

    ckpt = torch.load(tmp_path / "pt" / f"ckpt_{kept[-1]}.pt")
    theirs_model, theirs_opt = make()
    theirs_model.load_state_dict(ckpt["model"])
    theirs_opt.load_state_dict(ckpt["optimizer"])
    torch.set_rng_state(ckpt["rng"])
    theirs_draw = torch.rand(5)

    ours_model, ours_opt = make()
    state = {"model": ours_model, "optimizer": ours_opt, "epoch": 0,
             "rng": pitstop.RNG(only=["torch"])}
    with pitstop.CheckpointManager(tmp_path / "ps", read_only=True) as mgr:
        assert mgr.restore(state) == kept[-1]
    ours_draw = torch.rand(5)
    assert_same(ours_model.state_dict(), theirs_model.state_dict(), "model")
    assert_same(ours_opt.state_dict(), theirs_opt.state_dict(), "optimizer")
    assert state["epoch"] == ckpt["epoch"]
    assert torch.equal(ours_draw, theirs_draw)


def test_torch_save_files_come_in_and_go_out(tmp_path: Path) -> None:
    """``import_torch_save`` holds what ``torch.load`` reads; ``export_torch_save`` and
    ``export_safetensors`` write what ``torch.load(weights_only=True)`` and safetensors read
    as the saved state."""
    model, opt = make()
    train_step(model, opt)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 2},
               tmp_path / "ckpt_7.pt")
    want = torch.load(tmp_path / "ckpt_7.pt")
    import_torch_save(tmp_path / "ckpt_7.pt", tmp_path / "imported", step=7)
    fresh, fresh_opt = make()
    state = {"model": fresh, "optimizer": fresh_opt, "epoch": 0}
    with pitstop.CheckpointManager(tmp_path / "imported", read_only=True) as mgr:
        assert mgr.restore(state) == 7
    assert_same(fresh.state_dict(), want["model"], "model")
    assert_same(fresh_opt.state_dict(), want["optimizer"], "optimizer")
    assert state["epoch"] == 2

    export_torch_save(tmp_path / "imported", tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert_same(back["model"], want["model"], "exported model")
    assert back["epoch"] == 2
    safetensors_torch = pytest.importorskip("safetensors.torch")
    export_safetensors(tmp_path / "imported", tmp_path / "model.safetensors", key="model")
    assert_same(safetensors_torch.load_file(tmp_path / "model.safetensors"), want["model"],
                "safetensors")


def test_dcp_save_async_save_and_load_are_save_wait_and_restore(tmp_path: Path) -> None:
    """``dcp.save`` / ``dcp.async_save(...).result()`` / ``dcp.load`` and ``mgr.save().wait()``
    / ``handle.wait()`` / ``mgr.restore(state, step=N)``: the same values back; and
    ``import_dcp`` of DCP's directory restores them too."""
    model, opt = make()
    with pitstop.CheckpointManager(tmp_path / "ps") as mgr:
        saved = {}
        for step in (1, 2):
            train_step(model, opt)
            sd = {"model": model.state_dict(), "optimizer": opt.state_dict()}
            if step == 1:
                dcp.save(sd, checkpoint_id=str(tmp_path / "dcp" / "1"))
                mgr.save(step, {"model": model, "optimizer": opt}).wait()
            else:
                dcp.async_save(sd, checkpoint_id=str(tmp_path / "dcp" / "2")).result()
                handle = mgr.save(step, {"model": model, "optimizer": opt})
                handle.wait()
            saved[step] = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
        for step in (1, 2):
            theirs_model, theirs_opt = make()
            train_step(theirs_model, theirs_opt)  # (DCP loads into a state of the same shape)
            sd = {"model": theirs_model.state_dict(), "optimizer": theirs_opt.state_dict()}
            dcp.load(sd, checkpoint_id=str(tmp_path / "dcp" / str(step)))
            theirs_model.load_state_dict(sd["model"])
            theirs_opt.load_state_dict(sd["optimizer"])
            ours_model, ours_opt = make()
            assert mgr.restore({"model": ours_model, "optimizer": ours_opt}, step=step) == step
            assert_same(ours_model.state_dict(), theirs_model.state_dict(), f"model {step}")
            assert_same(ours_opt.state_dict(), theirs_opt.state_dict(), f"optimizer {step}")
            assert_same(ours_model.state_dict(), saved[step]["model"], f"saved {step}")
    import_dcp(tmp_path / "dcp" / "2", tmp_path / "imported", step=2)
    ours_model, ours_opt = make()
    with pitstop.CheckpointManager(tmp_path / "imported", read_only=True) as mgr:
        assert mgr.restore({"model": ours_model, "optimizer": ours_opt}) == 2
    assert_same(ours_model.state_dict(), theirs_model.state_dict(), "imported model")
    assert_same(ours_opt.state_dict(), theirs_opt.state_dict(), "imported optimizer")
