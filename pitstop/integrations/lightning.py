"""pitstop inside PyTorch Lightning (``lightning.pytorch`` 2.x): one callback.

>>> trainer = L.Trainer(callbacks=[PitstopCheckpoint("runs/x"), ModelCheckpoint(save_last=True)])
>>> trainer.fit(model, ckpt_path="last")

:class:`PitstopCheckpoint` is a ``Callback`` that also becomes the strategy's
``CheckpointIO``. Every checkpoint Lightning writes (``ModelCheckpoint``, a manual
``trainer.save_checkpoint(path)``) is snapshotted by pitstop and committed in the background;
the path Lightning names gets a small pointer file (JSON: the pitstop directory and step), so
``ckpt_path="last"``, ``best_model_path`` and any printed path resume through
``load_checkpoint``. One pitstop step per training batch done: a second save at the same
moment (``save_last``'s ``last.ckpt`` after ``epoch=0-step=3.ckpt``) only writes its pointer.
``ModelCheckpoint``'s removals (``save_top_k``) remove pointers; a step no pointer names is
deleted by retention (the newest ``keep_last`` of pitstop's own saves are kept).

Beyond Lightning's own checkpoint: the train ``DataLoader`` is swapped for a
``ResumableLoader`` whose position Lightning's loop state carries (mid-epoch resume at the
next batch, nothing re-iterated), the global RNGs and the gradients accumulated so far are
saved, and pitstop's own triggers (``save_every_steps``, SIGTERM/SIGINT) save at batch ends.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch.utils.data import DataLoader

import pitstop
from pitstop.adapters.torch import ResumableLoader
from pitstop.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedStateError,
)
from pitstop.core.policy import CheckpointInfo
from pitstop.interop.torch_save import _numpy_to_torch_tree

log = logging.getLogger("pitstop")

__all__ = ["PitstopCheckpoint", "load_checkpoint"]

#: the "format" field of a pointer file
POINTER = "pitstop-lightning-pointer"
#: the pointer to pitstop's own newest save (signals, save_every_steps) in ModelCheckpoint's
#: directory; Lightning's ckpt_path="last" takes it when it is newer than last.ckpt
LAST = "last-pitstop.ckpt"


def _read_pointer(path: str) -> dict[str, Any] | None:
    """The pointer a ``.ckpt`` path holds, or None when it is something else."""
    try:
        if not os.path.isfile(path) or os.path.getsize(path) > 4096:
            return None
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if isinstance(data, dict) and data.get("format") == POINTER:
        return data
    return None


def _write_pointer(path: str, directory: str, step: int) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.pitstop-tmp"
    with open(tmp, "w") as f:
        json.dump({"format": POINTER, "version": 1, "directory": directory, "step": step}, f)
    os.replace(tmp, path)


def _resolve(path: str) -> tuple[str, int | None] | None:
    """(pitstop directory, step or None for the newest) that ``path`` names, or None when it
    is not a pitstop checkpoint (a pointer, a run directory, a ``step_N`` directory)."""
    pointer = _read_pointer(path)
    if pointer is not None:
        return str(pointer["directory"]), int(pointer["step"])
    p = Path(path)
    if p.is_dir():
        if (p / "manifest.json").is_file() and p.name.rpartition("_")[2].isdigit():
            return str(p.parent), int(p.name.rpartition("_")[2])
        return str(p), None
    return None


def _to_torch(tree: Any) -> Any:
    """The loaded tree with torch tensors for arrays (int keys as Lightning saved them)."""
    return _numpy_to_torch_tree(tree)


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Lightning's checkpoint dict from a path pitstop wrote (a pointer ``.ckpt``, a run
    directory: its newest step, or a ``step_N`` directory), e.g. for ``torch.save`` or a
    ``LightningModule.load_state_dict(ckpt["state_dict"])`` outside a ``Trainer``."""
    where = _resolve(os.fspath(path))
    if where is None:
        raise CheckpointNotFoundError(
            f"{os.fspath(path)}: not a pitstop checkpoint (a pointer .ckpt PitstopCheckpoint "
            "wrote, a pitstop run directory or one of its step_N directories)")
    directory, step = where
    with pitstop.CheckpointManager(directory, read_only=True) as mgr:
        return _to_torch(mgr.load(_committed_step(mgr, step, path))["lightning"])  # type: ignore[no-any-return]


