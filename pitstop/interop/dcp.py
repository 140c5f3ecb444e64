"""Migration into pitstop from ``torch.distributed.checkpoint`` (DCP) directories.

``import_dcp`` reads every rank's shards in one process and saves the state as one
committed pitstop checkpoint. DCP's ``.metadata`` file is a pickle: it is read with a
restricted unpickler (:class:`_DCPMetadataUnpickler`, allowing
:data:`DCP_METADATA_GLOBALS` only) and checked before anything is allocated from it.
Tensors and keys are converted as for ``torch.save`` files (:mod:`pitstop.interop.torch_save`).
"""

from __future__ import annotations

import io
import os
import pickle
import reprlib
import stat
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pitstop.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedStateError,
)
from pitstop.core.tree import select
from pitstop.interop.common import PathLike, refuse_existing, write_import
from pitstop.interop.torch_save import _reason, _torch_to_numpy_tree, _unwrap_module_keys

__all__ = ["import_dcp", "read_dcp_metadata", "DCP_METADATA_GLOBALS"]


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
    key_of_directory = refuse_existing(directory, step)
    tree = _dcp_keys(_load_dcp(dcp_dir))
    source = os.fspath(dcp_dir)
    state = _torch_to_numpy_tree(_unwrap_module_keys(
        select(tree, key, source), strip_prefixes, f"import_dcp({source!r})", key))
    return write_import(state, directory, step, metrics, key_of_directory)


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
