"""Adapters for torch objects: tensors, modules, optimizers, stateful objects (generators and
samplers: ``_values``).

Each ``capture`` returns a tree whose tensors are :class:`TensorLeaf` references to the live
tensors (restore streams bytes straight into them); each ``apply`` puts back what cannot be
restored in place: hyper-parameters, step counters, scheduler and scaler state, and whole
subtrees the checkpoint had but the target did not (an optimizer before its first step).

``check`` refuses, from the checkpoint's shapes and values alone, a restore that ``apply``
would refuse, so the core can stop before it writes a byte; ``apply`` runs the same checks
(it may be called without them) and raises :class:`pitstop.CheckpointError` subclasses only,
with the framework's exception chained as the cause.
"""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np
import torch
from torch import nn

from pitstop.adapters.torch._dtensor import dtensor_like, is_dtensor, tensor_leaf
from pitstop.adapters.torch._leaf import TensorLeaf, to_tensor
from pitstop.core.adapter import Adapter, has_state_dict_methods
from pitstop.core.errors import CheckpointError, IncompatibleTargetError

_WRAPPER = "_orig_mod"  # torch.compile's OptimizedModule keeps the real module here


def unwrap_module(module: nn.Module) -> nn.Module:
    """The module a wrapper holds: DDP / DataParallel ``.module``, ``torch.compile``'s
    ``_orig_mod``, any nesting of them. Checkpoint keys are the unwrapped module's keys."""
    while True:
        inner = getattr(module, _WRAPPER, None)
        if isinstance(inner, nn.Module):
            module = inner
            continue
        if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            module = module.module
            continue
        return module


def clean_key(key: str) -> str:
    """Drop ``_orig_mod.`` components (compiled submodules) from a state_dict key."""
    if _WRAPPER not in key:
        return key
    return ".".join(p for p in key.split(".") if p != _WRAPPER)


def _wrap(tree: Any, where: str, lazy_safe: bool = False) -> Any:
    """Copy the containers of ``tree`` with every tensor replaced by a TensorLeaf; each copy
    keeps its container's type (see :func:`_like`). ``lazy_safe``: only the optimizer's step
    writes these tensors (see :func:`lazy_leaf`)."""
    if isinstance(tree, torch.Tensor):
        leaf = tensor_leaf(tree, where)
        return lazy_leaf(leaf) if lazy_safe else leaf
    if isinstance(tree, Mapping):
        return _like(tree, [(k, _wrap(v, f"{where}/{k}" if where else str(k), lazy_safe))
                            for k, v in tree.items()])
    if isinstance(tree, (list, tuple)):
        return _like(tree, [_wrap(v, f"{where}/{i}" if where else str(i), lazy_safe)
                            for i, v in enumerate(tree)])
    return tree


def lazy_leaf(leaf: TensorLeaf) -> TensorLeaf:
    """Mark ``leaf`` as one ``snapshot="lazy"`` may copy after save() returns: a parameter or
    an optimizer state tensor, which only ``optimizer.step()`` writes (the forward and
    backward passes do not), and a step waits for the copy. A DTensor's shards stay eager,
    and so does an inference tensor (it has no version counter to catch writes with)."""
    if type(leaf) is TensorLeaf and not leaf.tensor.is_inference():
        leaf.lazy_safe = True
    return leaf


def _unwrap(tree: Any) -> Any:
    """Inverse of :func:`_wrap` on a restored tree: TensorLeaf -> its (restored) tensor, a
    numpy array rebuilt from the checkpoint -> a new CPU tensor (``load_state_dict`` moves
    it to the right device, exactly as a CPU-mapped load of a torch file would). Containers
    keep their types (a scheduler's ``Counter`` of milestones stays a Counter)."""
    if isinstance(tree, TensorLeaf):
        return tree.tensor
    if isinstance(tree, (np.ndarray, np.generic)):
        return to_tensor(np.asarray(tree))
    if isinstance(tree, Mapping):
        return _like(tree, [(k, _unwrap(v)) for k, v in tree.items()])
    if isinstance(tree, (list, tuple)):
        return _like(tree, [_unwrap(v) for v in tree])
    return tree


