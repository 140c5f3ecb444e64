"""Export of a pitstop checkpoint as an Orbax checkpoint (``export_orbax``), written with
Orbax's own ``CheckpointManager``; the import, and what both share, is
:mod:`pitstop.interop.orbax`."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pitstop.adapters.jax._adapter import IMPL, KEY_DATA
from pitstop.core.arguments import step_arg
from pitstop.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    InvalidArgumentError,
    StepExistsError,
    UnsupportedStateError,
)
from pitstop.core.manager import DirectoryReader
from pitstop.core.tree import join
from pitstop.interop.common import read_step
from pitstop.interop.orbax import (
    DEFAULT_ITEM,
    PathLike,
    _committed_steps,
    _host_device,
    _naming,
    _ocp,
    _orbax_failure,
)

__all__ = ["export_orbax"]


# ----------------------------------------------------------------------------- pitstop -> Orbax
_INT_RANGE = (-(2 ** 63), 2 ** 64)


@functools.cache
def _storable(dtype: np.dtype) -> bool:
    """Whether TensorStore, which writes Orbax's arrays, has a type for ``dtype`` (it has
    none for strings, nor for some ml_dtypes types such as uint4)."""
    import tensorstore as ts

    try:
        ts.dtype(dtype)
    except (TypeError, ValueError):
        return False
    return True


def _is_saved_key(obj: Any) -> bool:
    """A typed PRNG key as the JAX adapter saves it (and ``load()`` gives it back)."""
    return (isinstance(obj, Mapping) and set(obj) == {KEY_DATA, IMPL}
            and isinstance(obj[IMPL], str) and isinstance(obj[KEY_DATA], np.ndarray)
            and obj[KEY_DATA].dtype == np.uint32)


#: why a tuple of a JAX state is refused by an export without ``target=``
_TUPLE_REFUSAL = (
    "state entry {where!r}: a tuple in a state JAX saved, stored by pitstop by position. It "
    "may be a namedtuple (an Optax state), whose fields Orbax keys by name: written as a "
    "list, Orbax's StandardRestore into your abstract state would later fail with "
    "'Structure mismatch'. Pass target= (the live state, or jax.eval_shape of it) to write "
    "it as Orbax writes that state; or tuples_as_lists=True if every tuple here is a plain "
    "one (Orbax gives those back as lists)")


def _to_orbax(obj: Any, path: str = "", tuples: bool = True) -> Any:
    """A pitstop tree as ``StandardSave`` stores it: arrays, Python int/float/bool, None and
    containers; dict keys as strings; typed PRNG keys (as the JAX adapter saves them) as
    typed keys. Anything else is refused naming its key, and so is a tuple unless
    ``tuples`` (it may have been a namedtuple, see :data:`_TUPLE_REFUSAL`)."""
    where = path or "<root>"
    if isinstance(obj, np.generic):
        obj = np.asarray(obj)
    if isinstance(obj, np.ndarray):
        if obj.dtype.names is not None or obj.dtype.subdtype is not None:
            raise UnsupportedStateError(
                f"state entry {where!r}: Orbax cannot store structured arrays (dtype "
                f"{obj.dtype}); export another entry with key=, or split it into arrays")
        if obj.dtype.kind in "OUSMm" or not _storable(obj.dtype):
            raise UnsupportedStateError(
                f"state entry {where!r}: Orbax cannot store arrays of dtype {obj.dtype} "
                "(its TensorStore has no such type); export another entry with key=, or "
                "convert it first")
        if obj.size == 0 and obj.ndim > 0:
            raise UnsupportedStateError(
                f"state entry {where!r}: an empty array (shape {list(obj.shape)}), which "
                "Orbax's StandardSave refuses to store (zero size); export the part of the "
                "state without it (key=...), or drop it first")
        return obj
    if obj is None or isinstance(obj, (bool, float)):
        return obj
    if isinstance(obj, int):
        if not _INT_RANGE[0] <= obj < _INT_RANGE[1]:
            raise UnsupportedStateError(
                f"state entry {where!r}: the int {obj} does not fit in 64 bits, the widest "
                "scalar Orbax stores; export another entry with key=, or store it as an array")
        return obj
    if _is_saved_key(obj):
        try:
            with jax.default_device(_host_device()):
                return jax.random.wrap_key_data(obj[KEY_DATA], impl=obj[IMPL])
        except Exception as e:  # noqa: BLE001 - unknown implementation, wrong shape, ...
            raise UnsupportedStateError(
                f"state entry {where!r}: a PRNG key of implementation {obj[IMPL]!r} with key "
                f"data of shape {obj[KEY_DATA].shape} cannot be made into a typed key here "
                f"({type(e).__name__}: {e})") from e
    if isinstance(obj, Mapping):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise UnsupportedStateError(
                    f"state entry {where!r}: key {k!r} of type {type(k).__name__} cannot be "
                    "stored by Orbax, which keeps str keys (int keys become strings)")
            text = str(k)
            if text in out:
                raise UnsupportedStateError(
                    f"state entry {where!r}: keys {text!r} and {k!r} would both be {text!r} in "
                    "Orbax, which stores every key as a string")
            out[text] = _to_orbax(v, join(path, k), tuples)
        return out
    if isinstance(obj, list):
        return [_to_orbax(v, join(path, i), tuples) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        if not tuples:
            raise UnsupportedStateError(_TUPLE_REFUSAL.format(where=where))
        return tuple(_to_orbax(v, join(path, i), tuples) for i, v in enumerate(obj))
    if isinstance(obj, (str, bytes)):
        raise UnsupportedStateError(
            f"state entry {where!r}: Orbax's StandardSave cannot store a {type(obj).__name__} "
            "value; export the part of the state without it (key=...), or drop it first")
    raise UnsupportedStateError(
        f"state entry {where!r}: a {type(obj).__name__} cannot be exported to Orbax")


def _jax_saved(pitstop_dir: PathLike, step: int) -> bool:
    """Whether JAX's adapter captured (part of) the state of ``step``: its tuples may then
    be namedtuples (an older pitstop that recorded no frameworks counts as JAX too)."""
    mgr = DirectoryReader(pitstop_dir)
    try:
        frameworks = mgr.metadata(step).writer.get("frameworks")
    finally:
        mgr.close()
    return not isinstance(frameworks, dict) or "jax" in frameworks


def export_orbax(pitstop_dir: PathLike, step: int | None, orbax_dir: PathLike, *,
                 key: str | None = None, target: Any = None,
                 tuples_as_lists: bool = False) -> str:
    """Write pitstop checkpoint ``step`` (None: the newest) as step ``step`` of an Orbax
    ``CheckpointManager`` directory ``orbax_dir``, with Orbax's own writer
    (``CheckpointManager.save(step, args=StandardSave(tree))``, the single default item).

    ``ocp.CheckpointManager(orbax_dir).restore(step, args=ocp.args.StandardRestore(target))``
    restores it, and so does ``ocp.StandardCheckpointer().restore(path)`` with the returned
    path (the item directory). Arrays are stored as numpy arrays (restored as numpy arrays
    unless the target asks for ``jax.Array``s), bit for bit with their dtype; numpy scalars
    as 0-d arrays; Python ints (64-bit), floats and bools as Orbax scalars; ``None`` and empty
    containers as Orbax's empty nodes; tuples as sequences (Orbax gives them back as lists
    without a target). Dict keys become strings. A typed PRNG key that pitstop's JAX adapter
    saved (``{"key_data": ..., "impl": ...}`` in ``load()``) is written as a typed key, so
    Orbax restores a ``jax.random.key`` of the same implementation. Values ``StandardSave``
    cannot store (strings, bytes, ints beyond 64 bits, string arrays) raise
    :class:`pitstop.UnsupportedStateError` naming the key: ``key=`` exports one entry only
    (``key="params"``).

    pitstop stores a namedtuple's or dataclass's children by position, where Orbax keys them
    by field name: for a state holding Optax states or Flax dataclasses, pass ``target=``
    (the live state, or an abstract one of ``jax.ShapeDtypeStruct``). The checkpoint is then
    loaded into that structure (``load(target=...)``) and written as Orbax would write that
    state itself, so ``StandardRestore`` into the same abstract state restores it.

    Without ``target=``, a checkpoint that JAX's adapter captured (``writer["frameworks"]``
    names jax) and that holds a tuple is refused, naming the entry: pitstop cannot tell a
    namedtuple (an Optax state, which Orbax keys by field name) from a plain tuple there,
    and a guess would make Orbax's ``StandardRestore`` fail later with "Structure mismatch".
    Pass ``target=``, or ``tuples_as_lists=True`` when every tuple is a plain one. An empty
    array (zero size), which Orbax cannot store, is refused too.

    Raises :class:`pitstop.StepExistsError` when ``orbax_dir`` already has that step and
    :class:`pitstop.CheckpointWriteError` when Orbax fails to write it.
    """
    ocp = _ocp()
    if target is not None:
        if key is not None:
            raise InvalidArgumentError(
                "export_orbax: pass key= or target=, not both (target= describes the whole "
                "saved state)")
        reader = DirectoryReader(pitstop_dir)
        try:
            step = None if step is None else step_arg(step)
            if step is None:
                step = reader.latest_step()
                if step is None:
                    raise CheckpointNotFoundError(f"no checkpoint in {reader.directory} to export")
            tree = reader.load(step, target=target)
        finally:
            reader.close()
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            if isinstance(leaf, jax.Array | np.ndarray) and leaf.size == 0 and leaf.ndim:
                _to_orbax(np.zeros(leaf.shape, np.float32), "/".join(
                    str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                    for k in path))  # refused, named as in the state
    else:
        step, tree = read_step(pitstop_dir, None if step is None else step_arg(step), key)
        tree = _to_orbax(tree, key or "", tuples_as_lists or not _jax_saved(pitstop_dir, step))

    root = Path(os.path.abspath(os.fspath(orbax_dir)))
    try:
        is_checkpoint = root.is_dir() and ocp.path.format_utils.is_orbax_checkpoint(root)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(_orbax_failure(f"cannot inspect {root}", e)) from e
    if is_checkpoint:
        raise InvalidArgumentError(
            f"{root} is itself an Orbax checkpoint; export into the directory that holds "
            "the step directories (a CheckpointManager's directory), or a new one")
    where = f"Orbax checkpoint of step {step} in {root}"
    if root.is_dir() and step in _committed_steps(ocp, root, _naming(None)):
        raise StepExistsError(
            f"{root} already has an Orbax checkpoint of step {step}; export into another "
            "directory or delete that step first")
    try:
        mgr = ocp.CheckpointManager(os.fspath(root), options=ocp.CheckpointManagerOptions(
            create=True, enable_async_checkpointing=False))
        try:
            # force: Orbax's save policies would skip a step older than its newest one
            mgr.save(step, args=ocp.args.StandardSave(tree), force=True)
            mgr.wait_until_finished()
        finally:
            mgr.close()
        name_format = ocp.path.step.standard_name_format()
        item = ocp.path.step.find_step_path(root, name_format, step=step) / DEFAULT_ITEM
    except Exception as e:  # noqa: BLE001 - Orbax, tensorstore and jax raise many kinds
        raise CheckpointWriteError(_orbax_failure(f"cannot write the {where}", e),
                                   step=step, path=os.fspath(root)) from e
    if not item.is_dir():
        raise CheckpointWriteError(
            f"Orbax reported the {where} written, but {item} does not exist",
            step=step, path=os.fspath(root))
    return os.fspath(item)