def _module_checkpoint(path: str, map_location: Any) -> dict[str, Any]:
    """Lightning's checkpoint dict of the pitstop checkpoint ``path`` names, for
    ``load_from_checkpoint``: exactly the step it names (a model for inference or fine-tuning
    is never silently an older one), its tensors placed as ``torch.load``'s ``map_location``
    would place tensors saved on the CPU."""
    directory, step = _resolve(path) or (path, None)
    try:
        with pitstop.CheckpointManager(directory, read_only=True) as mgr:
            steps = mgr.all_steps()
            if step is None:
                step = mgr.latest_step()
            if step is None or step not in steps:
                raise CheckpointNotFoundError(
                    f"{path} names step {step} of {directory}, which is not there (deleted, or "
                    "never committed: the job was killed while saving it, or nonfinite_guard "
                    f"refused it); the steps there are {steps}: load another .ckpt of this run "
                    "or one of its step_N directories")
            tree = mgr.load(step)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(
            f"{path} names step {step} of {directory}, which is corrupt ({e}): load another "
            ".ckpt of this run or one of its step_N directories", checkpoint=e.checkpoint,
            key=e.key, file=e.file) from e
    if not isinstance(tree, dict) or "lightning" not in tree:
        raise CheckpointError(
            f"{path}: pitstop checkpoint of step {step} in {directory} was not written by "
            "PitstopCheckpoint (no 'lightning' entry); read it with "
            "pitstop.CheckpointManager.load instead")
    return _placed(_to_torch(tree["lightning"]), map_location)


def _placed(tree: Any, map_location: Any) -> Any:
    """``tree`` with each (CPU) tensor where ``torch.load(map_location=...)`` puts a storage
    saved at ``"cpu"``: a device or its name, a dict of locations, or a function
    ``(storage, "cpu") -> storage or None``."""
    if map_location is None:
        return tree
    from lightning_utilities.core.apply_func import apply_to_collection

    def move(t: torch.Tensor) -> torch.Tensor:
        if callable(map_location):
            moved = map_location(t.untyped_storage(), "cpu")
            return t if moved is None else t.to(moved.device)
        where = map_location.get("cpu", "cpu") if isinstance(map_location, dict) else map_location
        return t.to(torch.device(where))

    return apply_to_collection(tree, torch.Tensor, move)


def _is_pitstop_path(path: Any) -> bool:
    """Whether ``path`` is a local pointer ``.ckpt``, a pitstop step directory or a pitstop
    run directory (anything else is left to Lightning's own reader)."""
    if not isinstance(path, (str, os.PathLike)) or "://" in os.fspath(path):
        return False
    p = Path(os.fspath(path))
    if not p.is_dir():
        return _read_pointer(str(p)) is not None
    return (p / "manifest.json").is_file() or (p / ".pitstop").is_dir() or any(
        (c / "manifest.json").is_file() for c in p.glob("step_*"))


def _patch_lightning_load() -> None:
    """Lightning's readers read pitstop checkpoints: the name ``pl_load`` (fabric's
    ``cloud_io._load``) that ``lightning.pytorch.core.saving`` (``load_from_checkpoint`` of a
    ``LightningModule`` / ``LightningDataModule``) and ``lightning.fabric.plugins.io.torch_io``
    (``TorchCheckpointIO``: a ``Trainer`` without PitstopCheckpoint) read with is wrapped in
    those two modules; any other path goes to Lightning's own reader, unchanged."""
    from lightning.fabric.plugins.io import torch_io
    from lightning.pytorch.core import saving

    for module, in_trainer in ((saving, False), (torch_io, True)):
        original = module.pl_load
        if not getattr(original, "_pitstop", False):
            module.pl_load = _wrapped(original, in_trainer)


