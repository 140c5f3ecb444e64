"""``LightningModule.load_from_checkpoint`` / ``LightningDataModule.load_from_checkpoint`` on
the pointer ``.ckpt`` files PitstopCheckpoint writes (hparams, hooks, map_location, strict,
errors), ``validate(ckpt_path="best")`` / ``test(ckpt_path=path)``, and Lightning's own files
read as before."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.core import saving  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import pitstop  # noqa: E402
from pitstop.integrations.lightning import PitstopCheckpoint, load_checkpoint  # noqa: E402


class Net(pl.LightningModule):
    def __init__(self, width: int = 8, lr: float = 1e-2, tags: tuple = ("a",)) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, width), nn.Dropout(0.2), nn.Linear(width, 1))
        self.loaded: dict | None = None

    def training_step(self, batch, batch_idx):
        loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def on_save_checkpoint(self, checkpoint):
        checkpoint["my_note"] = {"steps": self.global_step}

    def on_load_checkpoint(self, checkpoint):
        self.loaded = checkpoint["my_note"]

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class Wider(Net):
    """Net with one more layer: its weights are not in the checkpoint."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.extra = nn.Linear(1, 1)


class Data(pl.LightningDataModule):
    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.epochs_seen = 0

    def train_dataloader(self, shuffle: bool = True):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g))
        return DataLoader(data, batch_size=self.hparams.batch_size, shuffle=shuffle)

    def val_dataloader(self):
        return self.train_dataloader(shuffle=False)

    test_dataloader = val_dataloader

    def state_dict(self):
        return {"epochs_seen": 7}

    def load_state_dict(self, state):
        self.epochs_seen = state["epochs_seen"]


def _trainer(root: Path, *callbacks, steps: int = 6, **kw) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, enable_progress_bar=False,
                      logger=False, enable_model_summary=False, default_root_dir=root,
                      callbacks=list(callbacks), limit_val_batches=2, limit_test_batches=2, **kw)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    """(root, trainer, paths): one fit; paths has best_model_path and last_model_path as
    fit left them (a later validate(ckpt_path=) restores ModelCheckpoint's state of that
    save, as Lightning does)."""
    root = tmp_path_factory.mktemp("run")
    mc = ModelCheckpoint(dirpath=root / "ckpts", save_last=True, save_top_k=2,
                         monitor="train_loss", every_n_train_steps=2)
    trainer = _trainer(root, PitstopCheckpoint(root / "pit"), mc)
    trainer.fit(Net(width=6, lr=3e-3, tags=("x", "y")), datamodule=Data(batch_size=3))
    paths = SimpleNamespace(best_model_path=mc.best_model_path, last_model_path=mc.last_model_path)
    return root, trainer, paths


def test_load_from_checkpoint_reads_a_pointer_as_lightnings_own_file(run) -> None:
    root, trainer, mc = run
    ckpt = load_checkpoint(mc.best_model_path)
    model = Net.load_from_checkpoint(mc.best_model_path)
    assert dict(model.hparams) == {"width": 6, "lr": 3e-3, "tags": ("x", "y")}
    assert model.net[0].out_features == 6
    assert model.loaded == {"steps": ckpt["global_step"]}  # on_load_checkpoint was called
    for k, v in ckpt["state_dict"].items():
        assert torch.equal(model.state_dict()[k], v), k

    # hparams overrides, as on Lightning's own files
    assert Net.load_from_checkpoint(mc.last_model_path, lr=0.5).hparams.lr == 0.5
    # map_location: a device, its name, a dict of locations, a function (storage, location)
    for where in ("cpu", torch.device("cpu"), {"cpu": "cpu"}, lambda s, loc: s):
        m = Net.load_from_checkpoint(mc.last_model_path, map_location=where)
        assert m.net[0].weight.device == torch.device("cpu")
    seen = []
    Net.load_from_checkpoint(mc.last_model_path, map_location=lambda s, loc: seen.append(loc))
    assert seen and set(seen) == {"cpu"}
    # strict: a model with weights the checkpoint lacks
    with pytest.raises(RuntimeError, match="extra"):
        Wider.load_from_checkpoint(mc.last_model_path)
    assert Wider.load_from_checkpoint(mc.last_model_path, strict=False).hparams.width == 6
    # a step directory and the run directory (its newest step) read the same way
    step = json.loads(Path(mc.last_model_path).read_text())["step"]
    newest = Net.load_from_checkpoint(root / "pit")
    in_step = Net.load_from_checkpoint(root / "pit" / f"step_{step:010d}")
    assert torch.equal(newest.net[0].weight, in_step.net[0].weight)

    data = Data.load_from_checkpoint(mc.best_model_path)
    assert data.hparams.batch_size == 3 and data.epochs_seen == 7  # load_state_dict called


