"""Migration into and out of pitstop for PyTorch users.

``import_torch_save`` and ``import_dcp`` turn a ``torch.save`` file or a
``torch.distributed.checkpoint`` (DCP) directory into one committed pitstop checkpoint;
``export_torch_save`` and ``export_safetensors`` write a pitstop checkpoint back out.

These are explicit, one-off migration helpers. The two imports are the only places where
pitstop reads a pickle-based format (see each function for what it unpickles and why);
pitstop's own load path never unpickles anything.

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

import io
import json
import logging
import os
import pickle
import re
import reprlib
import stat
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from pitstop.adapters._convert import atomic_write, read_step
from pitstop.adapters.torch._adapter import clean_key
from pitstop.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StepExistsError,
    UnsupportedStateError,
)
from pitstop.core.format.dtypes import ML_DTYPES
from pitstop.core.manager import CheckpointManager
from pitstop.core.tree import SCALAR_TYPES, encode_value, flatten, join, select, split

log = logging.getLogger("pitstop")

__all__ = ["import_torch_save", "import_dcp", "export_torch_save", "export_safetensors"]

PathLike = str | os.PathLike[str]

# ----------------------------------------------------------------------------- dtypes
#: torch dtypes numpy has no type for: the same-width int to view the bits through, and
#: the ml_dtypes type that holds them (looked up by name, so missing ones drop out)
_BIT_VIEWS: dict[torch.dtype, tuple[torch.dtype, np.dtype]] = {}
for _name, _int in [("bfloat16", torch.int16), ("float8_e4m3fn", torch.uint8),
                    ("float8_e5m2", torch.uint8), ("float8_e4m3fnuz", torch.uint8),
                    ("float8_e5m2fnuz", torch.uint8), ("float8_e8m0fnu", torch.uint8)]:
    _tdt = getattr(torch, _name, None)
    if _tdt is not None and _name in ML_DTYPES:
        _BIT_VIEWS[_tdt] = (_int, ML_DTYPES[_name])
_BY_NUMPY: dict[np.dtype, torch.dtype] = {np_dt: t for t, (_i, np_dt) in _BIT_VIEWS.items()}

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
    view = _BIT_VIEWS.get(t.dtype)
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
    tdt = _BY_NUMPY.get(a.dtype)
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


# ----------------------------------------------------------------------------- pitstop side
def _write(state: Any, directory: PathLike, step: int,
           metrics: Mapping[str, Any] | None, encryption: Any = None) -> int:
    """Save ``state`` (numpy + values) as committed step ``step``; returns the step.
    ``encryption``: the key of an encrypted directory (:func:`_refuse_existing` finds it)."""
    # not ``with CheckpointManager(...)``: its __exit__ reports an exception as one "during
    # training", which an import is not
    mgr = CheckpointManager(directory, async_save=False, save_on_signals=None,
                            memory_tier=False, encryption=encryption)
    try:
        mgr.save(step, state, metrics).wait()
    finally:
        mgr.close()
    return step


def _refuse_existing(directory: PathLike, step: int) -> Any:
    """Raise StepExistsError before reading a (possibly large) file to import; returns the
    key of an encrypted directory (from PITSTOP_ENCRYPTION_KEY, as a reader takes it; None
    for a plaintext one), so the import is encrypted like the directory's checkpoints."""
    mgr = CheckpointManager(directory, read_only=True, save_on_signals=None)
    try:
        exists = step in mgr.all_steps()
        where = mgr.directory
        key = mgr.encryption
    finally:
        mgr.close()
    if exists:
        raise StepExistsError(
            f"{where} already has a checkpoint of step {step}; pitstop never overwrites one. "
            "Import under another step (step=...) or into another directory, or delete that "
            "checkpoint first.")
    return key


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
    key_of_directory = _refuse_existing(directory, step)
    source = os.fspath(path)
    # weights_only=True: torch's own restricted unpickler (torch._weights_only_unpickler),
    # kept rather than a pitstop one because torch.save files rebuild tensors through
    # storage/rebuild helpers only torch knows to allow, and torch maintains that allow-list
    # with the format. It rebuilds tensors and plain containers/values only and refuses any
    # other global, so a hostile file cannot run code (tests/adapters/torch/test_malicious_imports.py).
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
    return _write(state, directory, step, metrics, key_of_directory)


# ----------------------------------------------------------------------------- DCP metadata
#: every global a DCP ``.metadata`` pickle names (torch 2.x): DCP's own metadata dataclasses,
#: the storage info of its file system writer, ``torch.Size``, torch dtypes (any attribute of
#: ``torch`` that is a ``torch.dtype``, checked below), the layout helper torch pickles
#: layouts through, and the path classes a ``checkpoint_id`` may be. Each only builds data:
#: none runs a command, imports a module or reads a file.
DCP_METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
})


