"""The Hugging Face ``Trainer``, checkpointed by pitstop (issue 29).

``pitstop.integrations.hf.Trainer`` is ``transformers.Trainer`` whose checkpoints are pitstop's:
the same arguments and calls (``save_strategy``/``save_steps``, ``save_total_limit``,
``load_best_model_at_end``, ``train(resume_from_checkpoint=True | path)``), saves that return
after an in-memory snapshot, and a resume that is exact mid-epoch without iterating the
batches already done. ``PitstopTrainerMixin`` gives the same to a ``Trainer`` subclass of
your own (``class MyTrainer(PitstopTrainerMixin, SFTTrainer)``).

Why a Trainer and not only a ``TrainerCallback``: the Trainer decides the epoch and the
batches to skip from the checkpoint before any callback runs (``_init_training_state``), so a
callback that restores in ``on_train_begin`` resumes the weights but restarts the loop at step
0 (issue 29). The overrides below are the Trainer's own checkpoint seams: where it reads a
checkpoint, where it writes one, and where it skips data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import transformers.trainer as _hf_trainer
from torch.utils.data import RandomSampler
from transformers import Trainer as _HFTrainer
from transformers import TrainerCallback, TrainerState

from pitstop.adapters.rng import RNG
from pitstop.adapters.torch import ResumableLoader, ResumableSampler
from pitstop.core.errors import (
    CheckpointNotFoundError,
    IncompatibleTargetError,
    InvalidArgumentError,
)
from pitstop.core.manager import CheckpointManager

log = logging.getLogger("pitstop.integrations.hf")

#: the Trainer's checkpoint names: ``checkpoint-<global_step>`` (``PREFIX_CHECKPOINT_DIR``)
PREFIX = "checkpoint-"
#: the files that make a folder one of the Trainer's own checkpoints
HF_STATE_FILE = "trainer_state.json"

__all__ = ["PitstopTrainerMixin", "Trainer", "PREFIX"]


class _NeverOnItsOwn:
    """The manager's save policy: the Trainer's ``save_strategy`` decides the saves
    (``_save_checkpoint``); ``mgr.step()`` still saves for a signal (SIGTERM, SIGINT)."""

    def should_save(self, step: int, ctx: Any) -> bool:
        return False


class _SaveTotalLimit:
    """``save_total_limit`` as the Trainer's ``rotate_checkpoints`` applies it: the newest
    ``limit``, never deleting the newest nor the best model's checkpoint (so a limit of 1
    with a best elsewhere keeps 2)."""

    def __init__(self, trainer: PitstopTrainerMixin) -> None:
        self.trainer = trainer

    def keep(self, checkpoints: Any) -> set[int]:
        steps = sorted(c.step for c in checkpoints)
        limit = self.trainer.args.save_total_limit
        if not steps or limit is None or limit <= 0:
            return set(steps)
        best = _step_of(self.trainer.state.best_model_checkpoint)
        protected = {steps[-1]} | ({best} if best in steps else set())
        keep, remaining = set(steps), len(steps)
        for s in steps:
            if remaining <= max(limit, len(protected)):
                break
            if s not in protected:
                keep.discard(s)
                remaining -= 1
        return keep


class _Later:
    """A state entry restored now and put back into the Trainer later, where the Trainer
    itself would put it back (the random state right before the first batch trains, the
    logging accumulators once ``train()`` has reset them)."""

    def __init__(self, current: Any) -> None:
        self.current, self.loaded = current, None

    def state_dict(self) -> Any:
        return self.current()

    def load_state_dict(self, state: Any) -> None:
        self.loaded = state

    def take(self) -> Any:
        loaded, self.loaded = self.loaded, None
        return loaded


class _Resumed(TrainerCallback):
    """Puts the logging accumulators back once ``train()`` has reset them (right before
    ``on_train_begin``), so the first loss logged after a resume averages the same steps."""

    def __init__(self, trainer: PitstopTrainerMixin) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._pitstop_put_back_logging()


def _step_of(path: Any) -> int | None:
    """The step of a ``checkpoint-N`` path, or None."""
    if not path:
        return None
    name = os.path.basename(os.path.normpath(os.fspath(path)))
    rest = name[len(PREFIX):] if name.startswith(PREFIX) else ""
    return int(rest) if rest.isdigit() and str(int(rest)) == rest else None


def _native_checkpoints(directory: str, ours: set[int]) -> list[tuple[int, str]]:
    """The Trainer's own checkpoints (``checkpoint-N`` with ``trainer_state.json``) in
    ``directory``, oldest first; pitstop's (``ours``) are not among them."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        step = _step_of(name)
        path = os.path.join(directory, name)
        if step is not None and step not in ours and \
                os.path.isfile(os.path.join(path, HF_STATE_FILE)):
            found.append((step, path))
    return sorted(found)