def test_validate_best_and_test_a_path(run, caplog: pytest.LogCaptureFixture) -> None:
    root, trainer, mc = run
    with pitstop.CheckpointManager(root / "pit", read_only=True) as mgr:
        before = mgr.all_steps()
    best = load_checkpoint(mc.best_model_path)["global_step"]
    model = trainer.lightning_module
    trainer.validate(model, datamodule=Data(), ckpt_path="best")
    assert model.loaded == {"steps": best}
    fresh = Net(width=6)
    _trainer(root, PitstopCheckpoint(root / "pit")).test(fresh, datamodule=Data(),
                                                         ckpt_path=mc.last_model_path)
    assert fresh.loaded == {"steps": 6}
    # a Trainer without the callback (an evaluation script): read as it is, said
    plain = Net(width=6)
    _trainer(root).test(plain, datamodule=Data(), ckpt_path=mc.best_model_path)
    assert plain.loaded == {"steps": best}
    assert "without PitstopCheckpoint" in caplog.text
    onward = _trainer(root, steps=8, enable_checkpointing=False)
    onward.fit(Net(width=6), datamodule=Data(), ckpt_path=mc.last_model_path)
    assert onward.global_step == 8  # goes on as from Lightning's own .ckpt
    with pitstop.CheckpointManager(root / "pit", read_only=True) as mgr:
        assert mgr.all_steps() == before  # read, nothing resumed or written


def _pointer(path: Path, directory: Path, step: int) -> Path:
    path.write_text(json.dumps({"format": "pitstop-lightning-pointer", "version": 1,
                                "directory": str(directory), "step": step}))
    return path


def test_a_pointer_to_a_deleted_or_corrupt_step_says_which(run, tmp_path: Path) -> None:
    root, _, mc = run
    copy = tmp_path / "pit"
    shutil.copytree(root / "pit", copy)
    step = json.loads(Path(mc.last_model_path).read_text())["step"]
    older = [s for s in pitstop.CheckpointManager(copy, read_only=True).all_steps() if s < step]
    assert older  # a fit would fall back to it; a model to load never silently does
    shutil.rmtree(copy / f"step_{step:010d}")
    gone = _pointer(tmp_path / "gone.ckpt", copy, step)
    with pytest.raises(pitstop.CheckpointNotFoundError, match=rf"gone\.ckpt names step {step}"):
        Net.load_from_checkpoint(gone)

    bad = _pointer(tmp_path / "bad.ckpt", copy, older[-1])
    for f in (copy / f"step_{older[-1]:010d}").rglob("*"):
        if f.is_file() and f.name != "manifest.json" and f.stat().st_size > 64:
            f.write_bytes(b"\0" * f.stat().st_size)
    with pytest.raises(pitstop.CorruptCheckpointError, match=rf"bad\.ckpt names step {older[-1]}"):
        Net.load_from_checkpoint(bad)

    shutil.rmtree(copy)
    with pytest.raises(pitstop.CheckpointError, match="pit"):
        Net.load_from_checkpoint(gone)


def test_lightnings_own_files_load_as_before(tmp_path: Path) -> None:
    """Only pitstop's paths are taken: Lightning's torch.save .ckpt loads through its own
    reader, and a path that is neither fails as it does without pitstop."""
    assert getattr(saving.pl_load, "__wrapped__", None) is not None
    t = _trainer(tmp_path, steps=2)
    t.fit(Net(width=5), datamodule=Data())
    t.save_checkpoint(tmp_path / "own.ckpt")
    model = Net.load_from_checkpoint(tmp_path / "own.ckpt", map_location="cpu")
    assert model.hparams.width == 5 and model.loaded == {"steps": 2}
    (tmp_path / "empty").mkdir()
    errors = []
    for load in (saving.pl_load, saving.pl_load.__wrapped__):
        for bad in (tmp_path / "empty", tmp_path / "missing.ckpt"):
            with pytest.raises(Exception) as e:
                load(bad)
            errors.append(type(e.value))
    assert errors[:2] == errors[2:]
