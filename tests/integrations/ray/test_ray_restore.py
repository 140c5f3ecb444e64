"""Checkpointing's restore and its refusals, without a Ray cluster: a Ray run's torch.save
checkpoint continued under pitstop (the migration), and the misuses a Ray user meets."""

from __future__ import annotations

import os

import pytest
import torch
from ray.train import Checkpoint

import pitstop
from pitstop.integrations.ray import Checkpointing, resumable_loader


def model_and_opt(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def test_a_torch_save_checkpoint_of_a_ray_run_is_imported_and_restored(tmp_path):
    # what Ray's guide writes: torch.save into a folder, Checkpoint.from_directory(folder)
    old = tmp_path / "ray_ckpt"
    old.mkdir()
    model, opt = model_and_opt(1)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 41},
               old / "checkpoint.pt")
    fresh, fresh_opt = model_and_opt(2)
    state = {"model": fresh, "optimizer": fresh_opt, "rng": pitstop.RNG()}
    with Checkpointing(state, tmp_path / "run") as ckpt:
        assert ckpt.restore(Checkpoint.from_directory(str(old))) == 41
        assert ckpt.report({"loss": 1.0}, step=42, checkpoint=True)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"],
                       opt.state_dict()["state"][0]["exp_avg"])
    with pitstop.CheckpointManager(tmp_path / "run", read_only=True) as mgr:
        assert mgr.all_steps() == [42]  # the import itself is not kept
    # the next start of the run finds its own newest step, not the old file again
    with Checkpointing(state, tmp_path / "run") as ckpt:
        assert ckpt.restore(Checkpoint.from_directory(str(old))) == 42


def test_a_torch_save_file_without_a_step_needs_torch_step(tmp_path):
    old = tmp_path / "ray_ckpt"
    old.mkdir()
    model, opt = model_and_opt(1)
    torch.save({"model": model.state_dict()}, old / "model.pt")
    with Checkpointing({"model": model}, tmp_path / "run") as ckpt:
        with pytest.raises(pitstop.InvalidArgumentError, match="torch_step"):
            ckpt.restore(Checkpoint.from_directory(str(old)))
        assert ckpt.restore(Checkpoint.from_directory(str(old)), torch_step=7) == 7


def test_misuses_are_refused_with_what_to_do(tmp_path):
    model, _ = model_and_opt(0)
    with pytest.raises(pitstop.InvalidArgumentError, match="num_to_keep"):
        Checkpointing({"model": model}, tmp_path / "a", keep_last=3)
    with pytest.raises(pitstop.InvalidArgumentError, match="not inside a Ray Train worker"):
        Checkpointing({"model": model})
    # a Ray checkpoint folder with neither pitstop's nor torch.save's files
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    with Checkpointing({"model": model}, tmp_path / "b") as ckpt:
        with pytest.raises(pitstop.CheckpointNotFoundError, match="notes.txt"):
            ckpt.restore(Checkpoint.from_directory(str(empty)))
        ckpt.report({}, step=3, checkpoint=True)
        assert ckpt.path(3) == os.path.join(str(tmp_path / "b"), "step_0000000003")
    # a pitstop checkpoint of another run (resume_from_checkpoint=result.checkpoint): read
    # where it is, and this run's directory starts with the next save
    other, _ = model_and_opt(5)
    with Checkpointing({"model": other}, tmp_path / "c") as ckpt:
        assert ckpt.restore(Checkpoint.from_directory(str(tmp_path / "b" / "step_0000000003"))) == 3
        assert torch.equal(other.weight, model.weight)
        ckpt.report({}, step=4, checkpoint=True)
    with pitstop.CheckpointManager(tmp_path / "c", read_only=True) as mgr:
        assert mgr.all_steps() == [4]
    # Ray's checkpoint of this directory, deleted behind Ray's back
    with Checkpointing({"model": model}, tmp_path / "b") as ckpt:
        gone = Checkpoint.from_directory(str(tmp_path / "b" / "step_0000000009"))
        with pytest.raises(pitstop.CheckpointNotFoundError, match="deleted or damaged"):
            ckpt.restore(gone)


def test_resumable_loader_keeps_a_distributed_samplers_order():
    data = torch.utils.data.TensorDataset(torch.arange(20.0))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=1, shuffle=True,
                                                  seed=5)
    plain = torch.utils.data.DataLoader(data, batch_size=3, sampler=sampler)
    loader = resumable_loader(plain)
    assert [b[0].tolist() for b in loader] == [b[0].tolist() for b in plain]
    weighted = torch.utils.data.DataLoader(  # any other sampler: ResumableLoader.from_loader
        data, batch_size=4, sampler=torch.utils.data.WeightedRandomSampler([1.0] * 20, 20))
    again = resumable_loader(weighted, seed=3)
    first = [b[0].tolist() for b in again]
    assert [b[0].tolist() for b in resumable_loader(weighted, seed=3)] == first
    with pytest.raises(pitstop.InvalidArgumentError, match="resumable_loader"):
        resumable_loader([1, 2, 3])


def test_nonfinite_guard_and_a_step_saved_twice(tmp_path):
    model, _ = model_and_opt(0)
    with Checkpointing({"model": model}, tmp_path / "g", save_every_steps=1,
                       nonfinite_guard=True) as ckpt:
        assert not ckpt.report({"loss": float("nan")}, step=0)  # metrics alone, no checkpoint
        assert ckpt.report({"loss": 0.5}, step=1)
        with pytest.raises(pitstop.StepExistsError, match="1"):
            ckpt.report({"loss": 0.5}, step=1, checkpoint=True)
    with pitstop.CheckpointManager(tmp_path / "g", read_only=True) as mgr:
        assert mgr.all_steps() == [1]