@contextlib.contextmanager
def _no_skip_for(ours: ResumableLoader | None) -> Iterator[None]:
    """While an epoch runs: the Trainer's ``skip_first_batches`` (accelerate's, which walks
    the sampler through the skipped batches) leaves ``ours`` as it is: its restored position
    already is the next batch. Any other loader is skipped as the Trainer skips it."""
    original = _hf_trainer.skip_first_batches

    def skip(loader: Any, num_batches: int = 0) -> Any:
        return loader if ours is not None and loader is ours else original(loader, num_batches)

    _hf_trainer.skip_first_batches = skip
    try:
        yield
    finally:
        _hf_trainer.skip_first_batches = original


class PitstopTrainerMixin:
    """Put before a ``transformers.Trainer`` class: its checkpoints become pitstop's.

    ``pitstop_options``: keywords for the :class:`~pitstop.CheckpointManager` of
    ``args.output_dir`` (``memory_tier``, ``durable``, ``compression``, ``nonfinite_guard``,
    ...); its naming, save policy and retention are the Trainer's arguments'.
    """

    def __init__(self, *args: Any, pitstop_options: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.pitstop_options = dict(pitstop_options or {})
        self.checkpoint_manager: CheckpointManager | None = None
        self._pitstop_from: tuple[CheckpointManager, int | None] | None = None
        self._pitstop_loader: ResumableLoader | None = None
        self._pitstop_rng = _Later(RNG().state_dict)
        self._pitstop_logging = _Later(self._pitstop_logging_state)
        self._pitstop_last_step: int | None = None
        self._pitstop_tr_loss: torch.Tensor | None = None
        self._pitstop_other: CheckpointManager | None = None
        self.add_callback(_Resumed(self))

    # ------------------------------------------------------------------ train()
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> Any:
        """``Trainer.train``: ``resume_from_checkpoint=True`` resumes from the newest
        checkpoint of ``output_dir`` (pitstop's, or the Trainer's own ``checkpoint-N`` when it
        is newer), or starts from scratch when there is none; a path resumes from that
        checkpoint, pitstop's or the Trainer's own."""
        mgr = self._pitstop_open()
        try:
            native = self._pitstop_resolve(mgr, resume_from_checkpoint)
            return super().train(resume_from_checkpoint=native, trial=trial,  # type: ignore[misc]
                                 ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        finally:
            self._pitstop_from = None
            self.checkpoint_manager = None
            mgr.close()
            if self._pitstop_other is not None:
                self._pitstop_other.close()
                self._pitstop_other = None

    def _pitstop_open(self) -> CheckpointManager:
        # the Trainer's arguments decide the saves and what is kept; names are the Trainer's
        options = {"save_policy": _NeverOnItsOwn(), "retention": [_SaveTotalLimit(self)],
                   "nonfinite_guard": True, **self.pitstop_options,
                   "step_prefix": PREFIX, "step_digits": 0}
        out = self.args.output_dir  # type: ignore[attr-defined]
        try:
            mgr = CheckpointManager(out, **options)
        except InvalidArgumentError as e:
            if "names its checkpoints" in str(e):
                e.add_note(f"pitstop: the Trainer names its checkpoints checkpoint-<step>, and "
                           f"output_dir {out!r} is a pitstop directory of another naming "
                           "(written by your own CheckpointManager): give the Trainer "
                           "another output_dir")
            raise
        self.checkpoint_manager = mgr
        return mgr

    def _pitstop_resolve(self, mgr: CheckpointManager, resume: Any) -> str | None:
        """Where this run resumes from: sets ``_pitstop_from`` for a pitstop checkpoint and
        returns the path of one of the Trainer's own checkpoints (read by the Trainer)."""
        out = self.args.output_dir  # type: ignore[attr-defined]
        ours = mgr.latest_step()
        if resume is None or resume is False:
            if ours is not None:
                log.warning("pitstop: %s holds checkpoints up to step %d and this run starts "
                            "from scratch (train(resume_from_checkpoint=True) resumes); its "
                            "saves of the same steps are refused", out, ours)
            return None
        native = _native_checkpoints(out, set(mgr.all_steps()))
        if resume is True:
            if native and (ours is None or native[-1][0] > ours):
                log.info("pitstop: resuming from the Trainer's own checkpoint %s (newer than "
                         "pitstop's); the saves from now on are pitstop's", native[-1][1])
                return native[-1][1]
            if ours is None:
                log.info("pitstop: no checkpoint in %s yet: training starts from scratch", out)
                return None
            self._pitstop_from = (mgr, None)
            return None
        path = os.fspath(resume)
        if os.path.isfile(os.path.join(path, HF_STATE_FILE)):
            return path
        step = _step_of(path)
        parent = os.path.dirname(os.path.abspath(path))
        if step is not None and os.path.abspath(out) == parent and step in mgr.all_steps():
            self._pitstop_from = (mgr, step)
            return None
        if step is not None and os.path.isdir(os.path.join(parent, ".pitstop")):
            # a checkpoint of another run's directory: read there, saved here
            other = CheckpointManager(parent, read_only=True)
            if step in other.all_steps():
                self._pitstop_other = other
                self._pitstop_from = (other, step)
                return None
            other.close()
        raise CheckpointNotFoundError(
            f"pitstop: resume_from_checkpoint={path!r} is neither a checkpoint of output_dir "
            f"{out!r} (pitstop's steps there: {mgr.all_steps() or 'none'}) nor one of the "
            f"Trainer's own (a folder with {HF_STATE_FILE}); pass True to resume from the "
            "newest, or the path of one of them")

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self) -> Any:
        """The Trainer's training loader, as a ``ResumableLoader`` (same dataset, collator,
        batch size, workers and worker seeding; shuffled by ``data_seed`` or ``seed``) whose
        position is saved: a resume continues at the next batch without iterating the
        batches done. A loader it cannot make resumable (an ``IterableDataset``, a sampler of
        your own) stays the Trainer's, with a warning."""
        loader = super().get_train_dataloader()  # type: ignore[misc]
        self._pitstop_loader = None
        dataset = getattr(loader, "dataset", None)
        if type(self._get_train_sampler(dataset)) is not RandomSampler:  # type: ignore[attr-defined]
            # another sampler (group_by_length, your own), an IterableDataset with a state:
            # ResumableLoader.from_loader replays the sampler's indices to the position
            args = self.args  # type: ignore[attr-defined]
            try:
                self._pitstop_loader = ResumableLoader.from_loader(
                    loader, seed=args.data_seed if args.data_seed is not None else args.seed)
            except TypeError as e:
                log.warning("pitstop: the training data of this Trainer cannot be tracked (%s), "
                            "so its position is not saved: a mid-epoch resume skips batches "
                            "as the Trainer does (by iterating them) and may see other batches "
                            "than the run it resumes", e)
                return loader
            return self._pitstop_loader
        self._pitstop_loader = self._pitstop_resumable(loader)
        return self._pitstop_loader

    def _pitstop_resumable(self, loader: Any) -> ResumableLoader:
        args = self.args  # type: ignore[attr-defined]
        bs = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
        drop_last = getattr(loader.batch_sampler, "drop_last", loader.drop_last)
        seed = args.data_seed if args.data_seed is not None else args.seed
        sampler = ResumableSampler(loader.dataset, shuffle=True, seed=seed,
                                   num_replicas=max(1, args.world_size),
                                   rank=args.process_index)
        extra: dict[str, Any] = {}
        if loader.num_workers > 0:
            extra = {"prefetch_factor": loader.prefetch_factor,
                     "persistent_workers": loader.persistent_workers,
                     "multiprocessing_context": loader.multiprocessing_context}
        return ResumableLoader(loader.dataset, batch_size=bs, sampler=sampler,
                               drop_last=drop_last, collate_fn=loader.collate_fn,
                               num_workers=loader.num_workers, pin_memory=loader.pin_memory,
                               worker_init_fn=loader.worker_init_fn, timeout=loader.timeout,
                               **extra)

    # ------------------------------------------------------------------ restore
    def _init_training_state(self, max_steps: int, num_update_steps_per_epoch: int,
                             num_train_epochs: int, resume_from_checkpoint: Any,
                             trial: Any) -> tuple[int, int]:
        done = super()._init_training_state(  # type: ignore[misc]
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint,
            trial)
        if self._pitstop_from is not None:
            done = self._pitstop_restore_progress(max_steps, num_update_steps_per_epoch,
                                                  num_train_epochs, trial)
        elif resume_from_checkpoint is not None:
            self._pitstop_position(*done)  # from the Trainer's own checkpoint
        return done

    def _pitstop_restore_progress(self, max_steps: int, per_epoch: int, epochs: int,
                                  trial: Any) -> tuple[int, int]:
        """The TrainerState and the data position of the checkpoint, as the Trainer restores
        its ``trainer_state.json``; the model and optimizer follow once they exist."""
        assert self._pitstop_from is not None
        mgr, step = self._pitstop_from
        held = _Later(str)
        state: dict[str, Any] = {"trainer_state": held}
        if self._pitstop_loader is not None:
            state["data"] = self._pitstop_loader
        restored = mgr.restore(state, step=step, strict=False)
        if restored is None:
            raise CheckpointNotFoundError(f"pitstop: no checkpoint to resume in {mgr.directory}")
        self._pitstop_from = (mgr, int(restored))
        missing = set(restored.missing_keys)
        if "trainer_state" in missing:
            raise IncompatibleTargetError(
                f"pitstop: {mgr.directory}/{PREFIX}{int(restored)} holds no TrainerState: it "
                "was not written by pitstop.integrations.hf.Trainer; resume it with the code "
                "that wrote it, or train in another output_dir")
        if "data" in missing:
            log.warning("pitstop: %s/%s%d holds no data position (its Trainer's data was not "
                        "resumable); the data goes on from the global step", mgr.directory,
                        PREFIX, int(restored))
        self.state = TrainerState(**json.loads(held.take()))
        best = self.state.best_model_checkpoint
        if best is not None and _step_of(best) not in mgr.all_steps() \
                and not os.path.isdir(best):
            log.warning("pitstop: the best checkpoint %s of the resumed state does not exist "
                        "any more; ignoring it for this run", best)
            self.state.best_model_checkpoint = None
        _hf_trainer.compare_trainer_and_checkpoint_args(self.args, self.state)  # type: ignore[attr-defined]
        self._load_callback_state()  # type: ignore[attr-defined]
        epochs_trained = self.state.global_step // per_epoch
        steps_trained = 0
        if self.args.ignore_data_skip:  # type: ignore[attr-defined]
            self._pitstop_position(epochs_trained, 0)
        else:
            steps_trained = (self.state.global_step % per_epoch) * \
                self.args.gradient_accumulation_steps  # type: ignore[attr-defined]
        self.state.init_training_references(self, max_steps, epochs, trial)
        log.info("pitstop: resuming from %s at global step %d (epoch %.4g)",
                 os.path.join(str(mgr.directory), PREFIX + str(restored)),
                 self.state.global_step, self.state.epoch or 0)
        return epochs_trained, steps_trained

    def _pitstop_position(self, epochs_trained: int, batches: int) -> None:
        """Set the loader where the Trainer resumes: ``batches`` into ``epochs_trained``."""
        loader = self._pitstop_loader
        if loader is None:
            return
        sd = loader.state_dict()
        sd.update(epoch=epochs_trained, completed_epoch=None,
                  position=min(batches * (loader.batch_size or 1), sd["dataset_len"]))
        loader.load_state_dict(sd)

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any,
                              resume_from_checkpoint: Any) -> Any:
        prepared = super()._prepare_for_training(  # type: ignore[misc]
            max_steps, train_dataloader, resume_from_checkpoint)
        if self._pitstop_from is not None:
            self._pitstop_restore_objects()
        return prepared

    def _pitstop_restore_objects(self) -> None:
        """The model, optimizer, scheduler (scaler), random and logging state, in place,
        all checked against the checkpoint before a byte is written (strict)."""
        assert self._pitstop_from is not None
        mgr, step = self._pitstop_from
        state = self._pitstop_state(progress=False)
        state["trainer_state"] = _Later(str)  # read before; here only for the strict check
        if self._pitstop_loader is not None:
            state["data"] = self._pitstop_loader
        try:
            mgr.restore(state, step=step, strict=True)
        except IncompatibleTargetError as e:
            e.add_note(f"pitstop: {mgr.directory}/{PREFIX}{step} was written for another model, "
                       "optimizer or setup (fp16 on/off) than this Trainer's; resume it with "
                       "the ones that wrote it, or train this one in another output_dir")
            raise

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        if self._pitstop_from is not None:
            # the Trainer's resume branch: its step counters and RNG restore, not its skip
            mgr, step = self._pitstop_from
            kwargs["resume_from_checkpoint"] = os.path.join(str(mgr.directory),
                                                            f"{PREFIX}{step}")
        with _no_skip_for(self._pitstop_loader):
            return super()._run_epoch(*args, **kwargs)  # type: ignore[misc]

    def _load_rng_state(self, checkpoint: Any) -> None:
        if self._pitstop_from is None:
            super()._load_rng_state(checkpoint)  # type: ignore[misc]
            return
        loaded = self._pitstop_rng.take()
        if loaded is not None:
            RNG().load_state_dict(loaded)

    def _pitstop_state_json(self) -> str:
        """The TrainerState as the Trainer writes its ``trainer_state.json``."""
        return json.dumps(dataclasses.asdict(self.state), sort_keys=True)

    def _pitstop_logging_state(self) -> dict[str, Any]:
        return {"globalstep_last_logged": getattr(self, "_globalstep_last_logged", 0)}

    def _pitstop_put_back_logging(self) -> None:
        loaded = self._pitstop_logging.take()
        if loaded is not None:
            self._globalstep_last_logged = int(loaded["globalstep_last_logged"])
        held = getattr(self, "_pitstop_tr_loss", None)
        if held is not None:
            self._tr_loss.copy_(held)
            self._pitstop_tr_loss = None

    def _load_best_model(self) -> None:
        best = _step_of(self.state.best_model_checkpoint)
        mgr = self.checkpoint_manager
        if mgr is None or best is None or best not in mgr.all_steps():
            super()._load_best_model()  # type: ignore[misc]
            return
        log.info("pitstop: loading the best model from %s (score: %s)",
                 self.state.best_model_checkpoint, self.state.best_metric)
        mgr.wait()
        mgr.restore({"model": self.model}, step=best, strict=False)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ save
    def _pitstop_state(self, *, progress: bool = True) -> dict[str, Any]:
        """What a checkpoint holds, under the keys ``pitstop inspect`` shows. ``progress``:
        with the TrainerState and the data position (restored before the rest)."""
        opt = self.optimizer  # type: ignore[attr-defined]
        state: dict[str, Any] = {"model": self.model,  # type: ignore[attr-defined]
                                 "optimizer": getattr(opt, "optimizer", opt),
                                 "scheduler": self.lr_scheduler,  # type: ignore[attr-defined]
                                 "rng": self._pitstop_rng, "logging": self._pitstop_logging}
        scaler = getattr(self.accelerator, "scaler", None)  # type: ignore[attr-defined]
        if scaler is not None:
            state["scaler"] = scaler
        if progress:
            state["tr_loss"] = self._tr_loss
            state["trainer_state"] = _Later(self._pitstop_state_json)
            if self._pitstop_loader is not None:
                state["data"] = self._pitstop_loader
        else:
            self._pitstop_tr_loss = torch.zeros((), dtype=torch.float32)
            state["tr_loss"] = self._pitstop_tr_loss
        return state

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's save, as pitstop's: a snapshot now, written in the background."""
        mgr = self.checkpoint_manager
        if mgr is None:
            super()._save_checkpoint(model, trial)  # type: ignore[misc]
            return
        step = self.state.global_step
        if self.hp_search_backend is None and trial is None:  # type: ignore[attr-defined]
            self.store_flos()  # type: ignore[attr-defined]
        best = self.state.best_global_step
        if best and (best == step or best in mgr.all_steps()):
            self.state.best_model_checkpoint = os.path.join(str(mgr.directory),
                                                            f"{PREFIX}{best}")
        self._pitstop_callback_states()
        if step in mgr.all_steps() or os.path.exists(os.path.join(str(mgr.directory),
                                                                  f"{PREFIX}{step}")):
            log.warning("pitstop: %s already holds %s%d (of an earlier run); it is kept and "
                        "this step is not saved again", mgr.directory, PREFIX, step)
            return
        mgr.save(step, self._pitstop_state())
        self._pitstop_last_step = step

    def _pitstop_callback_states(self) -> None:
        """``ExportableState`` callbacks' state into the TrainerState, as the Trainer does."""
        for cb in self.callback_handler.callbacks + [self.control]:  # type: ignore[attr-defined]
            if isinstance(cb, _hf_trainer.ExportableState):
                name, cb_state = cb.__class__.__name__, cb.state()
                # .get: a stateful callback added on a resume (the Trainer's raises KeyError)
                if isinstance(self.state.stateful_callbacks.get(name), list):
                    self.state.stateful_callbacks[name].append(cb_state)
                else:
                    self.state.stateful_callbacks[name] = cb_state

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        super()._maybe_log_save_evaluate(*args, **kwargs)  # type: ignore[misc]
        mgr, step = self.checkpoint_manager, self.state.global_step
        if mgr is None:
            return
        # a step boundary: a pending SIGTERM/SIGINT saves this step here (unless the
        # Trainer's save just did), waits for the commit, then exits as the signal asks
        preempted = mgr.reached_preemption(step)
        if step == self._pitstop_last_step and not preempted:
            return
        if preempted and step != self._pitstop_last_step:
            self._pitstop_callback_states()
        self._pitstop_last_step = step
        mgr.step(step, self._pitstop_state())

    def _finalize_training(self, trial: Any, num_train_samples: int, start_time: float) -> Any:
        mgr = self.checkpoint_manager
        if mgr is not None:
            mgr.wait()
            best = _step_of(self.state.best_model_checkpoint)
            if self.args.should_save and best in mgr.all_steps() and \
                    self.args.save_total_limit == 1:  # type: ignore[attr-defined]
                for s in mgr.all_steps():
                    if s != best:
                        mgr.delete(s)
        return super()._finalize_training(  # type: ignore[misc]
            trial, num_train_samples, start_time)


class Trainer(PitstopTrainerMixin, _HFTrainer):
    """``transformers.Trainer``, checkpointed by pitstop (see :class:`PitstopTrainerMixin`)."""
