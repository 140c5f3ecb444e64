"""pitstop for Hugging Face Accelerate: one object, :class:`Checkpointing`, that saves and
restores everything ``accelerator.save_state`` covers through a pitstop
:class:`~pitstop.CheckpointManager` (asynchronous, atomic, hashed), plus the exact
mid-epoch data position that ``save_state`` lacks, and :func:`import_accelerate_checkpoint`
for an existing ``save_state`` folder.

Why an object and not ``register_save_state_pre_hook``: accelerate's hooks only see the
models' weights on their way to files accelerate writes itself (optimizers, schedulers and
RNG go to ``torch.save`` whatever a hook does), so they cannot make a save asynchronous or
exact. The object reads accelerate's own registries (``accelerator._models`` ... the lists
``save_state`` walks), so what ``prepare`` and ``register_for_checkpointing`` registered is
what is saved, without a second list to keep in sync.

Data position: each prepared ``DataLoaderShard`` keeps its shard logic (device placement,
the gradient state's end-of-dataloader, ``set_epoch``), but the plain ``DataLoader`` it wraps
(``base_dataloader``) is replaced by an equivalent
:class:`~pitstop.adapters.torch.ResumableLoader`: its order is seeded by ``(seed, epoch)``,
never by the global torch generator, and its position is what the shard handed to the loop
(the shard snapshots it before its one-batch look-ahead), so a resume starts at the next
batch without iterating the skipped ones.
"""

from __future__ import annotations

import logging
import os
import random
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import accelerate  # noqa: F401 - the integration needs the tool; fail here, with its name
import numpy as np
import torch

from pitstop.adapters.rng import RNG
from pitstop.adapters.torch import ResumableLoader
from pitstop.core.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedStateError,
)
from pitstop.core.manager import CheckpointManager
from pitstop.interop.common import refuse_existing, write_import
from pitstop.interop.torch_save import _torch_to_numpy_tree

__all__ = ["Checkpointing", "import_accelerate_checkpoint"]

log = logging.getLogger("pitstop")

_FINISHED = "_iterator_finished"  # the key DataLoaderShard adds to a state dict it snapshots


def _resumable_from(base: Any, seed: int, where: str) -> ResumableLoader:
    """A ResumableLoader equivalent to ``base`` (the DataLoader inside a DataLoaderShard)."""
    try:
        return ResumableLoader.from_loader(base, seed=seed)
    except TypeError as e:
        raise UnsupportedStateError(
            f"pitstop: {where} cannot be resumed exactly: {e}. Give accelerator.prepare a "
            "DataLoader pitstop can track, or leave this loader out of prepare() and put an "
            "object with its own state_dict() in extra_state=.") from e


def _shard_iter(self: Any) -> Any:
    """``__iter__`` of the ResumableLoader inside a DataLoaderShard. The shard reads one
    batch ahead of the loop; when a loop breaks out, that batch was taken from the loader
    but never handed out. A new iteration first moves the loader back to what the shard
    handed out (its ``dl_state_dict``), so it goes on with the batch after the loop's last
    one, as a ResumableLoader does, and the look-ahead batch is not lost."""
    handed = {k: v for k, v in self._pitstop_shard.dl_state_dict.items() if k != _FINISHED}
    if handed != self.state_dict():
        self.load_state_dict(handed)
    # the shard's epoch, to the loader itself (the shard's set_epoch reaches only a sampler
    # with one): the epoch a save at its last batch left used up yields nothing
    self.set_epoch(self._pitstop_shard.iteration)
    it = _SHARD_BASES[type(self)].__iter__(self)
    if it.used_up:
        # resumed from a save at an epoch's last batch: this epoch yields nothing, so the
        # code after the loop's inner loop (a per-epoch scheduler step, an evaluation) runs
        # for it, as in the uninterrupted run; the shard does not count an empty epoch done
        # by itself, so it is counted here
        self._pitstop_shard.iteration += 1
    return it


