"""Lightning's checkpoint conventions through PitstopCheckpoint: ModelCheckpoint's save_last,
save_top_k and monitor, ckpt_path="last" and the paths Lightning names, Lightning's own
.ckpt files (migration), and what a user gets wrong."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import pitstop  # noqa: E402
from pitstop.integrations.lightning import PitstopCheckpoint, load_checkpoint  # noqa: E402


class Tiny(pl.LightningModule):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, width), nn.Dropout(0.2), nn.Linear(width, 1))
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def on_save_checkpoint(self, checkpoint):
        checkpoint["my_note"] = {"steps": self.global_step}

    def on_load_checkpoint(self, checkpoint):
        self.note = checkpoint["my_note"]

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    return DataLoader(data, batch_size=4, shuffle=True)


def _trainer(tmp: Path, steps: int, *callbacks, **kw) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, enable_progress_bar=False,
                      logger=False, enable_model_summary=False, default_root_dir=tmp,
                      callbacks=list(callbacks), **kw)


def _ckpt(tmp: Path, **kw) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=tmp / "ckpts", **kw)


def test_save_last_top_k_and_the_paths_lightning_names(tmp_path: Path) -> None:
    mc = _ckpt(tmp_path, save_last=True, save_top_k=2, monitor="train_loss", every_n_train_steps=2)
    trainer = _trainer(tmp_path, 10, PitstopCheckpoint(tmp_path / "pit"), mc)
    trainer.fit(Tiny(), _loader())  # save_last after each top-k save: no StepExistsError
    files = sorted(os.listdir(tmp_path / "ckpts"))
    assert "last.ckpt" in files and len(files) == 3, files  # save_top_k=2 kept two, plus last
    kept = {Path(p).name for p in mc.best_k_models}
    assert kept == set(files) - {"last.ckpt"}
    for name in files:  # each a pointer to a committed pitstop step
        pointer = json.loads((tmp_path / "ckpts" / name).read_text())
        assert pointer["directory"] == str(tmp_path / "pit")
    with pitstop.CheckpointManager(tmp_path / "pit", read_only=True) as mgr:
        steps = set(mgr.all_steps())
    named = {json.loads((tmp_path / "ckpts" / n).read_text())["step"] for n in files}
    assert named <= steps and len(steps) <= len(named) + 1  # top-k's removals deleted the rest

    # best_model_path resumes: the model, optimizer, scheduler and loops of that save
    best = load_checkpoint(mc.best_model_path)
    assert best["global_step"] == int(Path(mc.best_model_path).stem.split("step=")[1])
    model = Tiny()
    mc2 = _ckpt(tmp_path, save_last=True, every_n_train_steps=2)
    t2 = _trainer(tmp_path, best["global_step"] + 2, PitstopCheckpoint(tmp_path / "pit"), mc2)
    t2.fit(model, _loader(), ckpt_path=mc.best_model_path)
    assert model.note == {"steps": best["global_step"]}  # on_load_checkpoint got its entry
    assert t2.global_step == best["global_step"] + 2

    # ckpt_path="last": the newest last*.ckpt (Lightning named this run's last-v1.ckpt, as
    # last.ckpt was there already)
    assert Path(mc2.last_model_path).name == "last-v1.ckpt"
    last = load_checkpoint(mc2.last_model_path)
    assert last["global_step"] == best["global_step"] + 2
    t3 = _trainer(tmp_path, last["global_step"] + 1, PitstopCheckpoint(tmp_path / "pit"),
                  _ckpt(tmp_path, save_last=True))
    t3.fit(Tiny(), _loader(), ckpt_path="last")
    assert t3.global_step == last["global_step"] + 1
    # the restored full dict is Lightning's
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks",
                "hyper_parameters", "my_note", "pytorch-lightning_version"):
        assert key in last, key
    assert last["hyper_parameters"]["width"] == 8


def test_lightning_own_checkpoint_migrates(tmp_path: Path) -> None:
    """A .ckpt torch.save file Lightning wrote itself: fit(ckpt_path=it) continues from it
    and saves with pitstop from there."""
    t1 = _trainer(tmp_path, 4, enable_checkpointing=False)
    model = Tiny()
    t1.fit(model, _loader())
    t1.save_checkpoint(tmp_path / "old.ckpt")
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    resumed = Tiny()
    pit = PitstopCheckpoint(tmp_path / "pit")
    t2 = _trainer(tmp_path, 6, pit, _ckpt(tmp_path, save_last=True, every_n_train_steps=1))
    t2.fit(resumed, _loader(), ckpt_path=tmp_path / "old.ckpt")
    assert t2.global_step == 6 and resumed.note == {"steps": 4}
    last = load_checkpoint(tmp_path / "ckpts" / "last.ckpt")
    assert last["global_step"] == 6
    assert any(not torch.equal(v, last["state_dict"][k]) for k, v in weights.items())


def test_pointer_to_a_deleted_directory_says_so(tmp_path: Path) -> None:
    mc = _ckpt(tmp_path, save_last=True, every_n_train_steps=2)
    _trainer(tmp_path, 2, PitstopCheckpoint(tmp_path / "pit"), mc).fit(Tiny(), _loader())
    import shutil

    shutil.rmtree(tmp_path / "pit")
    t = _trainer(tmp_path, 4, PitstopCheckpoint(tmp_path / "pit2"), _ckpt(tmp_path))
    with pytest.raises(pitstop.CheckpointError, match="pit"):
        t.fit(Tiny(), _loader(), ckpt_path=tmp_path / "ckpts" / "last.ckpt")


def test_restore_into_a_different_model_is_refused_by_lightning(tmp_path: Path) -> None:
    mc = _ckpt(tmp_path, save_last=True, every_n_train_steps=2)
    _trainer(tmp_path, 2, PitstopCheckpoint(tmp_path / "pit"), mc).fit(Tiny(), _loader())
    t = _trainer(tmp_path, 4, PitstopCheckpoint(tmp_path / "pit"), _ckpt(tmp_path))
    with pytest.raises(RuntimeError, match="size mismatch"):
        t.fit(Tiny(width=16), _loader(), ckpt_path="last")


def test_a_directory_of_plain_pitstop_saves_is_not_taken_for_lightning(tmp_path: Path) -> None:
    with pitstop.CheckpointManager(tmp_path / "plain") as mgr:
        mgr.save(3, {"w": torch.zeros(2)}).wait()
    t = _trainer(tmp_path, 2, PitstopCheckpoint(tmp_path / "pit"), _ckpt(tmp_path))
    with pytest.raises(pitstop.CheckpointError, match="not written by PitstopCheckpoint"):
        t.fit(Tiny(), _loader(), ckpt_path=tmp_path / "plain")


def test_only_as_a_plugin_it_says_where_it_goes(tmp_path: Path) -> None:
    t = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, enable_progress_bar=False,
                   logger=False, enable_model_summary=False, default_root_dir=tmp_path,
                   plugins=[PitstopCheckpoint(tmp_path / "pit")],
                   callbacks=[_ckpt(tmp_path, every_n_train_steps=1)])
    with pytest.raises(pitstop.CheckpointError, match="callbacks"):
        t.fit(Tiny(), _loader())


class Diverges(Tiny):
    """Its weights turn NaN after optimizer step 4."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_step == 4:
            with torch.no_grad():
                self.net[0].weight.fill_(float("nan"))