def _like(like: Any, items: list[Any]) -> Any:
    """A new container of ``like``'s own type holding ``items`` (``(key, value)`` pairs for
    a mapping): Counter, defaultdict (same factory), OrderedDict and other dict subclasses
    (their attributes copied), list subclasses, namedtuples (``_make``) and tuple types
    built from an iterable. What cannot be rebuilt that way becomes a dict, list or tuple."""
    cls = type(like)
    if isinstance(like, Mapping):
        if cls is dict or cls is _Captured:
            return dict(items)
        if isinstance(like, MutableMapping):
            try:
                out = copy.copy(like)  # keeps default_factory and instance attributes
                out.clear()
                for k, v in items:  # one by one: Counter.update would add counts
                    out[k] = v
                return out
            except Exception:  # noqa: BLE001 - a mapping type that does not copy
                pass
        return dict(items)
    if isinstance(like, list):
        if cls is not list:
            try:
                seq = copy.copy(like)
                seq[:] = items
                return seq
            except Exception:  # noqa: BLE001 - a list type that does not copy
                pass
        return list(items)
    if cls is tuple:
        return tuple(items)
    make = getattr(cls, "_make", None)
    try:
        out = make(items) if callable(make) else cls(items)
        if type(out) is cls and len(out) == len(items):
            return out
    except Exception:  # noqa: BLE001 - a tuple type built another way
        pass
    return tuple(items)


def _refused(obj: Any, e: Exception, fix: str) -> IncompatibleTargetError:
    """``obj.load_state_dict`` raised ``e``: the error pitstop raises instead (cause chained
    by the caller)."""
    return IncompatibleTargetError(
        f"{type(obj).__name__}.load_state_dict refused the checkpoint's state "
        f"({type(e).__name__}: {e}). {fix}")


class TensorAdapter(Adapter):
    """A plain tensor in the state: saved as one array, restored in place."""

    def can_handle(self, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor)

    def capture(self, obj: torch.Tensor) -> Any:
        leaf = tensor_leaf(obj)
        # a parameter placed in the state by itself is still written by optimizer steps only
        return lazy_leaf(leaf) if isinstance(obj, nn.Parameter) else leaf

    def apply(self, obj: torch.Tensor, tree: Any) -> None:
        if isinstance(tree, np.ndarray):  # not restored in place: copy it in
            tensor_leaf(obj).assign(tree)