def _wrapped(original: Any, in_trainer: bool) -> Any:
    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        if not _is_pitstop_path(path_or_url):
            # not pitstop's: Lightning's own reader, unchanged, with the caller's weights_only
            # (pitstop unpickles nothing here; what Lightning loads is as without pitstop)
            return original(path_or_url, map_location=map_location, weights_only=weights_only)
        if in_trainer:
            log.warning("pitstop: %s is read without PitstopCheckpoint in the Trainer: "
                        "validate/test/predict read it as it is; a fit from it goes on as from "
                        "Lightning's own .ckpt (its epoch's data starts over, the data loader's "
                        "position and the RNGs are not set back): put PitstopCheckpoint(<its directory>) in "
                        "Trainer(callbacks=[...]) for an exact resume", path_or_url)
        checkpoint = _module_checkpoint(os.fspath(path_or_url), map_location)
        if in_trainer:
            # the position of the loader PitstopCheckpoint swapped in, which this Trainer's
            # own loader cannot take (Lightning would refuse the whole checkpoint)
            fit = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict")
            if isinstance(fit, dict):
                fit.pop("combined_loader", None)
        return checkpoint

    pl_load._pitstop = True  # type: ignore[attr-defined]
    pl_load.__wrapped__ = original  # type: ignore[attr-defined]
    return pl_load


_patch_lightning_load()


class _Referenced:
    """Retention: the steps a pointer names, and the newest ``keep_last`` of those no
    ``ModelCheckpoint`` removal let go (pitstop's own saves)."""

    def __init__(self, owner: PitstopCheckpoint) -> None:
        self.owner = owner

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        if not self.owner._scanned:  # the pointers on disk are not known yet: keep all
            return {c.step for c in checkpoints}
        refs = self.owner._referenced()
        dropped = self.owner._dropped
        others = sorted(c.step for c in checkpoints if c.step not in refs | dropped)
        return refs | set(others[-self.owner.keep_last:])


def _from_loader(loader: DataLoader, rank: int) -> DataLoader:
    """The loop's train loader as a ResumableLoader (``ResumableLoader.from_loader``); a
    loader it cannot take is returned as it is (said once)."""
    if isinstance(loader, ResumableLoader) or hasattr(loader, "state_dict"):
        return loader  # resumable already (a ResumableLoader, a StatefulDataLoader)
    init = loader.worker_init_fn
    if init is None and os.environ.get("PL_SEED_WORKERS") == "1":
        from functools import partial

        from lightning.fabric.utilities.seed import pl_worker_init_function

        init = partial(pl_worker_init_function, rank=rank)  # seed_everything(workers=True)
    seed = int(torch.initial_seed()) & ((1 << 63) - 1)
    try:
        new = ResumableLoader.from_loader(loader, seed=seed)
    except TypeError as e:
        log.warning("pitstop: the train DataLoader cannot be resumed mid-epoch (%s): a resumed "
                    "run starts its epoch over, as Lightning does", e)
        return loader
    new.worker_init_fn = init
    return new


