"""Import a DeepSpeed checkpoint directory (what ``engine.save_checkpoint(save_dir)`` writes)
as one committed pitstop checkpoint, laid out as a live save of
:func:`pitstop.integrations.deepspeed.engine_state` writes it, so
``mgr.restore({"engine": engine_state(engine)})`` resumes that engine where DeepSpeed left it.

A DeepSpeed directory holds a ``latest`` file naming a tag (``global_step12``), and in the
tag's folder ``mp_rank_00_model_states.pt`` (module weights, lr scheduler, step counters,
the client state, and the optimizer when ZeRO is off) and, with ZeRO stages 1 and 2, one
``zero_pp_rank_R_mp_rank_00_optim_states.pt`` per data-parallel rank (the rank's fp32
master partition, its optimizer moments and the loss scaler).

The files are pickles. They are read with ``torch.load(weights_only=True)``, torch's
restricted unpickler, with three DeepSpeed names allowed and bound to inert stand-ins of
this module (DeepSpeed itself is not imported): ``LossScaler`` / ``DynamicLossScaler`` and
``fragment_address`` become plain attribute holders, ``ZeroStageEnum`` an int. Nothing in
the file can run code.

Only the checkpoints of one data-parallel rank and one model-parallel rank are imported:
pitstop restores a ZeRO partition into the rank that saved it, and a one-process import has
no ranks to give the others to. Pipeline and tensor-parallel checkpoints, ZeRO stage 3 and
the fp16/bf16 optimizer wrappers of stage 0 are refused by name.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
from collections.abc import Mapping
from typing import Any

import torch

from pitstop.core.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedStateError,
)
from pitstop.interop.common import PathLike, refuse_existing, write_import
from pitstop.interop.detect import deepspeed_tag_dir
from pitstop.interop.torch_save import _reason, _torch_to_numpy_tree

log = logging.getLogger("pitstop")

__all__ = ["import_deepspeed", "KEYS", "SCALER_FIELDS"]

#: the entries of an engine's state (:func:`pitstop.integrations.deepspeed.engine_state`)
KEYS = ("module", "optimizer", "fp32_groups", "lr_scheduler", "progress", "client_state")
#: the loss scaler's attributes kept in ``progress/loss_scaler`` (those it has)
SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor",
                 "scale_window", "min_scale", "delayed_shift", "cur_hysteresis",
                 "consecutive_hysteresis", "raise_error_at_min_scale", "dynamic")
#: what DeepSpeed puts in the model file besides the user's client_state
_ENGINE_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
                "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler",
                "random_ltd", "sparse_tensor_module_names", "skipped_steps", "global_steps",
                "global_samples", "dp_world_size", "mp_world_size",
                "checkpoint_parallel_dimensions", "ds_config", "ds_version"}
_ZERO_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


class _Holder:
    """What an allowed DeepSpeed object becomes: its attributes, nothing else."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, Mapping):
            self.__dict__.update(state)


def _stage(value: Any) -> int:
    return int(value)