_SHARD_CLASSES: dict[type, type] = {}  # loader class -> its shard class
_SHARD_BASES: dict[type, type] = {}  # shard class -> the loader class


def _shard_class(cls: type) -> type:
    """``cls`` (ResumableLoader, or the subclass ``from_loader`` returns) with
    :func:`_shard_iter` as ``__iter__``: the same layout, so ``__class__`` can be set."""
    if cls not in _SHARD_CLASSES:
        shard_cls = type(f"Shard{cls.__name__}", (cls,), {"__iter__": _shard_iter})
        _SHARD_CLASSES[cls], _SHARD_BASES[shard_cls] = shard_cls, cls
    return _SHARD_CLASSES[cls]


def _no_second_skip(original: Any) -> Any:
    """``accelerator.skip_first_batches`` for a loader Checkpointing tracks. Restored
    mid-epoch, that loader already starts at the next batch: accelerate's resume recipe
    (``skip_first_batches(dl, resume_step)``) would build an untracked loader over
    accelerate's own sampler, of another order, so the resumed epoch would silently see
    other samples. It gets the loader itself, with a warning; other loaders, accelerate's."""
    if getattr(original, "_pitstop_no_second_skip", False):
        return original

    def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
        base = vars(dataloader).get("base_dataloader") if hasattr(dataloader, "__dict__") else None
        if num_batches and type(base) in _SHARD_BASES:
            if dict(getattr(dataloader, "dl_state_dict", None) or {}).get("position"):
                log.warning(
                    "pitstop: accelerator.skip_first_batches(dataloader, %d) on a loader that "
                    "Checkpointing restored mid-epoch: it already starts at the next batch, so "
                    "it is returned as it is (skipping again would train on other batches "
                    "than the run it resumes). Iterate the prepared loader itself.",
                    num_batches)
                return dataloader
            log.warning("pitstop: accelerator.skip_first_batches(dataloader, %d) returns a new "
                        "loader whose position Checkpointing does not save; after a restore, "
                        "iterate the prepared loader itself", num_batches)
        return original(dataloader, num_batches)

    skip_first_batches._pitstop_no_second_skip = True  # type: ignore[attr-defined]
    return skip_first_batches


