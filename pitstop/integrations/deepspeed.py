"""DeepSpeed: an engine's whole training state in a pitstop state.

``engine_state(engine)`` is what a DeepSpeed user adds::

    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    state = {"engine": engine_state(engine), "loader": loader, "rng": pitstop.RNG()}
    start = mgr.restore(state)

It holds, by reference (pitstop snapshots the live tensors, nothing is copied here):

- ``module``: the model's parameters and buffers (``engine.module``);
- ``optimizer``: the torch optimizer DeepSpeed steps (with ZeRO 1/2 the base optimizer,
  whose moments cover this rank's partition only);
- ``fp32_groups``: with ZeRO 1/2, this rank's fp32 master partition of each parameter
  group (``single_partition_of_fp32_groups``);
- ``lr_scheduler``: ``engine.lr_scheduler`` when there is one;
- ``progress``: ``global_steps``, ``global_samples``, ``skipped_steps``, ``micro_steps``,
  the loss scaler's state, and the data-parallel world size and ZeRO stage it was saved
  with (a restore into another one is refused);
- ``client_state``: the dict you pass, restored in place (what ``save_checkpoint(...,
  client_state=)`` saves and ``load_checkpoint`` returns).

Every rank of a job makes it and saves with the same manager: each rank's partitions are
kept for that rank (docs/distributed.md). The layout is the one
:func:`pitstop.interop.deepspeed.import_deepspeed` writes, so a directory of
``engine.save_checkpoint`` imports into a checkpoint this restores.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import MutableMapping
from typing import Any

import deepspeed
import torch
from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from pitstop.adapters import Adapter, register_adapter
from pitstop.core.errors import IncompatibleTargetError, InvalidArgumentError, UnsupportedStateError
from pitstop.interop.deepspeed import SCALER_FIELDS

log = logging.getLogger("pitstop")

__all__ = ["engine_state"]

_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")


class _Progress:
    """The engine's counters and loss scaler, as values (``state_dict``/``load_state_dict``)."""

    def __init__(self, engine: Any, zero: DeepSpeedZeroOptimizer | None) -> None:
        self._engine = engine
        self._zero = zero

    def _where(self) -> tuple[int, int]:
        return int(self._engine.dp_world_size), int(self._engine.zero_optimization_stage())

    def state_dict(self) -> dict[str, Any]:
        dp, stage = self._where()
        sd: dict[str, Any] = {k: int(getattr(self._engine, k)) for k in _COUNTERS}
        sd.update(dp_world_size=dp, zero_stage=stage)
        scaler = getattr(self._zero, "loss_scaler", None)
        if scaler is not None:
            sd["loss_scaler"] = {k: _plain(getattr(scaler, k)) for k in SCALER_FIELDS
                                 if isinstance(_plain(getattr(scaler, k, None)),
                                               (bool, int, float))}
        return sd

    def check(self, sd: Any) -> None:
        """Refuse another data-parallel world or ZeRO stage (before anything is restored)."""
        if not isinstance(sd, dict):
            raise IncompatibleTargetError(
                f"the checkpoint holds a {type(sd).__name__} here, not a DeepSpeed engine's "
                "progress; restore it into the state that saved it")
        dp, stage = self._where()
        saved_dp, saved_stage = sd.get("dp_world_size", dp), sd.get("zero_stage", stage)
        if (saved_dp, saved_stage) != (dp, stage):
            raise IncompatibleTargetError(
                f"this DeepSpeed checkpoint was saved by {saved_dp} data-parallel rank(s) "
                f"with ZeRO stage {saved_stage}; this engine has {dp} with stage {stage}. "
                "ZeRO partitions restore into the layout that saved them: resume with the "
                "same number of ranks and the same zero_optimization.stage")

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.check(sd)
        for k in _COUNTERS:
            if k in sd:
                setattr(self._engine, k, int(sd[k]))
        scaler = getattr(self._zero, "loss_scaler", None)
        for k, v in (sd.get("loss_scaler") or {}).items():
            if scaler is not None and k in SCALER_FIELDS and hasattr(scaler, k):
                live = getattr(scaler, k)
                setattr(scaler, k, torch.tensor(v, dtype=live.dtype, device=live.device)
                        if isinstance(live, torch.Tensor) else v)