def test_nonfinite_guard_resumes_from_the_newest_finite_save(tmp_path: Path) -> None:
    mc = _ckpt(tmp_path, save_last=True, every_n_train_steps=1)
    pit = PitstopCheckpoint(tmp_path / "pit", nonfinite_guard=True)
    _trainer(tmp_path, 6, pit, mc).fit(Diverges(), _loader())
    # the NaN steps were not taken: their paths name the newest save before them
    assert load_checkpoint(mc.last_model_path)["global_step"] == 4
    model = Tiny()
    t = _trainer(tmp_path, 7, PitstopCheckpoint(tmp_path / "pit", nonfinite_guard=True),
                 _ckpt(tmp_path, save_last=True))
    t.fit(model, _loader(), ckpt_path="last")
    assert t.global_step == 7 and model.note == {"steps": 4}
    assert not model.net[0].weight.isnan().any()


class Data(pl.LightningDataModule):
    def train_dataloader(self):
        return _loader()


def test_datamodule_loader_is_swapped_and_validate_reads_without_resuming(tmp_path: Path) -> None:
    from pitstop.adapters.torch import ResumableLoader

    mc = _ckpt(tmp_path, save_last=True, every_n_train_steps=2)
    t = _trainer(tmp_path, 4, PitstopCheckpoint(tmp_path / "pit"), mc)
    t.fit(Tiny(), datamodule=Data())
    assert isinstance(t.train_dataloader, ResumableLoader)
    with pitstop.CheckpointManager(tmp_path / "pit", read_only=True) as mgr:
        before = mgr.all_steps()

    class Val(Tiny):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    model = Val()
    t2 = _trainer(tmp_path, 4, PitstopCheckpoint(tmp_path / "pit"))
    t2.validate(model, _loader(), ckpt_path=mc.best_model_path)
    assert model.note == {"steps": 2 if "step=2" in mc.best_model_path else 4}
    with pitstop.CheckpointManager(tmp_path / "pit", read_only=True) as mgr:
        assert mgr.all_steps() == before  # nothing abandoned, nothing written


def test_a_top_k_removal_racing_retention_does_not_end_fit(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Background retention may be deleting the step a save_top_k removal lets go: the
    manager's delete then fails (manifest gone); fit goes on, retention finishes it."""
    def deleting_already(self, step):
        raise pitstop.CheckpointError(f"step {step}: its manifest cannot be read")

    monkeypatch.setattr(pitstop.CheckpointManager, "delete", deleting_already)
    mc = _ckpt(tmp_path, save_top_k=1, monitor="train_loss", every_n_train_steps=1)
    t = _trainer(tmp_path, 6, PitstopCheckpoint(tmp_path / "pit"), mc)
    t.fit(Tiny(), _loader())
    assert t.global_step == 6 and len(os.listdir(tmp_path / "ckpts")) == 1