class _ShardPosition:
    """The saved position of one prepared DataLoaderShard: its ResumableLoader's state as
    the shard last handed a batch to the loop, and the shard's epoch counter."""

    def __init__(self, shard: Any) -> None:
        self.shard = shard

    def state_dict(self) -> dict[str, Any]:
        sd = dict(self.shard.dl_state_dict)
        sd.pop(_FINISHED, None)
        # (saved at an epoch's last batch: that epoch, used up; see _shard_iter)
        return {"loader": sd, "iteration": int(self.shard.iteration)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        base = self.shard.base_dataloader
        base.load_state_dict(dict(state["loader"]))
        self.shard.dl_state_dict = base.state_dict()
        self.shard.iteration = int(state["iteration"])


def _epoch_of_next_batch(shard: Any) -> int:
    """The shard's epoch counter as it will be when the loop takes its next batch. Saved
    right after an epoch's last batch (the shard's generator has not yet counted that epoch
    done), it is the next epoch, or a resumed ``for epoch in range(dl.iteration, n)`` would
    go through an empty epoch that the shard never counts, and stop one epoch short."""
    refs = getattr(shard.gradient_state, "dataloader_references", ())
    iterating = any(r is shard for r in refs)
    return int(shard.iteration) + int(iterating and bool(shard.end_of_dataloader))


class _StatefulShard:
    """A shard over torchdata's StatefulDataLoader: accelerate's own position, as a value."""

    def __init__(self, shard: Any) -> None:
        self.shard = shard

    def state_dict(self) -> dict[str, Any]:
        return {"loader": dict(self.shard.state_dict()),
                "iteration": _epoch_of_next_batch(self.shard)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.shard.load_state_dict(dict(state["loader"]))
        self.shard.iteration = int(state["iteration"])


class _Progress:
    """accelerate's gradient-accumulation counter (``accelerator.step``, which
    ``save_state`` keeps in random_states_N.pkl) and the optimizer steps done."""

    def __init__(self, owner: Checkpointing) -> None:
        self.owner = owner

    def state_dict(self) -> dict[str, Any]:
        return {"step": int(self.owner.accelerator.step),
                "global_step": int(self.owner.global_step)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.owner.accelerator.step = int(state.get("step", 0))
        self.owner.global_step = int(state.get("global_step", 0))


def _names(prefix: str, n: int) -> list[str]:
    """accelerate's file stems: model, model_1, model_2 ..."""
    return [prefix if i == 0 else f"{prefix}_{i}" for i in range(n)]


class Checkpointing:
    """Accelerate's ``save_state`` / ``load_state``, through pitstop.

    >>> model, opt, dl, sched = accelerator.prepare(model, opt, dl, sched)
    >>> ckpt = Checkpointing(accelerator, "runs/exp", save_every_steps=100, keep_last=3)
    >>> ckpt.restore()                    # None on a fresh start, else the global step
    >>> for epoch in range(dl.iteration, num_epochs):
    ...     for batch in dl:              # after a resume: the batch that comes next
    ...         with accelerator.accumulate(model):
    ...             ...
    ...         ckpt.step(metrics={"loss": loss.item()})

    Make it after ``accelerator.prepare`` and ``register_for_checkpointing``. It saves the
    prepared models, optimizers and schedulers, the GradScaler, every registered object,
    the global random generators (``pitstop.RNG()``), accelerate's accumulation counter, and
    each prepared loader's position. ``step()`` counts optimizer steps (the batches that end
    an accumulation, where ``accelerator.sync_gradients`` is True) as ``global_step`` and
    saves only there: a checkpoint never holds half-accumulated gradients.

    ``directory`` defaults to ``{project_dir}/checkpoints`` when the accelerator's
    ``ProjectConfiguration`` has ``automatic_checkpoint_naming=True``; ``keep_last``
    defaults to its ``total_limit``. ``seed`` seeds the loaders' shuffling (default:
    ``torch.initial_seed()``, which ``accelerate.utils.set_seed`` sets). Other keywords go
    to :class:`~pitstop.CheckpointManager` (``save_every_seconds``, ``nonfinite_guard``,
    ``save_on_signals``, ...). ``extra_state`` adds entries of your own to the state.
    """

    def __init__(self, accelerator: Any, directory: str | os.PathLike[str] | None = None, *,
                 seed: int | None = None, extra_state: Mapping[str, Any] | None = None,
                 **manager_options: Any) -> None:
        self.accelerator = accelerator
        pc = accelerator.project_configuration
        if directory is None:
            if not pc.automatic_checkpoint_naming or accelerator.project_dir is None:
                raise ValueError(
                    "pitstop: Checkpointing(accelerator) needs a directory: pass one "
                    "(Checkpointing(accelerator, 'runs/exp')), or give the Accelerator "
                    "ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True) "
                    "to save under {project_dir}/checkpoints as accelerate does")
            directory = os.path.join(accelerator.project_dir, "checkpoints")
        if pc.total_limit is not None:
            manager_options.setdefault("keep_last", pc.total_limit)
        self.directory = os.fspath(directory)
        self.global_step = 0
        self.seed = int(torch.initial_seed() if seed is None else seed) % 2**63
        self._extra = dict(extra_state or {})
        if not (accelerator._models or accelerator._optimizers or self._extra):
            raise ValueError(
                "pitstop: Checkpointing(accelerator) was made before accelerator.prepare: "
                "the accelerator holds no model or optimizer to save. Make it after "
                "`model, optimizer, ... = accelerator.prepare(...)`")
        self.state = self._build_state(self._extra)
        self._seen = self._counts()
        self.manager = CheckpointManager(self.directory, **manager_options)
        try:
            self._refuse_accelerate_folder(self.directory, self.manager.all_steps())
        except BaseException:
            self.manager.close()
            raise
        # accelerate's resume recipe, kept by a migrating loop, must not skip a second time
        accelerator.skip_first_batches = _no_second_skip(accelerator.skip_first_batches)

    # ------------------------------------------------------------------ the state
    def _build_state(self, extra: dict[str, Any]) -> dict[str, Any]:
        acc = self.accelerator
        state: dict[str, Any] = {}
        for name, m in zip(_names("model", len(acc._models)), acc._models, strict=True):
            state[name] = m
        for name, o in zip(_names("optimizer", len(acc._optimizers)), acc._optimizers, strict=True):
            state[name] = getattr(o, "optimizer", o)  # AcceleratedOptimizer -> torch's
        for name, s in zip(_names("scheduler", len(acc._schedulers)), acc._schedulers, strict=True):
            state[name] = getattr(s, "scheduler", s)  # AcceleratedScheduler -> torch's
        for i, dl in enumerate(acc._dataloaders):
            state["dataloader" if i == 0 else f"dataloader_{i}"] = self._position(dl, i)
        if acc.scaler is not None:
            state["scaler"] = acc.scaler
        for i, obj in enumerate(acc._custom_objects):
            state[f"custom_checkpoint_{i}"] = obj
        state["rng"] = RNG()
        state["accelerator"] = _Progress(self)
        clash = sorted(set(extra) & set(state))
        if clash:
            raise ValueError(f"pitstop: extra_state keys {clash} are the names Checkpointing "
                             "gives accelerate's objects; rename them")
        state.update(extra)
        return state

    def _counts(self) -> tuple[int, ...]:
        acc = self.accelerator
        return (len(acc._models), len(acc._optimizers), len(acc._schedulers),
                len(acc._dataloaders), len(acc._custom_objects), acc.scaler is not None)

    def _current_state(self) -> dict[str, Any]:
        """The state, made again when ``prepare`` or ``register_for_checkpointing`` added
        objects since (so a model prepared later is saved too, not left out silently)."""
        if self._counts() != self._seen:
            log.info("pitstop: the accelerator has other objects than when Checkpointing "
                     "was made; saving and restoring them all")
            self.state = self._build_state(self._extra)
            self._seen = self._counts()
        return self.state

    def _position(self, shard: Any, i: int) -> Any:
        where = f"accelerator._dataloaders[{i}]"
        base = vars(shard).get("base_dataloader")
        if base is None or not hasattr(shard, "iteration"):
            raise UnsupportedStateError(
                f"pitstop: {where} is a {type(shard).__name__}, not the DataLoaderShard "
                "accelerator.prepare makes on one process; its position cannot be saved. "
                "Prepare a plain torch DataLoader.")
        if type(base) not in _SHARD_BASES:
            try:
                loader = base if isinstance(base, ResumableLoader) else \
                    _resumable_from(base, self.seed, where)
            except UnsupportedStateError:
                if not getattr(shard, "use_stateful_dataloader", False):
                    raise
                log.warning(
                    "pitstop: %s: its sampler is not one pitstop resumes exactly; its "
                    "position is saved as accelerate's StatefulDataLoader state_dict(), "
                    "whose resume may differ from an uninterrupted run (the permutation of "
                    "a resumed epoch, prefetched batches)", where)
                return _StatefulShard(shard)
            loader.__class__ = _shard_class(type(loader))  # adds only __iter__ (see there)
            loader._pitstop_shard = shard  # type: ignore[attr-defined]
            shard.base_dataloader = loader
            shard.dl_state_dict = loader.state_dict()
        return _ShardPosition(shard)

    @staticmethod
    def _refuse_accelerate_folder(directory: str, steps: list[int]) -> None:
        """A directory of accelerate save_state folders is not a pitstop directory: say so,
        with the fix. Beside pitstop's own checkpoints (``accelerator.save_state()`` called
        too, with automatic naming), warn and go on: the resume must not be blocked."""
        p = Path(directory)
        if not p.is_dir():
            return
        acc = [c for c in (p, *sorted(p.iterdir())) if c.is_dir()
               and any(c.glob("random_states_*.pkl"))]
        if acc and steps:
            log.warning("pitstop: %s also holds accelerator.save_state folders (%s); "
                        "Checkpointing restores only its own step_N checkpoints", directory,
                        ", ".join(c.name for c in acc[:3]))
        elif acc:
            raise UnsupportedStateError(
                f"pitstop: {acc[0]} is a checkpoint of accelerator.save_state, not a pitstop "
                f"one, and Checkpointing does not write beside it. Import it once with "
                f"pitstop.integrations.accelerate.import_accelerate_checkpoint({str(acc[0])!r}, "
                "'<a new directory>', step=N) and give Checkpointing that directory.")

    # ------------------------------------------------------------------ the calls
    def restore(self, step: int | None = None, *, strict: bool = True) -> Any:
        """Restore the newest valid checkpoint (or ``step``) into the accelerator's objects.
        Returns the restored global step (``self.global_step``), or None on a fresh start.
        ``strict=False`` restores what matches (a checkpoint imported from ``save_state``
        has no loader position: the loaders then start their epoch from the beginning)."""
        restored = self.manager.restore(self._current_state(), step, strict=strict)
        if restored is not None and not strict:
            missing = [k for k in getattr(restored, "missing_keys", ())
                       if k.split("/")[0].startswith("dataloader")]
            if missing:
                log.warning("pitstop: the checkpoint of step %s holds no position for %s; "
                            "those loaders start from the beginning of their epoch",
                            int(restored), sorted({k.split('/')[0] for k in missing}))
        return restored

    def step(self, metrics: Mapping[str, Any] | None = None) -> Any:
        """Call after every batch (after the ``accumulate`` block). On the batches that end
        an accumulation it counts one optimizer step and lets the policy (and a pending
        SIGTERM) save; on the others it does nothing. Returns the save's handle or None."""
        if not self.accelerator.sync_gradients:
            return None
        self.global_step += 1
        return self.manager.step(self.global_step, self._current_state(), metrics)

    def save(self, metrics: Mapping[str, Any] | None = None) -> Any:
        """Save ``global_step`` now (asynchronously), unless it is saved already; e.g. the
        last step of a run. Returns the handle, or None when it was saved already."""
        if self.manager.latest_step() == self.global_step:
            return None
        return self.manager.save(self.global_step, self._current_state(), metrics)

    def save_state(self, output_dir: str | os.PathLike[str] | None = None) -> Any:
        """``accelerator.save_state()``'s name: :meth:`save` (pitstop names the checkpoint
        ``step_N`` by the global step in its directory; ``output_dir`` must be that one)."""
        if output_dir is not None and Path(output_dir).resolve() != Path(self.directory).resolve():
            raise ValueError(f"pitstop: this Checkpointing saves into {self.directory}; make "
                             f"another Checkpointing for {output_dir}")
        return self.save()

    def load_state(self, input_dir: str | os.PathLike[str] | None = None, *,
                   strict: bool = True) -> Any:
        """``accelerator.load_state()``'s name: the newest checkpoint, or the one named by
        ``input_dir`` (this directory, or one of its ``step_N`` folders)."""
        if input_dir is None:
            return self.restore(strict=strict)
        p = Path(input_dir).resolve()
        root = Path(self.directory).resolve()
        if p == root:
            return self.restore(strict=strict)
        m = re.fullmatch(r"step_0*(\d+)", p.name)
        if p.parent != root or m is None:
            raise CheckpointNotFoundError(
                f"pitstop: {input_dir} is not a checkpoint of {self.directory} (its folders "
                f"are step_N: {self.manager.all_steps()[-3:]} ...); a save_state folder is "
                "imported with import_accelerate_checkpoint first")
        return self.restore(int(m.group(1)), strict=strict)

    def wait(self) -> None:
        """Block until every accepted save is committed."""
        self.manager.wait()

    def close(self) -> None:
        """Wait for pending saves and close the manager."""
        self.manager.close()

    def __enter__(self) -> Checkpointing:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --------------------------------------------------------------------- migration
def _load_torch(path: Path) -> Any:
    """A torch.save file of accelerate's, read with torch's restricted unpickler (numpy's
    array reconstruction allowed too, for random_states_N.pkl); no code runs."""
    np_core = getattr(np, "_core", None) or np.core
    allowed = [np_core.multiarray._reconstruct, np.ndarray, np.dtype,
               type(np.dtype(np.uint32))]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - a garbled or hostile file raises anything
        raise CorruptCheckpointError(
            f"{path}: cannot read this accelerate file with torch.load(weights_only=True) "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); is the "
            "save_state folder complete?", checkpoint=str(path)) from e


def _model_state(folder: Path, stem: str) -> dict[str, Any] | None:
    st = folder / f"{stem}.safetensors"
    if st.exists():
        from safetensors.torch import load_file
        return dict(load_file(st))
    binary = folder / ("pytorch_model.bin" if stem == "model" else f"pytorch_{stem}.bin")
    return _load_torch(binary) if binary.exists() else None


def _rng_value(states: Mapping[str, Any]) -> dict[str, Any]:
    """accelerate's random states as ``pitstop.RNG()`` saves them: set into this process's
    generators for a moment, read back through RNG, and the process's own put back."""
    rng = RNG(only=["python", "numpy", "torch"])
    mine = rng.state_dict()
    try:
        random.setstate(states["random_state"])
        np.random.set_state(states["numpy_random_seed"])
        torch.set_rng_state(states["torch_manual_seed"])
        return rng.state_dict()
    finally:
        rng.load_state_dict(mine)


def import_accelerate_checkpoint(folder: str | os.PathLike[str],
                                 directory: str | os.PathLike[str], step: int) -> int:
    """Import an ``accelerator.save_state`` folder (``model.safetensors`` or
    ``pytorch_model.bin``, ``optimizer.bin``, ``scheduler.bin``, ``scaler.pt``,
    ``custom_checkpoint_N.pkl``, ``random_states_0.pkl``; ``_1``, ``_2``... for more objects)
    as committed pitstop checkpoint ``step`` of ``directory``, under the keys
    :class:`Checkpointing` uses, so ``Checkpointing(accelerator, directory).restore(
    strict=False)`` continues from it. Loader positions are not in such a folder (restore
    starts the loaders' epoch over, as ``load_state`` does). Returns ``step``."""
    src = Path(folder)
    if not src.is_dir():
        raise CheckpointNotFoundError(f"{src}: no such accelerate checkpoint folder")
    rng_files = sorted(src.glob("random_states_*.pkl"))
    if not rng_files:
        raise CheckpointNotFoundError(
            f"{src}: not an accelerator.save_state folder (no random_states_N.pkl); with "
            "automatic_checkpoint_naming give one checkpoints/checkpoint_N folder")
    key = refuse_existing(directory, step)
    tree: dict[str, Any] = {}
    for i in range(len(list(src.glob("*"))) + 1):
        stem = "model" if i == 0 else f"model_{i}"
        sd = _model_state(src, stem)
        if sd is None:
            break
        tree[stem] = sd
    for prefix, ext in (("optimizer", "bin"), ("scheduler", "bin")):
        for stem in _names(prefix, 64):
            if not (src / f"{stem}.{ext}").exists():
                break
            tree[stem] = _load_torch(src / f"{stem}.{ext}")
    if (src / "scaler.pt").exists():
        tree["scaler"] = _load_torch(src / "scaler.pt")
    for f in sorted(src.glob("custom_checkpoint_*.pkl")):
        tree[f.stem] = _load_torch(f)
    states = _load_torch(rng_files[0])
    state = _torch_to_numpy_tree(tree)
    state["rng"] = _rng_value(states)
    state["accelerator"] = {"step": int(states.get("step", 0)), "global_step": int(step)}
    return write_import(state, directory, step, None, key)