class PitstopCheckpoint(Callback, CheckpointIO):  # type: ignore[misc]
    """Asynchronous, exact checkpoints for a Lightning ``Trainer``.

    ``dirpath`` is the pitstop run directory (path or URL). ``save_every_steps`` /
    ``save_every_seconds`` add pitstop's own periodic saves (counted in training batches,
    at batch ends) beside ``ModelCheckpoint``'s; SIGTERM/SIGINT save the batch just done and
    exit (``save_on_signals``); ``keep_last`` keeps that many of the saves no ``.ckpt``
    pointer names. Other keywords go to :class:`pitstop.CheckpointManager`.
    """

    def __init__(self, dirpath: str | os.PathLike[str], *, save_every_steps: int | None = None,
                 save_every_seconds: float | None = None, keep_last: int = 1,
                 swap_dataloader: bool = True, nonfinite_guard: bool = False,
                 **manager_options: Any) -> None:
        super().__init__()
        self.dirpath = os.path.abspath(os.fspath(dirpath)) if "://" not in os.fspath(dirpath) \
            else os.fspath(dirpath)
        if keep_last < 1:
            raise pitstop.InvalidArgumentError("keep_last must be at least 1")
        self.keep_last = keep_last
        self.swap_dataloader = swap_dataloader
        #: a save whose weights or optimizer state hold NaN/inf is not taken: its path then
        #: resumes from the newest save before it (the manager's own guard would also
        #: refuse ModelCheckpoint's state, whose best score starts as inf)
        self.nonfinite_guard = nonfinite_guard
        self._options = dict(save_every_steps=save_every_steps,
                             save_every_seconds=save_every_seconds, **manager_options)
        self._mgr: pitstop.CheckpointManager | None = None
        self._trainer: pl.Trainer | None = None
        self._lock = threading.Lock()
        #: pointer path -> step, for the pointers of this directory we know of
        self._pointers: dict[str, int] = {}
        #: what a restore left for on_train_start: (step, grads)
        self._pending: tuple[int, dict[str, Any]] | None = None
        #: steps whose last pointer ModelCheckpoint removed (save_top_k): retention drops them
        self._dropped: set[int] = set()
        #: whether the pointers on disk were read (retention deletes nothing before)
        self._scanned = False
        self._fallback_io = TorchCheckpointIO()

    # ------------------------------------------------------------------ the manager
    @property
    def manager(self) -> pitstop.CheckpointManager:
        """The pitstop manager of ``dirpath`` (opened at the Trainer's setup)."""
        if self._mgr is None or self._mgr.closed:
            self._mgr = pitstop.CheckpointManager(
                self.dirpath, retention=[_Referenced(self)], **self._options)
        return self._mgr

    def _referenced(self) -> set[int]:
        with self._lock:
            return set(self._pointers.values())

    def _scan_pointers(self, trainer: pl.Trainer) -> None:
        dirs = {os.path.abspath(cb.dirpath) for cb in trainer.checkpoint_callbacks
                if isinstance(cb, ModelCheckpoint) and cb.dirpath}
        for d in dirs:
            if not os.path.isdir(d):
                continue
            for name in os.listdir(d):
                p = os.path.join(d, name)
                pointer = _read_pointer(p)
                if pointer is not None and pointer["directory"] == self.dirpath:
                    with self._lock:
                        self._pointers[os.path.abspath(p)] = int(pointer["step"])
        self._scanned = True

    # ------------------------------------------------------------------ Callback hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer
        trainer.strategy.checkpoint_io = self
        if stage != "fit":
            return
        _ = self.manager  # opened now: its signal handlers go under Lightning's (it calls ours)
        if self.swap_dataloader and trainer.world_size > 1:
            # Lightning puts a DistributedSampler into the loader, which ResumableLoader
            # does not take (yet): the data position is not saved there
            log.warning("pitstop: %d processes: the train DataLoader is not made resumable (a "
                        "resume starts its epoch over, as Lightning's); pass a ResumableLoader "
                        "with a ResumableSampler(num_replicas=, rank=) and "
                        "Trainer(use_distributed_sampler=False) for an exact one",
                        trainer.world_size)
        elif self.swap_dataloader:
            source = trainer.fit_loop._data_source
            original = source.dataloader

            def resumable() -> Any:
                return _swap(original(), trainer.global_rank)

            source.dataloader = resumable  # type: ignore[method-assign]

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._scan_pointers(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending is None:
            return
        step, grads = self._pending
        self._pending = None
        # the RNGs as they were at the save, now that nothing before the first batch
        # (the sanity check, the loaders' iterators) draws from them any more
        self.manager.restore({"rng": pitstop.RNG()}, step=step, strict=False)
        params = dict(pl_module.named_parameters())
        for name, g in grads.items():
            p = params.get(name)
            if p is not None:
                p.grad = g.to(p.device)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        mgr = self.manager
        step = _batches_done(trainer)
        if not (mgr.should_save(step) or mgr.reached_preemption(step)):
            return
        if step in mgr.all_steps():
            mgr.step(step, {})  # a signal: this step is saved already; exits as it asks
            return
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        cb = trainer.checkpoint_callback
        if isinstance(cb, ModelCheckpoint) and cb.dirpath:
            # ckpt_path="last" takes the newest last*.ckpt of ModelCheckpoint's directory:
            # this pointer names pitstop's own newest save there
            self.save_checkpoint(checkpoint, os.path.join(cb.dirpath, LAST))
        else:
            self._save(step, checkpoint)

    def teardown(self, trainer: pl.Trainer | None = None, pl_module: Any = None,
                 stage: str | None = None) -> None:
        # both the Callback's teardown(trainer, pl_module, stage) and CheckpointIO's
        # teardown() (the strategy's, no arguments): the manager closes after fit
        if stage == "fit" and self._mgr is not None:
            if not self._mgr.closed:
                self._sweep()
            self._mgr.close()

    def _sweep(self) -> None:
        """After fit, delete the steps ModelCheckpoint let go whose deletion was left to a
        later commit's retention (the removals after the last saves have none)."""
        mgr = self._mgr
        assert mgr is not None
        try:
            mgr.wait()
            steps = mgr.all_steps()
            keep = _Referenced(self).keep([CheckpointInfo(s, {}) for s in steps])
            for s in steps:
                if s not in keep and s != max(steps):
                    mgr.delete(s)
        except CheckpointError as e:
            log.warning("pitstop: a step ModelCheckpoint removed is left in %s: %s",
                        mgr.directory, e)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        if self._mgr is not None and not self._mgr.closed:
            try:
                self._mgr.close()  # commits what was accepted
            except CheckpointError as e:
                log.error("pitstop: %s", e)

    # ------------------------------------------------------------------ CheckpointIO
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        trainer = self._trainer
        if trainer is None:
            raise CheckpointError("PitstopCheckpoint saves for a Trainer: put it in "
                                  "Trainer(callbacks=[...])")
        step = _batches_done(trainer)
        path = os.path.abspath(os.fspath(path))
        # the pointer first: a save on a signal exits once committed (a pointer to a step
        # that never committed resumes from the newest committed one before it, said)
        _write_pointer(path, self.dirpath, step)
        with self._lock:
            self._pointers[path] = step
            self._dropped.discard(step)
        if step not in self.manager.all_steps():
            self._save(step, checkpoint)
        if trainer.state.status != TrainerStatus.RUNNING:
            self.manager.wait()  # trainer.save_checkpoint(path) after fit: committed on return

    def _save(self, step: int, checkpoint: dict[str, Any]) -> None:
        trainer = self._trainer
        assert trainer is not None
        module = trainer.lightning_module
        if self.nonfinite_guard and not _all_finite(module, trainer.optimizers):
            log.warning("pitstop: step %d not saved: the weights or the optimizer state hold "
                        "NaN or inf (nonfinite_guard); its checkpoint path resumes from the "
                        "newest save before it", step)
            return
        grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
        state = {"lightning": checkpoint, "grads": grads, "rng": pitstop.RNG()}
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()
                   if isinstance(v, (int, float, torch.Tensor)) and torch.as_tensor(v).numel() == 1}
        try:
            self.manager.save(step, state, metrics=metrics)
        except UnsupportedStateError as e:
            raise UnsupportedStateError(
                f"{e}. Lightning's checkpoint holds it (hyper_parameters from "
                "save_hyperparameters(), an on_save_checkpoint hook): keep such entries to "
                "tensors, numbers, strings, lists and dicts, e.g. "
                "save_hyperparameters(ignore=[...])") from e

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        where = _resolve(os.fspath(path))
        if where is None:
            # a checkpoint Lightning wrote itself (torch.save): the migration path, read by
            # Lightning's own CheckpointIO with the caller's weights_only (as without pitstop:
            # pitstop's own checkpoints are never unpickled); the next saves are pitstop's
            log.warning("pitstop: %s is not a pitstop checkpoint; loading it as Lightning's own "
                        "file (torch.load). Saves from here on are pitstop's.", path)
            return self._fallback_io.load_checkpoint(path, map_location=map_location,
                                                     weights_only=weights_only)
        directory, step = where
        fitting = self._trainer is None or self._trainer.state.fn == TrainerFn.FITTING
        if directory != self.dirpath or not fitting:
            # another run's directory, or validate/test/predict: read only, nothing resumes
            if fitting:
                log.warning("pitstop: %s is a checkpoint of %s, not of this callback's %s: "
                            "training goes on from it, without its RNG states and accumulated "
                            "gradients (not bitwise the run that saved it)", path, directory,
                            self.dirpath)
            with pitstop.CheckpointManager(directory, read_only=True) as other:
                tree = other.load(_committed_step(other, step, path))
        else:
            mgr = self.manager
            step = _committed_step(mgr, step, path)
            if step is None:
                step = mgr.latest_step()
            if step is not None:
                # through restore: resuming an older step than the newest abandons the newer
                # ones (moved aside at the first save), so no later save of this run is
                # taken for one of theirs (the RNGs are set again at on_train_start)
                mgr.restore({"rng": pitstop.RNG()}, step=step, strict=False)
            tree = mgr.load(step)
        if not isinstance(tree, dict) or "lightning" not in tree:
            raise CheckpointError(
                f"{path}: pitstop checkpoint of step {step} in {directory} was not written by "
                "PitstopCheckpoint (no 'lightning' entry); restore it with "
                "pitstop.CheckpointManager.restore instead")
        if directory == self.dirpath and step is not None:
            grads = {k: v for k, v in _to_torch(tree.get("grads") or {}).items()}
            self._pending = (step, grads)
        return _to_torch(tree["lightning"])  # type: ignore[no-any-return]

    def remove_checkpoint(self, path: Any) -> None:
        path = os.path.abspath(os.fspath(path))
        with self._lock:
            step = self._pointers.pop(path, None)
            if step is not None and step not in self._pointers.values():
                self._dropped.add(step)
        if _read_pointer(path) is not None or os.path.islink(path):
            os.remove(path)
        elif os.path.exists(path):
            self._fallback_io.remove_checkpoint(path)
        if step is not None and self._mgr is not None and not self._mgr.closed:
            # the step goes now rather than at the next commit's retention
            steps = self._mgr.all_steps()
            if step in steps and step not in _Referenced(self).keep(
                    [CheckpointInfo(s, {}) for s in steps]) and step != max(steps):
                try:
                    self._mgr.delete(step)
                except CheckpointError as e:
                    # retention, after a commit meanwhile, is deleting it already (not found,
                    # or its manifest gone); otherwise the next commit's retention retries
                    log.debug("pitstop: step %d left to retention: %s", step, e)


