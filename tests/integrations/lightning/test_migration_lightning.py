"""docs/migration.md's Lightning rows, each run twice: through Lightning's own checkpointing
(ModelCheckpoint + torch.save) and with PitstopCheckpoint added; the files Lightning names
and the values they restore must be the same. (No dropout and no shuffling here: the swapped
loader's order and its seeds are pitstop's, so the two runs would draw differently.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from pitstop.integrations.lightning import PitstopCheckpoint, load_checkpoint  # noqa: E402


class Plain(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)),
                      batch_size=4)


def _fit(root: Path, pitstop: bool, steps: int, ckpt_path=None, **mc) -> tuple[pl.Trainer, Plain]:
    cbs = [ModelCheckpoint(dirpath=root / "ckpts", **mc)]
    if pitstop:
        cbs.insert(0, PitstopCheckpoint(root / "pit"))
    t = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, enable_progress_bar=False,
                   logger=False, enable_model_summary=False, default_root_dir=root, callbacks=cbs)
    model = Plain()
    t.fit(model, _loader(), ckpt_path=ckpt_path)
    return t, model


def _same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}/{i}")
    else:
        assert a == b, (where, a, b)


MC = dict(save_last=True, save_top_k=2, monitor="train_loss", every_n_train_steps=2)


def test_model_checkpoint_rows_keep_the_same_files_and_values(tmp_path: Path) -> None:
    ta, _ = _fit(tmp_path / "a", False, 10, **MC)
    tb, _ = _fit(tmp_path / "b", True, 10, **MC)
    files = sorted(os.listdir(tmp_path / "a" / "ckpts"))
    assert files == sorted(os.listdir(tmp_path / "b" / "ckpts"))
    for name in files:
        own = torch.load(tmp_path / "a" / "ckpts" / name, weights_only=False)
        ours = load_checkpoint(tmp_path / "b" / "ckpts" / name)
        for key in ("state_dict", "optimizer_states", "lr_schedulers", "epoch", "global_step"):
            _same(own[key], ours[key], f"{name}:{key}")
        assert own["loops"]["fit_loop"]["epoch_loop.batch_progress"] == \
            ours["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    assert Path(ta.checkpoint_callback.best_model_path).name == \
        Path(tb.checkpoint_callback.best_model_path).name

    # ckpt_path="last" and best_model_path: pitstop's resume trains on as a run never
    # stopped; Lightning's own restarts the epoch's data mid-epoch (last.ckpt is at batch 2
    # of epoch 1), so it does not
    _, ref = _fit(tmp_path / "ref", False, 12)
    for ckpt in ("last", "best"):
        path_a = "last" if ckpt == "last" else ta.checkpoint_callback.best_model_path
        path_b = "last" if ckpt == "last" else tb.checkpoint_callback.best_model_path
        _, ma = _fit(tmp_path / "a", False, 12, ckpt_path=path_a, save_last=True)
        _, mb = _fit(tmp_path / "b", True, 12, ckpt_path=path_b, save_last=True)
        _same(ref.state_dict(), mb.state_dict(), ckpt)
        if ckpt == "last":
            assert not torch.equal(ref.net[0].weight, ma.net[0].weight)

    # trainer.save_checkpoint(path) after fit
    ta.save_checkpoint(tmp_path / "a" / "final.ckpt")
    tb.save_checkpoint(tmp_path / "b" / "final.ckpt")
    _same(torch.load(tmp_path / "a" / "final.ckpt", weights_only=False)["state_dict"],
          load_checkpoint(tmp_path / "b" / "final.ckpt")["state_dict"], "final")


def test_an_old_ckpt_continues_as_lightning_would(tmp_path: Path) -> None:
    t, _ = _fit(tmp_path / "old", False, 3, every_n_train_steps=3)
    t.save_checkpoint(tmp_path / "old.ckpt")
    _, ma = _fit(tmp_path / "a", False, 7, ckpt_path=tmp_path / "old.ckpt")
    _, mb = _fit(tmp_path / "b", True, 7, ckpt_path=tmp_path / "old.ckpt")
    _same(ma.state_dict(), mb.state_dict(), "migrated")


class WithHparams(Plain):
    def __init__(self, width: int = 8, lr: float = 1e-2, tags: tuple = ("a",),
                 opts: dict | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()

    def on_load_checkpoint(self, checkpoint):
        self.loaded_step = checkpoint["global_step"]


def test_load_from_checkpoint_of_best_model_path_is_the_same(tmp_path: Path) -> None:
    """Model.load_from_checkpoint(best_model_path) after the same training, through
    Lightning's own .ckpt and through PitstopCheckpoint's pointer: the same module."""
    hp = dict(width=5, lr=3e-3, tags=("x", "y"), opts={"betas": [0.9, 0.99], "name": "adam",
                                                        "none": None, "flag": True})
    paths = []
    for name, with_pitstop in (("a", False), ("b", True)):
        root = tmp_path / name
        cbs = [ModelCheckpoint(dirpath=root / "ckpts", **MC)]
        if with_pitstop:
            cbs.insert(0, PitstopCheckpoint(root / "pit"))
        t = pl.Trainer(accelerator="cpu", devices=1, max_steps=8, enable_progress_bar=False,
                       logger=False, enable_model_summary=False, default_root_dir=root,
                       callbacks=cbs)
        t.fit(WithHparams(**hp), _loader())
        paths.append(t.checkpoint_callback.best_model_path)
    assert Path(paths[0]).name == Path(paths[1]).name
    own, ours = (WithHparams.load_from_checkpoint(p, map_location="cpu") for p in paths)
    _same(own.state_dict(), ours.state_dict(), "state_dict")
    assert dict(own.hparams) == dict(ours.hparams) == hp
    assert own.loaded_step == ours.loaded_step > 0
    own, ours = (WithHparams.load_from_checkpoint(p, lr=0.5, strict=True) for p in paths)
    assert own.hparams == ours.hparams and ours.hparams.lr == 0.5