class _Refused(pickle.UnpicklingError):
    """A global or persistent id the restricted unpickler does not allow."""


class _DCPMetadataUnpickler(pickle.Unpickler):
    """Reads a DCP ``.metadata`` pickle, refusing every global not in
    :data:`DCP_METADATA_GLOBALS` (or a torch dtype), so a hostile file cannot run code.

    It subclasses the C unpickler bound when this module was imported: code that later
    replaces ``pickle.load`` (tests/test_no_pickle.py traps it) does not reach it, and it
    never calls ``pickle.load`` itself."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(
            f"global {module}.{name} is not one a DCP .metadata file holds (allowed: DCP's "
            "metadata classes, torch.Size, torch dtypes)")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("persistent ids are not part of a DCP .metadata file")


def read_dcp_metadata(data: bytes, where: str) -> Any:
    """The DCP ``Metadata`` pickled in ``data`` (the bytes of ``where``), read with the
    restricted unpickler; anything else raises :class:`pitstop.UnsupportedStateError`."""
    from torch.distributed.checkpoint.metadata import Metadata
    try:
        md = _DCPMetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as e:
        raise UnsupportedStateError(
            f"{where}: refused to read this DCP metadata file: {e}. pitstop reads DCP "
            "metadata with a restricted unpickler and never runs code from it; if the "
            "directory really was written by torch.distributed.checkpoint, load it with DCP "
            "in a trusted environment and import a torch.save of its state dict instead.") from e
    except Exception as e:  # noqa: BLE001 - truncated/garbled pickles raise anything
        raise CorruptCheckpointError(
            f"{where}: cannot read this DCP metadata file ({type(e).__name__}: {e}); is the "
            "DCP checkpoint complete?", checkpoint=where) from e
    if not isinstance(md, Metadata):
        raise UnsupportedStateError(
            f"{where}: holds a {type(md).__name__}, not DCP checkpoint metadata")
    return md


def _load_dcp(dcp_dir: PathLike) -> dict[str, Any]:
    """The whole DCP checkpoint as a nested dict of CPU tensors and values (public DCP API;
    imported here so that a torch built without torch.distributed still imports this module)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import (
        BytesStorageMetadata,
        DefaultLoadPlanner,
        FileSystemReader,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import StorageMeta

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        """DCP's default planner, but non-tensor entries load with weights_only=True."""

        def load_bytes(self, read_item: Any, value: Any) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except Exception as e:
                raise UnsupportedStateError(
                    f"DCP entry {fqn!r}: torch.load(weights_only=True) refused it: "
                    f"{_reason(e)}") from e
            if self.flatten_state_dict:
                _set_path(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    class RestrictedReader(FileSystemReader):
        """DCP's file system reader, but ``.metadata`` is read by the restricted unpickler
        (FileSystemReader.read_metadata calls plain ``pickle.load``: it could run code)."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = os.fspath(self._get_metadata_path(kwargs.get("rank")))
            # O_NONBLOCK: a FIFO in its place is refused at once, never blocks the import
            with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC),
                           "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise CorruptCheckpointError(f"{path}: not a regular file",
                                                 checkpoint=path)
                md = read_dcp_metadata(f.read(), path)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    source = os.fspath(dcp_dir)
    reader = RestrictedReader(source)
    try:
        metadata = reader.read_metadata()
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(
            f"{source}: no DCP checkpoint there (no .metadata file)") from e
    except OSError as e:
        raise CorruptCheckpointError(f"{source}: cannot read its .metadata ({e})",
                                     checkpoint=source) from e
    planner_data = _check_dcp_metadata(metadata, os.path.join(source, ".metadata"))
    target: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        where = tuple(planner_data.get(fqn, (fqn,)))
        if isinstance(md, TensorStorageMetadata):
            try:
                empty = torch.empty(md.size, dtype=md.properties.dtype)
            except (RuntimeError, MemoryError) as e:
                raise CorruptCheckpointError(
                    f"{source}: DCP entry {fqn!r} of shape {list(md.size)[:8]} cannot be "
                    f"allocated ({_reason(e)})", checkpoint=source) from e
            _set_path(target, where, empty)
        elif isinstance(md, BytesStorageMetadata):
            _set_path(target, where, None)  # filled by load_bytes
        else:
            raise UnsupportedStateError(f"DCP entry {fqn!r}: unknown kind {type(md).__name__}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        # no_dist=True: read every shard in this one process, no process group needed
        try:
            dcp.load(target, storage_reader=reader, planner=WeightsOnlyLoadPlanner(),
                     no_dist=True)
        except CheckpointException as e:  # DCP wraps each rank's error (a BaseException)
            cause = next(iter(e.failures.values()))[0] if e.failures else e
            if isinstance(cause, CheckpointError):  # our refusal, as it was raised
                raise cause from cause.__cause__  # what torch refused, not DCP's wrapper
            raise CorruptCheckpointError(
                f"{source}: DCP cannot read this checkpoint ({type(cause).__name__}: "
                f"{cause}); are all its .distcp files there and complete?",
                checkpoint=source) from cause
    return target


#: the most list elements the paths of a DCP ``.metadata``'s ``planner_data`` may make
#: ``_set_path`` allocate (all lists together): a real state dict's lists (param_groups,
#: per-layer lists) are far shorter; a hostile index of 10**11 must not allocate 800 GB
MAX_DCP_LIST_ELEMENTS = 1 << 24


def _check_dcp_metadata(md: Any, where: str) -> dict[str, tuple[Any, ...]]:
    """Check what the restricted unpickler built before anything is allocated from it: the
    classes allow any attribute values (a hostile or garbled file sets a size of 10**15, a
    string for a shape, a list index of 10**11 in ``planner_data``). Returns the checked
    ``planner_data``; raises :class:`CorruptCheckpointError` naming the entry."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from pitstop.core.format.schema import MAX_BYTES, MAX_ELEMENTS, MAX_NDIM

    def _short(x: Any) -> str:
        return reprlib.repr(x)  # depth- and length-limited: a nested value never recurses

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: not DCP metadata pitstop can read: {what}",
                                      checkpoint=where)

    entries = getattr(md, "state_dict_metadata", None)
    if not isinstance(entries, dict):
        raise bad(f"its state_dict_metadata is a {type(entries).__name__}, not a dict")
    for fqn, entry in entries.items():
        if not isinstance(fqn, str):
            raise bad(f"entry key {_short(fqn)} is not a string")
        if isinstance(entry, BytesStorageMetadata):
            continue
        if not isinstance(entry, TensorStorageMetadata):
            continue  # (refused by name where it is used: an unknown kind)
        props, size = getattr(entry, "properties", None), getattr(entry, "size", None)
        if not isinstance(props, TensorProperties) or \
                not isinstance(getattr(props, "dtype", None), torch.dtype):
            raise bad(f"entry {_short(fqn)} has no tensor dtype")
        if not isinstance(size, tuple) or len(size) > MAX_NDIM or \
                not all(type(n) is int and 0 <= n <= MAX_ELEMENTS for n in size):
            raise bad(f"entry {_short(fqn)} has shape {_short(size)}, not a list of sizes")
        numel = 1
        for n in size:
            numel *= n
        if numel > MAX_ELEMENTS or numel * props.dtype.itemsize > MAX_BYTES:
            raise bad(f"entry {_short(fqn)} declares {numel} elements, more than any checkpoint")
    storage = getattr(md, "storage_data", None)
    if not isinstance(storage, dict):
        raise bad(f"its storage_data is a {type(storage).__name__}, not a dict")
    checked: set[str] = set()
    for index, info in storage.items():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not rel or os.path.isabs(rel) or \
                ".." in rel.replace("\\", "/").split("/"):
            # DCP joins it to the checkpoint's directory: an absolute path or a '..' would
            # import data from any file the importing user can read (another checkpoint of
            # theirs), or read /dev/zero for as long as the entry's length says
            raise bad(f"entry {_short(getattr(index, 'fqn', index))} is stored in "
                      f"{_short(rel)}, not a file inside the checkpoint's directory")
        if not all(type(getattr(info, a, None)) is int and getattr(info, a) >= 0
                   for a in ("offset", "length")):
            raise bad(f"entry {_short(getattr(index, 'fqn', index))} has no byte range in "
                      f"{_short(rel)}")
        if rel not in checked:
            target = os.path.join(os.path.dirname(where), rel)
            try:
                regular = stat.S_ISREG(os.stat(target).st_mode)
            except OSError:
                regular = True  # missing: DCP says so, as for any incomplete checkpoint
            if not regular:  # a FIFO would block the import forever, a device never end
                raise bad(f"{_short(rel)} is not a regular file")
            checked.add(rel)
    planner = getattr(md, "planner_data", None) or {}
    if not isinstance(planner, dict):
        raise bad(f"its planner_data is a {type(planner).__name__}, not a dict")
    out: dict[str, tuple[Any, ...]] = {}
    longest: dict[tuple[Any, ...], int] = {}
    for fqn, path in planner.items():
        if not isinstance(path, (tuple, list)) or not path or not all(
                type(k) is str or (type(k) is int and k >= 0) for k in path):
            raise bad(f"planner_data of {_short(fqn)} is {_short(path)}, not a key "
                      "path (strings and list indices)")
        for i, k in enumerate(path):
            if type(k) is int:
                longest[tuple(path[:i])] = max(longest.get(tuple(path[:i]), 0), k + 1)
        if sum(longest.values()) > MAX_DCP_LIST_ELEMENTS:
            raise bad(f"planner_data of {_short(fqn)} makes lists longer than any state "
                      f"dict holds (index {max(k for k in path if type(k) is int)})")
        out[fqn] = tuple(path)
    return out


def _set_path(root: Any, path: tuple[Any, ...], value: Any) -> None:
    """Set ``root[p0][p1]...`` = value, creating dicts (str keys) and lists (int keys)."""
    node = root
    for k, nxt in zip(path[:-1], path[1:], strict=True):
        fresh: Any = [] if isinstance(nxt, int) else {}
        if isinstance(node, list):
            node.extend([None] * (k + 1 - len(node)))
            if node[k] is None:
                node[k] = fresh
        else:
            node.setdefault(k, fresh)
        node = node[k]
    last = path[-1]
    if isinstance(node, list):
        node.extend([None] * (last + 1 - len(node)))
    node[last] = value


def import_dcp(dcp_dir: PathLike, directory: PathLike, step: int, *, key: str | None = None,
               metrics: Mapping[str, Any] | None = None,
               strip_prefixes: Sequence[str] = ("module.",)) -> int:
    """Import a ``torch.distributed.checkpoint`` directory as pitstop checkpoint ``step``.

    Runs in one process without a process group: every rank's shards are read and each
    tensor is assembled whole (``dcp.load(..., no_dist=True)``). DCP stores dict keys as
    strings; the int keys of an optimizer state dict's ``state`` (torch needs them to match
    ``param_groups``) and of ``MultiStepLR`` milestones are given back, other dicts keep
    DCP's string keys (restoring into a live dict that has int keys finds them). DCP does
    not store empty dicts: an optimizer's empty ``state`` (SGD without momentum, any
    optimizer before its first step) is put back, other empty dicts do not come back.
    ``key`` picks one entry; ``strip_prefixes`` is as for :func:`import_torch_save`.

    Trust: DCP's ``.metadata`` file is a pickle, which DCP itself reads with plain
    ``pickle.load`` (it can run code). pitstop reads it with a restricted unpickler that
    builds only DCP's metadata classes, ``torch.Size`` and torch dtypes
    (:data:`DCP_METADATA_GLOBALS`); anything else raises :class:`pitstop.UnsupportedStateError`
    before any of it runs. Tensor entries are read by DCP with ``torch.load(weights_only=True)``,
    non-tensor entries by pitstop with ``torch.load(weights_only=True)`` too (DCP itself
    uses ``weights_only=False`` there).
    """
    key_of_directory = _refuse_existing(directory, step)
    tree = _dcp_keys(_load_dcp(dcp_dir))
    source = os.fspath(dcp_dir)
    state = _torch_to_numpy_tree(_unwrap_module_keys(
        select(tree, key, source), strip_prefixes, f"import_dcp({source!r})", key))
    return _write(state, directory, step, metrics, key_of_directory)


def _dcp_keys(obj: Any) -> Any:
    """Give back what DCP's storage lost, in place: the int keys of optimizer state dicts and
    of ``MultiStepLR`` milestones (DCP stores every key as a string), and the ``state`` of an
    optimizer saved before its first step or without per-parameter state (DCP drops empty
    dicts).

    ``torch.optim.Optimizer.load_state_dict`` matches ``state`` entries to the ints in
    ``param_groups[i]["params"]``; with ``"0"`` it would silently drop the moments. Only a
    dict shaped like an optimizer state dict whose ``state`` keys are exactly such ids as
    digit strings is changed (FQN-keyed state from ``get_state_dict`` is left alone). A
    ``MultiStepLR`` with ``"3"`` as a milestone would never decay the learning rate again.
    """
    if isinstance(obj, dict):
        groups = obj.get("param_groups")
        if isinstance(groups, list) and groups and all(
                isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
            obj.setdefault("state", {})
            state = obj["state"]
            ids = {p for g in groups for p in g["params"]}
            if (isinstance(state, dict) and state and all(isinstance(p, int) for p in ids)
                    and all(isinstance(k, str) and k.isdigit() and int(k) in ids for k in state)):
                obj["state"] = {int(k): v for k, v in state.items()}
        milestones = obj.get("milestones")
        if (isinstance(milestones, dict) and "last_epoch" in obj and "base_lrs" in obj
                and all(isinstance(k, str) and k.isdigit() for k in milestones)):
            obj["milestones"] = {int(k): v for k, v in milestones.items()}
        for v in obj.values():
            _dcp_keys(v)
    elif isinstance(obj, list):
        for v in obj:
            _dcp_keys(v)
    return obj


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