def _allowed() -> list[Any]:
    """The DeepSpeed globals of a ZeRO optimizer file, bound to the stand-ins above."""
    holders = [type(name, (_Holder,), {}) for name in
               ("LossScaler", "DynamicLossScaler", "fragment_address")]
    return [(holders[0], "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
            (holders[1], "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
            (holders[2], "deepspeed.utils.tensor_fragment.fragment_address"),
            (_stage, "deepspeed.runtime.zero.config.ZeroStageEnum")]


def _load(path: str) -> Any:
    try:
        with torch.serialization.safe_globals(_allowed()):
            return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise UnsupportedStateError(
            f"{path}: this DeepSpeed file holds objects beyond tensors, plain values and the "
            f"loss scaler ({_reason(e)}); pitstop does not unpickle them. Load it with "
            "engine.load_checkpoint, then save through pitstop's engine_state.") from e
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(f"{path}: missing from the DeepSpeed checkpoint") from e
    except Exception as e:  # noqa: BLE001 - a garbled or crafted file raises anything
        raise CorruptCheckpointError(
            f"{path}: torch.load cannot read this file ({_reason(e)}); is the DeepSpeed "
            "checkpoint complete?", checkpoint=path) from e


def _zero_files(tag_dir: str) -> dict[tuple[int, int], str]:
    out = {}
    for name in sorted(os.listdir(tag_dir)):
        m = _ZERO_FILE.match(name)
        if m:
            out[(int(m.group(1)), int(m.group(2)))] = os.path.join(tag_dir, name)
    return out


def _check_layout(tag_dir: str, model: Mapping[str, Any]) -> None:
    """One data-parallel and one model-parallel rank, no pipeline: what pitstop imports."""
    dp, mp = model.get("dp_world_size", 1), model.get("mp_world_size", 1)
    dims = model.get("checkpoint_parallel_dimensions") or {}
    pipeline = any(n.startswith("layer_") for n in os.listdir(tag_dir))
    if dp != 1 or mp != 1 or dims.get("pp_degree", 1) != 1 or pipeline:
        raise UnsupportedStateError(
            f"{tag_dir}: saved by {dp} data-parallel x {mp} model-parallel ranks"
            f"{' with a pipeline' if pipeline or dims.get('pp_degree', 1) != 1 else ''}; "
            "pitstop imports the DeepSpeed checkpoints of one rank only. Resume that run "
            "with engine.load_checkpoint on the same ranks and save it through pitstop's "
            "engine_state there (every rank then writes its own part).")


def _scaler(obj: Any) -> dict[str, Any]:
    fields = vars(obj) if isinstance(obj, _Holder) else {}
    return {k: fields[k] for k in SCALER_FIELDS
            if isinstance(fields.get(k), (bool, int, float))}


def _zero_part(path: str) -> tuple[Any, list[Any], dict[str, Any]]:
    """``(base optimizer state, fp32 partitions as the live engine holds them, scaler)``."""
    sd = _load(path).get("optimizer_state_dict")
    if not isinstance(sd, Mapping) or "single_partition_of_fp32_groups" not in sd:
        raise UnsupportedStateError(
            f"{path}: not a ZeRO stage 1/2 optimizer file (no single_partition_of_fp32_groups);"
            " pitstop imports ZeRO stages 0, 1 and 2")
    base = sd.get("base_optimizer_state")
    if not isinstance(base, Mapping):  # an elastic checkpoint: per-group lists
        raise UnsupportedStateError(
            f"{path}: an elastic ZeRO checkpoint (zero_optimization.elastic_checkpoint); "
            "save it again without elastic_checkpoint, or resume it with DeepSpeed")
    paddings = sd.get("group_paddings") or [0] * len(sd["single_partition_of_fp32_groups"])
    groups = []
    for t, pad in zip(sd["single_partition_of_fp32_groups"], paddings, strict=True):
        # DeepSpeed saves the partition without the alignment padding the live one has
        # (zeros: the padding never gets a gradient)
        groups.append(torch.cat([t.reshape(-1), t.new_zeros(int(pad))]) if pad else t)
    return base, groups, _scaler(sd.get("loss_scaler"))


def _tree(tag_dir: str) -> tuple[dict[str, Any], int]:
    """The engine_state tree of the checkpoint in ``tag_dir``, and its global step."""
    model = _load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
    if not isinstance(model, Mapping) or not isinstance(model.get("module"), Mapping):
        raise CorruptCheckpointError(
            f"{tag_dir}/mp_rank_00_model_states.pt: no module state dict in it; is it a "
            "DeepSpeed checkpoint?", checkpoint=tag_dir)
    _check_layout(tag_dir, model)
    config = model.get("ds_config") or {}
    stage = int((config.get("zero_optimization") or {}).get("stage", 0))
    steps = int(model.get("global_steps", 0))
    accumulation = int(config.get("gradient_accumulation_steps", 1) or 1)
    progress: dict[str, Any] = {
        "global_steps": steps, "global_samples": int(model.get("global_samples", 0)),
        "skipped_steps": int(model.get("skipped_steps", 0)),
        # DeepSpeed does not save it; at a save (an optimizer step) it is this
        "micro_steps": steps * accumulation, "dp_world_size": 1, "zero_stage": stage}
    tree: dict[str, Any] = {"module": dict(model["module"])}
    zero = _zero_files(tag_dir)
    if stage in (1, 2):
        if set(zero) != {(0, 0)}:
            raise CorruptCheckpointError(
                f"{tag_dir}: a ZeRO stage {stage} checkpoint of one rank needs "
                "zero_pp_rank_0_mp_rank_00_optim_states.pt (found "
                f"{sorted(os.path.basename(p) for p in zero.values()) or 'none'})",
                checkpoint=tag_dir)
        base, groups, scaler = _zero_part(zero[(0, 0)])
        tree["optimizer"], tree["fp32_groups"] = dict(base), groups
        progress["loss_scaler"] = scaler
    elif stage == 0:
        if isinstance(model.get("optimizer"), Mapping):
            tree["optimizer"] = _plain_optimizer(tag_dir, model["optimizer"])
    else:
        raise UnsupportedStateError(
            f"{tag_dir}: a ZeRO stage {stage} checkpoint; pitstop imports stages 0, 1 and 2")
    if model.get("lr_scheduler") is not None:
        tree["lr_scheduler"] = model["lr_scheduler"]
    tree["progress"] = progress
    client = {k: v for k, v in model.items() if k not in _ENGINE_KEYS}
    if client:
        tree["client_state"] = client
    return tree, steps


def _plain_optimizer(tag_dir: str, sd: Mapping[str, Any]) -> dict[str, Any]:
    if "state" not in sd or "param_groups" not in sd:
        raise UnsupportedStateError(
            f"{tag_dir}: the optimizer in mp_rank_00_model_states.pt is a DeepSpeed fp16/bf16 "
            "wrapper's state, not a torch optimizer's; pitstop imports stage 0 with a plain "
            "optimizer, and ZeRO stages 1 and 2")
    return dict(sd)


def import_deepspeed(src: PathLike, directory: PathLike, step: int | None = None, *,
                     tag: str | None = None, key: str | None = "engine",
                     metrics: Mapping[str, Any] | None = None) -> int:
    """Import the DeepSpeed checkpoint in ``src`` (the ``save_dir`` of
    ``engine.save_checkpoint``; ``tag`` picks one, default the one ``latest`` names; a tag
    folder itself works too) as committed pitstop checkpoint ``step`` of ``directory``
    (default: the checkpoint's ``global_steps - 1``, the index of the last step it trained,
    the step a pitstop loop would have saved it at). The engine's state is put under
    ``key`` of the checkpoint (``"engine"``: restore it as ``{"engine": engine_state(engine),
    ...}``; None: at its root). Returns the step.

    Raises :class:`pitstop.CheckpointNotFoundError` when ``src`` holds no DeepSpeed
    checkpoint, :class:`pitstop.UnsupportedStateError` for a layout pitstop does not import
    (several ranks, pipeline, ZeRO-3), :class:`pitstop.StepExistsError` when ``step`` is
    already there."""
    source = os.fspath(src)
    tag_dir = deepspeed_tag_dir(source, tag)
    if tag_dir is None:
        raise CheckpointNotFoundError(
            f"{source}: no DeepSpeed checkpoint there (a 'latest' file naming a folder with "
            f"mp_rank_00_model_states.pt{'' if tag is None else f', or a folder {tag!r}'}); "
            "give the save_dir of engine.save_checkpoint")
    if step is not None:
        encryption = refuse_existing(directory, step)
    tree, global_steps = _tree(tag_dir)
    if step is None:
        step = max(global_steps - 1, 0)
        encryption = refuse_existing(directory, step)
    state = _torch_to_numpy_tree(tree)
    return write_import(state if key is None else {key: state}, directory, step, metrics,
                        encryption)