class ModuleAdapter(Adapter):
    """``nn.Module`` (also DDP-wrapped or ``torch.compile``d): parameters and buffers by
    reference, keys as in the unwrapped module's ``state_dict``; ``_extra_state`` as values."""

    def can_handle(self, obj: Any) -> bool:
        return isinstance(obj, nn.Module)

    def capture(self, obj: nn.Module) -> dict[str, Any]:
        module = unwrap_module(obj)
        out: dict[str, Any] = {}
        for key, value in module.state_dict(keep_vars=True).items():
            key = clean_key(key)
            if isinstance(value, nn.Parameter):
                out[key] = lazy_leaf(tensor_leaf(value, key))  # buffers: copied at save()
            else:
                out[key] = tensor_leaf(value, key) if isinstance(value, torch.Tensor) \
                    else value
        return out

    def replaceable(self, obj: nn.Module) -> list[str]:
        """Entries whose checkpoint value may differ from the live one in shape, dtype or
        kind, because the module's own ``load_state_dict`` takes them as they come: every
        ``_extra_state`` (``get_extra_state`` may return a tensor of another length, as
        TransformerEngine's fp8 metadata does), and the parameters and buffers of submodules
        that override ``_load_from_state_dict`` (quantization observers and FakeQuantize
        resize their buffers there). The core reads these fresh and ``apply`` hands them to
        ``load_state_dict``, which takes or refuses them as torch does."""
        out: list[str] = []
        for prefix, sub in unwrap_module(obj).named_modules(remove_duplicate=False):
            head = f"{prefix}." if prefix else ""
            if type(sub).get_extra_state is not nn.Module.get_extra_state:
                out.append(clean_key(head + "_extra_state"))
            if not _loads_its_own_way(type(sub)):
                continue
            skip = sub._non_persistent_buffers_set
            for name, t in (*sub._parameters.items(), *sub._buffers.items()):
                if t is not None and name not in skip:
                    out.append(clean_key(head + name))
        return out

    def apply(self, obj: nn.Module, tree: dict[str, Any]) -> None:
        # Tensors were restored in place; the module still gets its state through its own
        # load_state_dict, as torch hands it a loaded state dict, so that its load hooks and
        # _load_from_state_dict overrides run (a cache derived from the weights is refreshed,
        # an observer resizes its buffers). A tensor restored in place is handed as the live
        # tensor itself: ``param.copy_(param)`` returns at once, and the parameter stays the
        # same object. Where nothing would run but those no-op copies (no hooks, overrides or
        # extra state, every tensor in place), the call is skipped: torch's load_state_dict
        # costs time quadratic in the number of children of a wide module.
        module = unwrap_module(obj)
        live = module.state_dict(keep_vars=True)
        names = {clean_key(k): k for k in live}
        loadable: OrderedDict[str, Any] = OrderedDict()
        needed = _loads_with_code(module)
        for k, v in tree.items():
            name = names.get(k, k)
            now = live.get(name)
            if isinstance(v, TensorLeaf) and isinstance(now, torch.Tensor) and \
                    _same_memory(v.tensor, now):
                loadable[name] = now
            else:  # extra state, a fresh entry, a copy a state_dict hook made
                loadable[name] = _unwrap(v)
                needed = True
        if not needed:
            return
        # the versions _load_from_state_dict overrides read (without them an observer
        # would put its default eps over the restored one, as for a pre-1.x checkpoint)
        meta = getattr(live, "_metadata", None)
        if meta is None:
            meta = {p: {"version": m._version}
                    for p, m in module.named_modules(remove_duplicate=False)}
        loadable._metadata = meta  # type: ignore[attr-defined]
        inference = any(isinstance(t, torch.Tensor) and t.is_inference()
                        for t in loadable.values())
        try:
            # an inference tensor takes in-place writes only inside inference mode
            with torch.inference_mode() if inference else contextlib.nullcontext():
                result = module.load_state_dict(loadable, strict=False)
        except Exception as e:  # noqa: BLE001 - set_extra_state or a hook refused it
            raise _refused(module, e, "Build the module as the run that saved it did, or "
                           "leave it out of the state.") from e
        if result.unexpected_keys:
            raise IncompatibleTargetError(
                f"module {type(module).__name__} has no entries {result.unexpected_keys} that "
                "the checkpoint holds; build it as the run that saved it did, or restore with "
                "strict=False", unexpected=list(result.unexpected_keys))


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` is ``b``, or the same elements of the same memory (a detached alias)."""
    return a is b or (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape
                      and a.stride() == b.stride() and a.data_ptr() == b.data_ptr())


def _loads_with_code(module: nn.Module) -> bool:
    """Whether ``load_state_dict`` runs code of the module's own beyond copying tensors: load
    hooks, a ``_load_from_state_dict`` override (torch.nn's own only migrate old versions,
    a no-op here), ``set_extra_state``."""
    for sub in module.modules():
        if sub._load_state_dict_pre_hooks or sub._load_state_dict_post_hooks:
            return True
        cls = type(sub)
        if cls.get_extra_state is not nn.Module.get_extra_state or _loads_its_own_way(cls):
            return True
    return False


def _loads_its_own_way(cls: type) -> bool:
    """True when ``cls`` overrides ``_load_from_state_dict`` with code that may take entries
    of another shape: any override outside ``torch.nn.modules`` (quantization observers,
    FakeQuantize, user modules). torch.nn's own (BatchNorm, InstanceNorm) only migrate old
    versions and keep torch's shape check, which the core does up front."""
    for klass in cls.__mro__:
        if "_load_from_state_dict" in vars(klass):
            return klass is not nn.Module and not klass.__module__.startswith(
                "torch.nn.modules.")
    return False


class OptimizerAdapter(Adapter):
    """Any ``torch.optim.Optimizer``: per-parameter state tensors by reference (int keys, as
    in ``state_dict``), ``param_groups`` (lr, betas, weight decay, extras) as values.

    Restoring behaves as ``Optimizer.load_state_dict`` does: state the checkpoint has for a
    parameter replaces the live one (``replace_on_mismatch``: also when the live optimizer
    has stepped further, or LBFGS history lists have another length), while tensors whose
    layout matches are restored in place and stay the very objects in ``optimizer.state``.
    Unlike ``load_state_dict``, every state tensor keeps the dtype it was saved with (fp32
    moments of bf16 parameters stay fp32).
    """

    replace_on_mismatch = True

    def can_handle(self, obj: Any) -> bool:
        return isinstance(obj, torch.optim.Optimizer)

    def capture(self, obj: torch.optim.Optimizer) -> dict[str, Any]:
        sd = obj.state_dict()
        # the per-parameter state: written by step() only. Tensor hyper-parameters in
        # param_groups (a tensor lr a scheduler fills in place) are copied at save()
        out = _wrap({k: v for k, v in sd.items() if k != "state"}, "")
        if "state" in sd:
            out["state"] = _wrap(sd["state"], "state", lazy_safe=True)
            out = {k: out[k] for k in sd}  # the state dict's own order
        return out  # type: ignore[no-any-return]

    def check(self, obj: torch.optim.Optimizer, tree: Any) -> None:
        """What ``Optimizer.load_state_dict`` validates: the number of parameter groups and
        of parameters in each."""
        name = type(obj).__name__
        groups = tree.get("param_groups") if isinstance(tree, Mapping) else None
        if (not isinstance(groups, (list, tuple)) or not isinstance(tree.get("state"), Mapping)
                or not all(isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple))
                           for g in groups)):
            raise IncompatibleTargetError(
                f"the checkpoint's entry for this {name} is not an optimizer state dict (no "
                "'state' and 'param_groups' with 'params' lists); restore it into the kind of "
                "object that saved it")
        fix = (f"Build the {name} over the same parameter groups as the run that saved it "
               "(same number of groups, same number of parameters in each, in the same order).")
        if len(groups) != len(obj.param_groups):
            raise IncompatibleTargetError(
                f"the checkpoint's {name} has {len(groups)} parameter groups, this one has "
                f"{len(obj.param_groups)}. {fix}")
        for i, (saved, live) in enumerate(zip(groups, obj.param_groups, strict=True)):
            if len(saved["params"]) != len(live["params"]):
                raise IncompatibleTargetError(
                    f"parameter group {i} of the checkpoint's {name} has "
                    f"{len(saved['params'])} parameters, this one has {len(live['params'])}. "
                    f"{fix}")

    def apply(self, obj: torch.optim.Optimizer, tree: dict[str, Any]) -> None:
        # load_state_dict keeps the tensors restored in place (``.to`` is a no-op on the same
        # device and dtype) and turns rebuilt arrays into tensors on the parameters' devices,
        # as it does for any state dict; then every tensor whose dtype it changed is put back
        self.check(obj, tree)
        given = _unwrap(tree)
        try:
            obj.load_state_dict(_with_id_sets(given))
        except Exception as e:  # noqa: BLE001 - a load_state_dict hook or torch refused it
            raise _refused(obj, e, "Build the optimizer as the run that saved it did (same "
                           "class, same parameter groups).") from e
        _keep_saved_dtypes(obj, given)
        _shard_like_params(obj)


class _ParamIds(list):  # type: ignore[type-arg]
    """A parameter group's saved ``params`` ids whose ``in`` is a set lookup.

    ``Optimizer.load_state_dict`` asks ``param_id in group["params"]`` of every saved group
    once per state tensor: a list scan, so quadratic in the parameters (56 s of a 58 s
    restore with 100,000 parameters). The optimizer's live groups never hold this list
    (load_state_dict puts its own ``params`` back), and a deep copy keeps the class."""

    _ids: frozenset[Any] | None = None
    _n = -1

    def __contains__(self, item: object) -> bool:
        ids = self._ids
        if ids is None or self._n != len(self):
            try:
                ids = self._ids = frozenset(self)
            except TypeError:  # an unhashable id: what a list would answer
                return list.__contains__(self, item)
            self._n = len(self)
        try:
            return item in ids
        except TypeError:
            return list.__contains__(self, item)


def _with_id_sets(given: dict[str, Any]) -> dict[str, Any]:
    """``given`` with each parameter group's ``params`` a :class:`_ParamIds` (a shallow copy:
    the dict :func:`_keep_saved_dtypes` reads afterwards is unchanged)."""
    groups = given.get("param_groups")
    if not isinstance(groups, list):
        return given
    out = dict(given)
    out["param_groups"] = [
        {**g, "params": _ParamIds(g["params"])} if isinstance(g, dict)
        and type(g.get("params")) is list else g for g in groups]
    return out


def _shard_like_params(opt: torch.optim.Optimizer) -> None:
    """Lay out as its parameter each whole plain state tensor that ``load_state_dict`` put
    beside a DTensor parameter (FSDP2, tensor parallel): the checkpoint's state, read whole
    because the live optimizer had none yet (no step taken). Each rank keeps its region of it,
    as ``torch.distributed.checkpoint``'s ``set_optimizer_state_dict`` would."""
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p)
            if not state or not is_dtensor(p):
                continue
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and not is_dtensor(v) \
                        and tuple(v.shape) == tuple(p.shape):
                    state[k] = dtensor_like(p, v)


def _keep_saved_dtypes(opt: torch.optim.Optimizer, given: Mapping[str, Any]) -> None:
    """Undo ``load_state_dict``'s cast of floating state to the parameters' dtype: each state
    tensor whose dtype it changed is replaced by the tensor it was given (moved to the device
    load_state_dict chose), so a tensor restored in place stays the object in the state.
    Tensor hyper-parameters (a tensor ``lr``), which load_state_dict deep-copies, are put
    back too where the copy is alike."""
    saved_ids = [i for g in given["param_groups"] for i in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    by_id = dict(zip(saved_ids, params, strict=False))
    for k, saved in given["state"].items():
        p = by_id.get(k)
        if p is None or p not in opt.state:
            continue
        opt.state[p] = _same_dtypes(opt.state[p], saved)
    for group, saved_group in zip(opt.param_groups, given["param_groups"], strict=False):
        for k, v in saved_group.items():
            now = group.get(k)
            if (k != "params" and isinstance(v, torch.Tensor) and isinstance(now, torch.Tensor)
                    and now is not v and now.dtype == v.dtype and now.device == v.device
                    and now.shape == v.shape):
                group[k] = v


def _same_dtypes(live: Any, saved: Any) -> Any:
    if isinstance(live, torch.Tensor) and isinstance(saved, torch.Tensor):
        if live is saved or live.dtype == saved.dtype:
            return live
        return saved if saved.device == live.device else saved.to(live.device)
    if isinstance(live, dict) and isinstance(saved, Mapping):
        for k in live:
            if k in saved:
                live[k] = _same_dtypes(live[k], saved[k])
        return live
    if isinstance(live, (list, tuple)) and isinstance(saved, (list, tuple)) \
            and len(live) == len(saved):
        items = [_same_dtypes(a, b) for a, b in zip(live, saved, strict=True)]
        return type(live)(items) if type(live) in (list, tuple) else live
    return live


def _lr_scheduler_types() -> tuple[type, ...]:
    sched = torch.optim.lr_scheduler
    return tuple(t for t in (getattr(sched, "LRScheduler", None),
                             getattr(sched, "_LRScheduler", None),
                             getattr(sched, "ReduceLROnPlateau", None)) if isinstance(t, type))


def _grad_scaler_types() -> tuple[type, ...]:
    found = [getattr(getattr(torch, "amp", None), "GradScaler", None),
             getattr(getattr(torch.cuda, "amp", None), "GradScaler", None)]
    return tuple(t for t in found if isinstance(t, type))


class StatefulAdapter(Adapter):
    """Objects with ``state_dict()``/``load_state_dict()`` (LR schedulers, GradScaler, user
    objects): like the generic adapter, but tensors inside the state dict are captured by
    reference and handed back as tensors. Restoring replaces the state, as
    ``load_state_dict`` does, also when the checkpoint's layout differs from the live one."""

    replace_on_mismatch = True

    def can_handle(self, obj: Any) -> bool:
        return (has_state_dict_methods(obj)
                and not isinstance(obj, (nn.Module, torch.optim.Optimizer, torch.Tensor)))

    def capture(self, obj: Any) -> Any:
        tree = _wrap(obj.state_dict(), "")
        return _Captured(tree) if type(tree) is dict else tree

    def check(self, obj: Any, tree: Any) -> None:
        """What torch's own ``load_state_dict`` of schedulers and GradScaler would refuse."""
        name = type(obj).__name__
        if isinstance(obj, _grad_scaler_types()):
            if not obj.is_enabled():  # type: ignore[attr-defined]
                return  # a disabled scaler ignores any state
            if not isinstance(tree, Mapping) or not tree:
                raise IncompatibleTargetError(
                    f"the checkpoint's {name} was disabled when it was saved (its state is "
                    f"empty) and this one is enabled. Build it with enabled=False to resume "
                    "that run as it was, or leave it out of the state and restore with "
                    "strict=False to start its scale afresh.")
            missing = [k for k in ("scale", "growth_factor", "backoff_factor",
                                   "growth_interval", "_growth_tracker") if k not in tree]
            if missing:
                raise IncompatibleTargetError(
                    f"the checkpoint's entry for this {name} lacks {missing}; it was not saved "
                    "from a GradScaler. Restore it into the kind of object that saved it.")
            return
        if isinstance(obj, _lr_scheduler_types()):
            if not isinstance(tree, Mapping):
                raise IncompatibleTargetError(
                    f"the checkpoint's entry for this {name} is a {type(tree).__name__}, not "
                    "a scheduler state dict; restore it into the kind of object that saved it")
            for key, what in (("_schedulers", "schedulers"), ("lr_lambdas", "lr_lambdas")):
                mine, theirs = getattr(obj, key, None), tree.get(key)
                if not isinstance(mine, list) or not isinstance(theirs, list):
                    continue
                if len(mine) != len(theirs):
                    raise IncompatibleTargetError(
                        f"the checkpoint's {name} has {len(theirs)} {what}, this one has "
                        f"{len(mine)}; build it as the run that saved it did")
                if key == "_schedulers":
                    for child, sub in zip(mine, theirs, strict=True):
                        self.check(child, sub)

    def apply(self, obj: Any, tree: Any) -> None:
        self.check(obj, tree)
        try:
            given = _unwrap(tree)
            if type(tree) is not _Captured:
                # the checkpoint's state handed whole (its layout differs from the live
                # one): JSON kept dicts, lists and tuples, the live state says of which
                # types (a Counter of milestones) and which keys were ints (a DCP import
                # stores every key as a string)
                given = _like_live(given, obj.state_dict())
            obj.load_state_dict(given)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the object's load_state_dict raised
            raise _refused(obj, e, "Build it as the run that saved it did, or leave it out "
                           "of the state and restore with strict=False.") from e


class _Captured(dict):  # type: ignore[type-arg]
    """The top of a state dict :class:`StatefulAdapter` captured: ``apply`` gets this very
    object back (values merged into it in place) unless the core hands it the checkpoint's
    subtree whole instead."""


def _like_live(tree: Any, live: Any) -> Any:
    """``tree`` with the container types of ``live`` where it has plain ones (a ``dict``
    where ``live`` has a Counter, a ``tuple`` where it has a namedtuple), and each
    ``"5"``-style key turned into the int ``live`` has there."""
    if isinstance(tree, Mapping) and isinstance(live, Mapping):
        items = []
        for k, v in tree.items():
            if type(k) is str and k.isdigit() and k not in live and int(k) in live:
                k = int(k)
            items.append((k, _like_live(v, live[k]) if k in live else v))
        return _like(live if type(tree) is dict else tree, items)
    if isinstance(tree, (list, tuple)) and isinstance(live, (list, tuple)):
        seq = [_like_live(v, live[i]) if i < len(live) else v for i, v in enumerate(tree)]
        same_kind = isinstance(tree, list) == isinstance(live, list)
        plain = type(tree) in (list, tuple)
        if plain and same_kind and (isinstance(live, list) or len(live) == len(seq)):
            return _like(live, seq)
        return _like(tree, seq)
    return tree


