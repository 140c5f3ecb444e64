"""Migration into and out of pitstop for PyTorch users: ``torch.save`` files and safetensors.

``import_torch_save`` turns a ``torch.save`` file into one committed pitstop checkpoint;
``export_torch_save`` and ``export_safetensors`` write a pitstop checkpoint back out
(``torch.distributed.checkpoint`` directories: :mod:`pitstop.interop.dcp`, which shares the
tensor and key conversions below).

These are explicit, one-off migration helpers. The two imports (this one and DCP's) are
the only places where pitstop reads a pickle-based format (see each function for what it
unpickles and why); pitstop's own load path never unpickles anything.

Tensors become numpy arrays bit for bit: bfloat16 and float8 go through an integer view
into their ml_dtypes counterparts; views and non-contiguous tensors are saved as they
read. Values (epoch, optimizer hyper-parameters, ...) stay Python values. Anything else
raises :class:`pitstop.UnsupportedStateError` naming its key path.

Module state dicts are imported under the keys a live save would give them: the ``module.``
prefix of a DDP / DataParallel model (said in a log warning: ``strip_prefixes=()`` keeps it,
for a model whose submodule is really named ``module``) and the ``_orig_mod.`` components
of a ``torch.compile``d one are dropped, so the checkpoint restores into a plain, a wrapped
or a compiled model alike.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from pitstop.adapters.torch._adapter import clean_key
from pitstop.core.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedStateError,
)
from pitstop.core.format.dtypes import ML_DTYPES
from pitstop.core.tree import SCALAR_TYPES, encode_value, flatten, join, select, split
from pitstop.interop.common import PathLike, atomic_write, read_step, refuse_existing, write_import

log = logging.getLogger("pitstop")

__all__ = ["import_torch_save", "export_torch_save", "export_safetensors"]

# ----------------------------------------------------------------------------- dtypes
#: torch dtypes numpy has no type for: the same-width int to view the bits through, and
#: the ml_dtypes type that holds them (looked up by name, so missing ones drop out)
_BIT_VIEWS: dict[torch.dtype, tuple[torch.dtype, str]] = {}
for _name, _int in [("bfloat16", torch.int16), ("float8_e4m3fn", torch.uint8),
                    ("float8_e5m2", torch.uint8), ("float8_e4m3fnuz", torch.uint8),
                    ("float8_e5m2fnuz", torch.uint8), ("float8_e8m0fnu", torch.uint8)]:
    _tdt = getattr(torch, _name, None)
    if _tdt is not None:
        _BIT_VIEWS[_tdt] = (_int, _name)
_BY_NAME: dict[str, torch.dtype] = {name: t for t, (_i, name) in _BIT_VIEWS.items()}


def _bit_view(tdt: torch.dtype) -> tuple[torch.dtype, np.dtype] | None:
    """(the int dtype to view through, the ml_dtypes dtype) of ``tdt``, else None (ml_dtypes
    is imported at the first such tensor: see core.format.dtypes)."""
    entry = _BIT_VIEWS.get(tdt)
    if entry is None or entry[1] not in ML_DTYPES:
        return None
    return entry[0], ML_DTYPES[entry[1]]

#: dtypes every safetensors release since 0.4 stores (the running one may add more)
_SAFETENSORS_BASE = {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                     torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
                     torch.float8_e4m3fn, torch.float8_e5m2}


def _tensor_to_numpy(t: torch.Tensor, path: str) -> np.ndarray:
    """A numpy array with the same bits (a view where possible; CPU only)."""
    where = path or "<root>"
    if t.layout is not torch.strided:
        raise UnsupportedStateError(
            f"state entry {where!r}: {t.layout} tensors cannot be imported; convert to a dense "
            "tensor (.to_dense()) first")
    if t.is_quantized or t.is_nested or t.is_meta:
        raise UnsupportedStateError(
            f"state entry {where!r}: quantized, nested and meta tensors cannot be imported")
    t = t.detach()
    if type(t) is not torch.Tensor:  # nn.Parameter and other subclasses: the plain data
        t = t.as_subclass(torch.Tensor)
    t = t.cpu().resolve_conj().resolve_neg()
    view = _bit_view(t.dtype)
    try:
        if view is not None:
            int_dt, np_dt = view
            return t.view(int_dt).numpy().view(np_dt)
        return t.numpy()
    except (TypeError, RuntimeError) as e:
        raise UnsupportedStateError(
            f"state entry {where!r}: tensors of dtype {t.dtype} have no numpy equivalent "
            f"pitstop can store ({e})") from None


def _numpy_to_tensor(a: np.ndarray, path: str) -> torch.Tensor:
    """A torch tensor with the same bits (shares memory with a C-contiguous copy of ``a``)."""
    if not (a.flags.c_contiguous and a.flags.writeable):
        a = a.copy(order="C")  # (np.ascontiguousarray would turn a 0-d array into 1-d)
    tdt = _BY_NAME.get(ML_DTYPES.name_of(a.dtype) or "")
    try:
        if tdt is not None:
            int_dt = _BIT_VIEWS[tdt][0]
            ints = a.view(np.int16 if int_dt == torch.int16 else np.uint8)
            return torch.from_numpy(ints).view(tdt)
        return torch.from_numpy(a)
    except TypeError:
        raise UnsupportedStateError(
            f"state entry {path or '<root>'!r}: numpy dtype {a.dtype} has no torch "
            "equivalent; it cannot be exported to a torch format") from None


# ----------------------------------------------------------------------------- trees
def _check_key(k: Any, path: str) -> None:
    if not isinstance(k, (str, int)) or isinstance(k, bool):
        raise UnsupportedStateError(
            f"state entry {path or '<root>'!r}: key {k!r} of type {type(k).__name__} cannot "
            "be saved next to tensors; use str or int keys")


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, (torch.Tensor, np.ndarray, np.generic)):
        return True
    if isinstance(obj, Mapping):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(v) for v in obj)
    return False


def _torch_to_numpy_tree(obj: Any, path: str = "") -> Any:
    """Tensors -> numpy arrays; value subtrees checked to be savable (errors name the key)."""
    if isinstance(obj, torch.Tensor):
        return _tensor_to_numpy(obj, path)
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise UnsupportedStateError(
                f"state entry {path or '<root>'!r}: numpy arrays of Python objects cannot be "
                "saved without pickle")
        return obj
    if isinstance(obj, np.generic):
        return obj
    if not _has_tensor(obj):
        if not isinstance(obj, SCALAR_TYPES):
            encode_value(obj, path)  # raises UnsupportedStateError naming the key
        return obj
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            _check_key(k, path)
            out[k] = _torch_to_numpy_tree(v, join(path, k))
        return out
    if isinstance(obj, tuple) and type(obj) is not tuple:  # namedtuple, torch.Size, ...
        obj = tuple(obj)
    items = [_torch_to_numpy_tree(v, join(path, i)) for i, v in enumerate(obj)]
    return tuple(items) if isinstance(obj, tuple) else items


def _numpy_to_torch_tree(obj: Any, path: str = "") -> Any:
    if isinstance(obj, (np.ndarray, np.generic)):
        return _numpy_to_tensor(np.asarray(obj), path)
    if isinstance(obj, Mapping):
        return {k: _numpy_to_torch_tree(v, join(path, k)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_numpy_to_torch_tree(v, join(path, i)) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(_numpy_to_torch_tree(v, join(path, i)) for i, v in enumerate(obj))
    return obj


# ----------------------------------------------------------------------------- module keys
def _is_module_state_dict(obj: Any) -> bool:
    """A flat ``{"layer.weight": tensor, ...}`` (``_extra_state`` entries may hold anything)."""
    return (isinstance(obj, Mapping) and bool(obj)
            and all(isinstance(k, str) for k in obj)
            and all(isinstance(v, torch.Tensor) or k.endswith("_extra_state")
                    for k, v in obj.items())
            and any(isinstance(v, torch.Tensor) for v in obj.values()))


def _unwrapped_keys(keys: list[str], strip: Sequence[str]) -> tuple[list[str], str]:
    """What a live save of the unwrapped module calls these keys: ``_orig_mod`` components
    dropped (torch.compile; no real submodule has that name), then each prefix of ``strip``
    that every key has (``"module."``: DDP / DataParallel, also nested), as
    ``consume_prefix_in_state_dict_if_present(sd, "module.")`` would. Also returns the
    prefix taken off (``""`` for none)."""
    keys = [clean_key(k) for k in keys]
    taken = ""
    again = True
    while again and keys:
        again = False
        for prefix in strip:
            if prefix and all(k.startswith(prefix) for k in keys):
                keys = [k[len(prefix):] for k in keys]
                taken += prefix
                again = True
    return keys, taken


def _clean_module_keys(obj: Any, strip: Sequence[str], path: str = "",
                       stripped: list[tuple[str, str, str, str, int]] | None = None) -> Any:
    """Every module state dict in ``obj`` under the keys a live save would use (unless two
    keys would become one: then it stays as saved). Each prefix taken off is recorded in
    ``stripped`` as ``(path, prefix, an old key, its new key, number of keys)``."""
    if _is_module_state_dict(obj):
        keys, taken = _unwrapped_keys(list(obj), strip)
        if keys == list(obj) or len(set(keys)) != len(keys):
            return obj
        if taken and stripped is not None:
            stripped.append((path, taken, next(iter(obj)), keys[0], len(keys)))
        return dict(zip(keys, obj.values(), strict=True))
    if isinstance(obj, Mapping):
        return {k: _clean_module_keys(v, strip, join(path, k), stripped) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean_module_keys(v, strip, join(path, i), stripped) for i, v in enumerate(obj)]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(_clean_module_keys(v, strip, join(path, i), stripped)
                     for i, v in enumerate(obj))
    return obj


def _unwrap_module_keys(obj: Any, strip: Sequence[str] | str, what: str, key: str | None
                        ) -> Any:
    """:func:`_clean_module_keys`, saying (a log warning) what prefix it took off where: a
    ``module.`` prefix may belong to a real submodule named ``module``."""
    if isinstance(strip, str):
        strip = (strip,)
    stripped: list[tuple[str, str, str, str, int]] = []
    out = _clean_module_keys(obj, tuple(strip), key or "", stripped)
    for path, prefix, old, new, n in stripped:
        log.warning(
            "pitstop: %s: every key of the module state dict at %s starts with %r, as a DDP / "
            "DataParallel model saves them, so its %d keys were imported without it (%r -> "
            "%r), the keys a live save of the unwrapped model writes. If %r is a submodule of "
            "your model rather than a wrapper, import again with strip_prefixes=() to keep "
            "the keys as saved.", what, repr(path) if path else "the root", prefix, n, old,
            new, prefix.split(".")[0])
    return out


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_ALLOWLIST_ADVICE = re.compile(r"\s*Please use `?torch\.serialization\.add_safe_globals.*$")


def _reason(e: BaseException) -> str:
    """The line of torch's weights_only error that says what was refused, without the
    terminal colour codes torch puts in it."""
    lines = [ln.strip() for ln in _ANSI.sub("", str(e)).splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("WeightsUnpickler error:"):
            # without torch's "Please use torch.serialization.add_safe_globals([...]) ...
            # to allowlist this global": pitstop's import takes no allow-list
            return _ALLOWLIST_ADVICE.sub("", ln[len("WeightsUnpickler error:"):]).strip()
    for ln in lines:  # a global of a module torch blocks outright (os, posix, subprocess...)
        if "GLOBAL" in ln:
            return ln
    return lines[0] if lines else type(e).__name__


# ----------------------------------------------------------------------------- imports
def import_torch_save(path: PathLike, directory: PathLike, step: int, *, key: str | None = None,
                      metrics: Mapping[str, Any] | None = None,
                      strip_prefixes: Sequence[str] = ("module.",)) -> int:
    """Import a ``torch.save`` file as committed pitstop checkpoint ``step`` in ``directory``.

    The file may hold a state dict, a nested dict of them (``{"model": ..., "optimizer":
    ..., "epoch": 3}``), or any tree of tensors and plain values; ``key`` picks one entry
    (a pitstop key path such as ``"state_dict"``). A module state dict saved from a DDP or
    ``torch.compile``d model gets the plain model's keys (as a live save would):
    ``_orig_mod.`` components are dropped, and so is a prefix of ``strip_prefixes`` that
    every key of a module state dict has (``module.``), with a log warning naming it, since a
    model may have a real submodule named ``module``; pass ``strip_prefixes=()`` to keep
    such keys as saved. Returns ``step``. Raises :class:`pitstop.UnsupportedStateError` naming the key of anything it
    cannot convert, :class:`pitstop.StepExistsError` if ``step`` is already committed there
    (before reading the file), and :class:`pitstop.CheckpointNotFoundError` for a missing
    file or ``key``.
    """
    key_of_directory = refuse_existing(directory, step)
    source = os.fspath(path)
    # weights_only=True: torch's own restricted unpickler (torch._weights_only_unpickler),
    # kept rather than a pitstop one because torch.save files rebuild tensors through
    # storage/rebuild helpers only torch knows to allow, and torch maintains that allow-list
    # with the format. It rebuilds tensors and plain containers/values only and refuses any
    # other global, so a hostile file cannot run code (tests/torch/test_malicious_imports.py).
    try:
        obj = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:  # what weights_only raises for a refused object
        raise UnsupportedStateError(
            f"{source}: torch.load(weights_only=True) refused this file: it holds objects "
            f"beyond tensors and plain values ({_reason(e)}). Save plain state dicts "
            "(model.state_dict(), optimizer.state_dict(), numbers) and import that file.") from e
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(f"{source}: no such file to import") from e
    except Exception as e:  # noqa: BLE001 - a garbled or crafted file raises anything
        # (an allowed global called with odd arguments: OrderedDict(5) is a TypeError)
        raise CorruptCheckpointError(
            f"{source}: torch.load cannot read this file ({_reason(e)}); is it a complete "
            "torch.save file?", checkpoint=source) from e
    tree = _unwrap_module_keys(select(obj, key, source), strip_prefixes,
                               f"import_torch_save({source!r})", key)
    state = _torch_to_numpy_tree(tree)
    return write_import(state, directory, step, metrics, key_of_directory)


# ----------------------------------------------------------------------------- exports
def export_torch_save(directory: PathLike, path: PathLike, *, step: int | None = None,
                      key: str | None = None) -> int:
    """Write checkpoint ``step`` (default: the newest) as a ``torch.save`` file.

    The file holds the same nested dict with tensors in place of arrays (bfloat16/float8
    kept bit for bit) and plain values, so ``torch.load(path, weights_only=True)`` reads
    it. ``key`` exports one entry, e.g. ``"model"`` for ``model.load_state_dict``. Arrays
    torch cannot hold (strings, structured dtypes) raise :class:`pitstop.UnsupportedStateError`.
    Returns the exported step.
    """
    step, tree = read_step(directory, step, key)
    obj = _numpy_to_torch_tree(tree)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:  # a file object: torch's writer rejects a dotted temp name
            torch.save(obj, f)

    atomic_write(path, write)
    return step


def export_safetensors(directory: PathLike, path: PathLike, *, step: int | None = None,
                       key: str | None = None) -> int:
    """Write the arrays of checkpoint ``step`` (default: the newest) as a .safetensors file.

    Tensor names are the key path's components joined with ``/``, as they are (no escapes),
    so a torch name such as ``layer.weight`` or a ModuleDict key ``enc/dec`` stays intact
    (``model/layer.weight``, ``optimizer/state/0/exp_avg``). With ``key="model"`` the names are
    the model's own (``layer.weight``, ``enc/dec.weight``), ready for
    ``model.load_state_dict(safetensors.torch.load_file(path))``; safetensors holds tensors
    only, so a module whose ``get_extra_state`` returns a value (not a tensor) has it in the
    metadata instead: load with ``strict=False`` and give it to ``set_extra_state`` yourself
    (``json.loads(metadata["pitstop"])["values"]["_extra_state"]``). Two entries that would get
    the same name (``"a/b"`` and ``"a"`` -> ``"b"``) raise :class:`pitstop.UnsupportedStateError`.
    Values go into the string metadata: ``"pitstop"`` holds JSON ``{"format_version": 1,
    "step": ..., "values": {key path: value}}`` (values in pitstop's manifest encoding; plus
    ``"keys": {tensor name: key path}`` for the names that are not their key path, where a
    key holds a ``/``), and
    ``"format"`` is ``"pt"`` as Hugging Face loaders expect. Dtypes safetensors cannot hold
    raise :class:`pitstop.UnsupportedStateError`. Returns the exported step.
    """
    import safetensors.torch as st

    step, tree = read_step(directory, step, key)
    flat = flatten(tree)
    supported = _SAFETENSORS_BASE | set(getattr(st, "_TYPES", {}).values())
    tensors: dict[str, torch.Tensor] = {}
    paths: dict[str, str] = {}
    for kp, leaf in flat.arrays.items():
        t = _numpy_to_tensor(leaf.array, kp)  # type: ignore[attr-defined]
        if t.dtype not in supported:
            raise UnsupportedStateError(
                f"state entry {kp!r}: safetensors cannot store dtype {t.dtype}; export it "
                "with export_torch_save, or convert it first")
        name = "/".join(split(kp))  # the names the objects themselves use, unescaped
        if name in paths:
            raise UnsupportedStateError(
                f"state entries {paths[name]!r} and {kp!r} would both be named {name!r} in "
                "the safetensors file; export one of them with key=, or use export_torch_save")
        paths[name] = kp
        tensors[name] = t
    values = {k: encode_value(v, k) for k, v in flat.values.items()}
    doc: dict[str, Any] = {"format_version": 1, "step": step, "values": values}
    # the key paths a name does not spell (a "/" inside a key): `pitstop import` reads them
    renamed = {name: kp for name, kp in paths.items() if name != kp}
    if renamed:
        doc["keys"] = renamed
    meta = {"format": "pt", "pitstop": json.dumps(doc, allow_nan=False)}
    atomic_write(path, lambda tmp: st.save_file(tensors, tmp, metadata=meta))
    return step