class _ProgressAdapter(Adapter):
    """pitstop's view of :class:`_Progress`: values, checked before any byte is restored."""

    def can_handle(self, obj: Any) -> bool:
        return isinstance(obj, _Progress)

    def capture(self, obj: _Progress) -> Any:
        return obj.state_dict()

    def check(self, obj: _Progress, tree: Any) -> None:
        obj.check(tree)

    def apply(self, obj: _Progress, tree: Any) -> None:
        obj.load_state_dict(tree)


register_adapter(_ProgressAdapter())


def _plain(v: Any) -> Any:
    return v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v


def _optimizer(engine: Any) -> tuple[torch.optim.Optimizer | None, DeepSpeedZeroOptimizer | None]:
    opt = engine.optimizer
    if opt is None:
        return None, None
    if isinstance(opt, DeepSpeedZeroOptimizer):
        return opt.optimizer, opt
    if isinstance(opt, torch.optim.Optimizer) and not isinstance(opt, DeepSpeedOptimizer):
        return opt, None
    raise UnsupportedStateError(
        f"engine_state: the engine's optimizer is a {type(opt).__name__} (ZeRO stage "
        f"{engine.zero_optimization_stage()}"
        f"{', fp16' if engine.fp16_enabled() else ''}{', bf16' if engine.bfloat16_enabled() else ''}"
        "); pitstop saves ZeRO stages 1 and 2 (fp32 or bf16 parameters) and stage 0 with a "
        "plain torch optimizer. Use zero_optimization.stage 1 or 2, or keep "
        "engine.save_checkpoint for this configuration.")


def engine_state(engine: Any, *, client_state: MutableMapping[str, Any] | None = None
                 ) -> dict[str, Any]:
    """The state of DeepSpeed ``engine`` (from ``deepspeed.initialize``) to put in a pitstop
    state, e.g. ``{"engine": engine_state(engine), "loader": loader, "rng": pitstop.RNG()}``.

    Make it once, after ``deepspeed.initialize``, on every rank. ``client_state``: a dict of
    your own values saved with it and restored into it in place. Raises
    :class:`pitstop.UnsupportedStateError` for an engine whose optimizer pitstop cannot save
    exactly (ZeRO-3, the fp16 and bf16 wrappers of stage 0, a pipeline engine)."""
    if not isinstance(engine, deepspeed.DeepSpeedEngine):
        raise InvalidArgumentError(
            f"engine_state takes the engine deepspeed.initialize returns, got a "
            f"{type(engine).__name__}; for a plain model and optimizer put them in the state "
            "as they are")
    if isinstance(engine, deepspeed.PipelineEngine):
        raise UnsupportedStateError(
            "engine_state: a PipelineEngine's layers are saved per stage by DeepSpeed; "
            "pitstop does not save pipeline engines yet. Keep engine.save_checkpoint for it.")
    if client_state is not None and not isinstance(client_state, MutableMapping):
        raise InvalidArgumentError(
            f"client_state must be a dict (restored in place), got a "
            f"{type(client_state).__name__}")
    base, zero = _optimizer(engine)
    if getattr(engine, "training_dataloader", None) is not None:
        warnings.warn(
            "pitstop: the engine's training_dataloader (deepspeed.initialize(training_data="
            "...)) has no position pitstop can save, so a resume would restart its epoch. "
            "Iterate a pitstop.adapters.torch.ResumableLoader over the same dataset instead "
            "and put it in the state.", stacklevel=2)
    # progress first: its check (world size, stage) is the clearest refusal
    state: dict[str, Any] = {"progress": _Progress(engine, zero), "module": engine.module}
    if base is not None:
        state["optimizer"] = base
    if zero is not None:
        state["fp32_groups"] = list(zero.single_partition_of_fp32_groups)
    if engine.lr_scheduler is not None:
        state["lr_scheduler"] = engine.lr_scheduler
    if client_state is not None:
        state["client_state"] = client_state
    return state