def _committed_step(mgr: pitstop.CheckpointManager, step: int | None, path: Any) -> int | None:
    """``step``, or when it was never committed (killed while saving; refused by
    nonfinite_guard) the newest committed step before it, said."""
    steps = mgr.all_steps()
    if step is None or step in steps:
        return step
    older = [s for s in steps if s < step]
    if not older:
        raise CheckpointNotFoundError(
            f"{path} names step {step} of {mgr.directory}, which was never committed (the job "
            "was killed while saving it, or nonfinite_guard refused it) and no earlier step is "
            "there: start without ckpt_path")
    log.warning("pitstop: %s names step %d of %s, which was never committed (killed while "
                "saving, or refused by nonfinite_guard): resuming from step %d, the newest "
                "committed before it", path, step, mgr.directory, older[-1])
    return older[-1]


def _all_finite(module: torch.nn.Module, optimizers: Sequence[Any]) -> bool:
    tensors = [p for p in module.parameters()]
    for opt in optimizers:
        tensors += [t for st in opt.state.values() for t in st.values()
                    if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _batches_done(trainer: pl.Trainer) -> int:
    """Training batches done in this run so far: pitstop's step number."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.total.processed)


def _swap(loaders: Any, rank: int) -> Any:
    """The train dataloader(s) with each plain DataLoader made resumable."""
    from lightning.pytorch.utilities import CombinedLoader

    if isinstance(loaders, DataLoader):
        return _from_loader(loaders, rank)
    if isinstance(loaders, CombinedLoader):
        loaders.flattened = [_swap(x, rank) for x in loaders.flattened]
        return loaders
    if isinstance(loaders, dict):
        return {k: _swap(v, rank) for k, v in loaders.items()}
    if isinstance(loaders, (list, tuple)):
        return type(loaders)(_swap(v, rank) for v in loaders)
    return loaders
