"""Migration between Orbax checkpoints and pitstop, for JAX users.

``import_orbax`` turns the committed checkpoints that Orbax wrote in a directory into pitstop
checkpoints (one per Orbax step, same step numbers); ``export_orbax`` writes one pitstop
checkpoint back out as an Orbax checkpoint that Orbax's own ``CheckpointManager`` and
``StandardCheckpointer`` restore (:mod:`pitstop.interop.orbax_export`; this module holds the
import and what both share).

These are explicit, one-off migration helpers, run in one process. They read and write
through Orbax's own API (``orbax-checkpoint`` must be installed), so the layouts are exactly
Orbax's and what Orbax counts as committed is what is imported: a save that crashed before
Orbax finalized it (a ``<step>.orbax-checkpoint-tmp`` directory) is skipped.

What an import gives:

- Arrays come back as host numpy arrays with their dtype kept bit for bit (bfloat16, float8
  and int4 as ml_dtypes types). An array saved sharded over several devices comes back as
  one global array; no device, mesh or sharding is needed to read it, so a checkpoint of an
  8-device run imports on a laptop.
- A typed PRNG key (``jax.random.key``, any implementation) is imported as a typed key and
  saved by pitstop's JAX adapter (``load()`` shows it as ``{"key_data": <uint32 array>,
  "impl": "threefry2x32"}``), so ``mgr.restore(state)`` puts it back into the key of a live
  state. Orbax says which arrays are keys only when it restores a jax.Array, so uint32
  arrays that were saved from a jax.Array are read onto one host CPU device (the others
  never touch a device). A raw ``jax.random.PRNGKey`` stays a uint32 array.
- The tree keeps the structure Orbax's metadata gives: dicts with string keys (Orbax stores
  every key as text, so an int key ``0`` comes back as ``"0"``), lists for lists *and*
  tuples (Orbax does not record which), dicts for namedtuples and dataclass nodes (an optax
  ``ScaleByAdamState`` becomes ``{"count", "mu", "nu"}``), ``None`` for ``None`` and for empty
  nodes such as ``optax.EmptyState()``. That is not the structure a live pitstop save of
  the same state has, so such a checkpoint does not restore into a live optax or Flax
  state. Pass ``target=`` (the live state, or an abstract one of ``jax.ShapeDtypeStruct``),
  as Orbax's own restore needs: Orbax then rebuilds the target's structure (namedtuples,
  tuples, Flax ``TrainState``) and the import saves what a live save would.
- Python ``int`` / ``float`` / ``bool`` leaves stay Python scalars, numpy scalars and 0-d
  arrays come back as 0-d arrays, strings (``PyTreeSave`` only) as strings.
- A ``CheckpointManager`` step with the single default item (``args=StandardSave(tree)``) is
  imported as ``tree``; a step of several items (``args=Composite(state=..., extra=...)``) as
  ``{"state": ..., "extra": ...}``. ``StandardSave`` / ``PyTreeSave`` items are trees as
  above, ``JsonSave`` items their JSON value. Other kinds of items (``ArraySave``, the random
  key and proto handlers, custom handlers) are refused by name; ``items=`` leaves them out.
- The metrics Orbax's CheckpointManager saved with a step (it does when it has a
  ``best_fn``) become the pitstop checkpoint's metrics, those that are numbers, strings,
  bools or None (so ``keep_best`` can rank the imported steps).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pitstop.adapters.jax._adapter import is_typed_key
from pitstop.core.arguments import step_arg
from pitstop.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    IncompatibleTargetError,
    InvalidArgumentError,
    StepExistsError,
    UnsupportedStateError,
)
from pitstop.core.manager import CheckpointManager

__all__ = ["import_orbax"]

PathLike = str | os.PathLike[str]

#: Orbax's name of the item a single-item ``CheckpointManager`` save writes
DEFAULT_ITEM = "default"
#: the item in which Orbax's CheckpointManager keeps a step's metrics (with a best_fn)
METRICS_ITEM = "metrics"
#: handlers whose items are pytrees of arrays and scalars (the same on-disk format)
_PYTREE_HANDLERS = ("StandardCheckpointHandler", "PyTreeCheckpointHandler")
_JSON_HANDLERS = ("JsonCheckpointHandler",)
#: pitstop manager options an import must not take: retention would delete imported steps
_REFUSED_OPTIONS = ("keep_last", "keep_every_steps", "keep_best", "retention", "read_only")
#: options every import writer uses: synchronous, no signal handlers, no memory tier
_WRITER_OPTIONS = {"async_save": False, "save_on_signals": None, "memory_tier": False}


def _ocp() -> Any:
    """``orbax.checkpoint``, imported on first use (importing pitstop's JAX adapter does not
    pull in Orbax)."""
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise CheckpointError(
            "importing or exporting Orbax checkpoints needs the orbax-checkpoint package "
            f"(pip install 'pitstop[jax]'); it could not be imported: {e}") from e
    return ocp


def _orbax_failure(what: str, e: BaseException) -> str:
    return f"{what}: Orbax raised {type(e).__name__}: {e}"


# ----------------------------------------------------------------------------- Orbax -> pitstop
def _python_scalar_type(dtype: np.dtype) -> type | None:
    """The Python type Orbax gives a scalar of ``dtype`` back as (None: keep it an array)."""
    return type(np.zeros((), dtype).item()) if dtype.kind in "biuf" else None


def _host_device() -> Any:
    """A device in host memory to read candidate PRNG keys onto: the CPU backend's first
    device (any local device where JAX runs without its CPU backend)."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return jax.local_devices()[0]


def _path_text(path: Any) -> tuple[str, ...]:
    """A JAX key path as Orbax names it: dict keys, sequence indices and attribute names
    (namedtuple fields, dataclass fields) as text."""
    out = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
        else:
            out.append(str(k))
    return tuple(out)


class _LeafArgs:
    """Orbax ``RestoreArgs`` for one saved leaf, from its metadata: arrays as host numpy
    arrays of the saved dtype (no sharding, so no device is needed), scalars as Python
    scalars, strings as strings. uint32 arrays saved from a jax.Array are read as a
    jax.Array on one host device instead: only that path gives a typed PRNG key back as a
    key (Orbax keeps the key's implementation in its own array metadata)."""

    def __init__(self, ocp: Any, where: str) -> None:
        self.ocp, self.where = ocp, where
        self._host: Any = None

    def __call__(self, path: tuple[str, ...], md: Any) -> Any:
        ocp, value = self.ocp, self.ocp.metadata.value
        if isinstance(md, value.StringMetadata):
            return ocp.RestoreArgs(restore_type=str)
        if isinstance(md, value.ScalarMetadata):  # (a subclass of ArrayMetadata: first)
            py = _python_scalar_type(np.dtype(md.dtype))
            if py is not None:
                return ocp.RestoreArgs(restore_type=py)
            return ocp.RestoreArgs(restore_type=np.ndarray, dtype=md.dtype)
        if isinstance(md, value.ArrayMetadata):
            if np.dtype(md.dtype) == np.uint32 and md.sharding is not None:
                if self._host is None:
                    self._host = jax.sharding.SingleDeviceSharding(_host_device())
                return ocp.ArrayRestoreArgs(restore_type=jax.Array, sharding=self._host,
                                            global_shape=tuple(md.shape), dtype=md.dtype)
            return ocp.RestoreArgs(restore_type=np.ndarray, dtype=md.dtype)
        raise UnsupportedStateError(
            f"{self.where}: entry {'/'.join(path)!r} is a {type(md).__name__}, a kind of value "
            "pitstop cannot import from Orbax (it imports arrays, scalars and strings)")


def _pytree_restore(ocp: Any, md_tree: Any, target: Any, where: str) -> Any:
    """``PyTreeRestore`` args for one pytree item: in the saved structure as Orbax's
    metadata gives it, or in the structure of ``target`` (Orbax rebuilds namedtuples,
    tuples and dataclass nodes from it). Either way the dtypes are the saved ones."""
    leaf_args = _LeafArgs(ocp, where)
    if target is None:
        return ocp.args.PyTreeRestore(restore_args=jax.tree_util.tree_map_with_path(
            lambda p, md: leaf_args(_path_text(p), md), md_tree))
    saved = {_path_text(p): md
             for p, md in jax.tree_util.tree_flatten_with_path(md_tree)[0]}
    leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
    paths = [_path_text(p) for p, _leaf in leaves]
    missing = [p for p in paths if p not in saved]
    extra = sorted(set(saved) - set(paths))
    if missing or extra:
        def show(ps: list[tuple[str, ...]]) -> str:
            return ", ".join(repr("/".join(p)) for p in ps[:5]) + (" ..." if len(ps) > 5 else "")
        raise IncompatibleTargetError(
            f"{where} does not match the target's structure"
            + (f"; not in the checkpoint: {show(missing)}" if missing else "")
            + (f"; not in the target: {show(extra)}" if extra else "")
            + ". Pass the state the checkpoint was saved from as target=, or import "
            "without one.", missing=["/".join(p) for p in missing],
            unexpected=["/".join(p) for p in extra])
    args = jax.tree_util.tree_unflatten(treedef, [leaf_args(p, saved[p]) for p in paths])
    return ocp.args.PyTreeRestore(item=target, restore_args=args)


def _tree_of(metadata: Any) -> Any:
    """The plain tree of a ``TreeMetadata`` (older Orbax returns the tree itself)."""
    md = getattr(metadata, "item_metadata", metadata)
    return getattr(md, "tree", md)


def _host_leaf(obj: Any) -> Any:
    """A restored leaf as pitstop stores it: a jax.Array as a numpy array, except a typed
    PRNG key, which pitstop's JAX adapter saves as a key."""
    if isinstance(obj, jax.Array) and not is_typed_key(obj):
        return np.asarray(obj)
    return obj


def _host_tree(obj: Any, target: Any) -> Any:
    """What Orbax restored, as pitstop saves it: numpy arrays, typed keys and plain values,
    in plain dicts and lists (or, with a target, in the target's own structure)."""
    if target is not None:
        return jax.tree.map(_host_leaf, obj)
    if isinstance(obj, Mapping):
        return {k: _host_tree(v, None) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_host_tree(v, None) for v in obj]
    return _host_leaf(obj)


def _handler_kind(name: str | None) -> str:
    """``"pytree"``, ``"json"`` or ``"other"`` for Orbax's recorded handler type name."""
    short = (name or "").rsplit(".", 1)[-1]
    if short in _PYTREE_HANDLERS:
        return "pytree"
    if short in _JSON_HANDLERS:
        return "json"
    return "other"


def _step_items(ocp: Any, step_path: Any) -> tuple[dict[str, str] | None, Any]:
    """What one Orbax step directory holds: ``(None, metadata)`` for a single pytree
    (StandardCheckpointer / PyTreeCheckpointer), or ``({item: kind}, metadata)`` for the items
    of a CheckpointManager step. Read from Orbax's step metadata; checkpoints of an Orbax too
    old to record their handlers are recognised by Orbax's own format check."""
    try:
        md = ocp.metadata.get_step_metadata(step_path)
    except (ValueError, OSError):
        md = None
    handlers = getattr(md, "item_handlers", None)
    if isinstance(handlers, Mapping) and handlers:
        return {str(k): v for k, v in handlers.items()}, md
    if isinstance(handlers, str) or ocp.path.format_utils.is_pytree_checkpoint(step_path):
        return None, md
    found = {p.name: "PyTreeCheckpointHandler" for p in sorted(step_path.iterdir())
             if p.is_dir() and ocp.path.format_utils.is_pytree_checkpoint(p)}
    return (found or {}), md


def _read_step(ocp: Any, step_path: Any, step: int, items: Iterable[str] | None,
               target: Any) -> tuple[Any, dict[str, Any]]:
    """The state and metrics of one committed Orbax step directory."""
    where = f"Orbax checkpoint {step_path} (step {step})"
    try:
        handlers, md = _step_items(ocp, step_path)
        metrics = _metrics(getattr(md, "metrics", None))
        if handlers is None:
            if items is not None:
                raise InvalidArgumentError(
                    f"{where} is a single tree, not a CheckpointManager step with items; "
                    "leave items= out")
            reader = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
            try:
                args = _pytree_restore(ocp, _tree_of(reader.metadata(step_path)), target,
                                       where)
                state = reader.restore(step_path, args=args)
            finally:
                reader.close()
            return _host_tree(state, target), metrics
        state, saved = _read_items(ocp, step_path, handlers, items, target, where)
        metrics = {**metrics, **_metrics(saved)}
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - Orbax, tensorstore and jax raise many kinds
        raise CheckpointError(_orbax_failure(
            f"cannot read {where}; is it a complete Orbax checkpoint this Orbax version "
            "reads?", e)) from e
    return state, metrics


def _read_items(ocp: Any, step_path: Any, handlers: dict[str, str],
                items: Iterable[str] | None, target: Any, where: str) -> tuple[Any, Any]:
    """The items of a CheckpointManager step (the default item alone as its tree, several
    items as ``{name: tree}``) and the metrics the manager saved with it (or None)."""
    names = sorted(n for n in handlers if n != METRICS_ITEM)
    if items is not None:
        wanted = [items] if isinstance(items, str) else list(items)
        missing = [n for n in wanted if n not in handlers]
        if missing:
            raise CheckpointNotFoundError(
                f"{where} has no item {', '.join(map(repr, missing))}; its items are "
                f"{', '.join(map(repr, names)) or 'none'}")
        names = wanted
    if not names:
        raise CheckpointNotFoundError(f"{where} holds no item pitstop can read")
    unwrap = items is None and names == [DEFAULT_ITEM]
    targets = _item_targets(target, names, unwrap, where)
    kinds = {n: _handler_kind(handlers[n]) for n in names}
    other = [n for n in names if kinds[n] == "other"]
    if other:
        raise UnsupportedStateError(
            f"{where}: item {other[0]!r} was written by {handlers[other[0]]}, which pitstop "
            "cannot import (it imports StandardSave / PyTreeSave and JsonSave items). Pass "
            f"items=[...] naming the others ({', '.join(repr(n) for n in names if n not in other)}"
            ") to import without it.")
    handler_of = {n: ocp.PyTreeCheckpointHandler() if kinds[n] == "pytree"
                  else ocp.JsonCheckpointHandler() for n in names}
    with_metrics = METRICS_ITEM in handlers
    if with_metrics:  # the manager's own JSON item, under its own file name
        handler_of[METRICS_ITEM] = ocp.JsonCheckpointHandler(filename=METRICS_ITEM)
    reader = ocp.Checkpointer(ocp.CompositeCheckpointHandler(**handler_of))
    try:
        item_md = reader.metadata(step_path).item_metadata
        args = {}
        for n in names:
            if kinds[n] == "pytree":
                args[n] = _pytree_restore(ocp, _tree_of(item_md[n]), targets.get(n),
                                          f"{where}, item {n!r}")
            else:
                args[n] = ocp.args.JsonRestore()
        if with_metrics:
            args[METRICS_ITEM] = ocp.args.JsonRestore()
        restored = reader.restore(step_path, args=ocp.args.Composite(**args))
    finally:
        reader.close()
    out = {n: _host_tree(restored[n], targets.get(n)) for n in names}
    metrics = restored[METRICS_ITEM] if with_metrics else None
    return (out[DEFAULT_ITEM] if unwrap else out), metrics


def _item_targets(target: Any, names: list[str], unwrap: bool, where: str) -> dict[str, Any]:
    """The target of each item: ``target`` itself for the default item alone, else
    ``target[item]`` (items it does not name are imported as saved)."""
    if target is None:
        return {}
    if unwrap:
        return {DEFAULT_ITEM: target}
    if not isinstance(target, Mapping):
        raise InvalidArgumentError(
            f"{where} holds the items {', '.join(map(repr, names))}; pass target= as a dict "
            "of item name -> that item's state")
    unknown = [k for k in target if k not in names]
    if unknown:
        raise InvalidArgumentError(
            f"target= names {', '.join(map(repr, unknown))}, which {where} does not hold "
            f"(its items: {', '.join(map(repr, names))})")
    return {k: v for k, v in target.items() if v is not None}


def _metrics(metrics: Any) -> dict[str, Any]:
    """Orbax's step metrics that pitstop keeps as metrics (numbers, strings, bools, None)."""
    if not isinstance(metrics, Mapping):
        return {}
    out = {}
    for k, v in metrics.items():
        if isinstance(v, np.generic):
            v = v.item()
        if isinstance(k, str) and (v is None or isinstance(v, (bool, int, float, str))):
            out[k] = v
    return out


def _naming(orbax_options: Any) -> dict[str, Any]:
    """The step naming options of an Orbax ``CheckpointManagerOptions`` (None: Orbax's
    default, plain step numbers)."""
    return {k: getattr(orbax_options, k, None)
            for k in ("step_prefix", "step_format_fixed_length", "step_name_format")}


def _name_format(ocp: Any, naming: dict[str, Any]) -> Any:
    return naming["step_name_format"] or ocp.path.step.standard_name_format(
        step_prefix=naming["step_prefix"],
        step_format_fixed_length=naming["step_format_fixed_length"])


def _committed_steps(ocp: Any, root: Path, naming: dict[str, Any]) -> list[int]:
    """The steps Orbax's CheckpointManager counts as committed in ``root`` (read-only)."""
    options = ocp.CheckpointManagerOptions(
        read_only=True, create=False, save_interval_steps=0, **naming)
    try:
        mgr = ocp.CheckpointManager(os.fspath(root), options=options)
        try:
            return sorted(int(s) for s in mgr.all_steps())
        finally:
            mgr.close()
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(_orbax_failure(f"cannot list the Orbax checkpoints in {root}", e)
                              ) from e


def _is_single_checkpoint(ocp: Any, root: Path) -> bool:
    """Whether ``root`` itself is one finalized Orbax checkpoint (Orbax's own checks)."""
    try:
        return bool(ocp.path.format_utils.is_orbax_checkpoint(root)
                    and ocp.utils.is_checkpoint_finalized(root))
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(_orbax_failure(f"cannot inspect {root}", e)) from e


def _uncommitted(ocp: Any, root: Path) -> list[str]:
    suffix = ocp.path.atomicity_types.TMP_DIR_SUFFIX
    return sorted(p.name for p in root.iterdir() if suffix in p.name)


def _pitstop_options(manager_options: Mapping[str, Any]) -> dict[str, Any]:
    refused = [k for k in _REFUSED_OPTIONS if manager_options.get(k) not in (None, False, ())]
    if refused:
        raise InvalidArgumentError(
            f"import_orbax does not take {', '.join(refused)}: every imported step is kept "
            "(retention would delete imported ones). Apply retention in the run that opens "
            "the directory afterwards.")
    return {**manager_options, **_WRITER_OPTIONS}


def _existing(pitstop_dir: PathLike, steps: list[int], encryption: Any = None) -> None:
    """Raise StepExistsError before reading anything if pitstop_dir has one of ``steps``
    (``encryption``: the import's key, which an encrypted directory needs to be read)."""
    mgr = CheckpointManager(pitstop_dir, read_only=True, save_on_signals=None,
                            encryption=encryption)
    try:
        have = sorted(set(mgr.all_steps()) & set(steps))
        where = mgr.directory
    finally:
        mgr.close()
    if have:
        raise StepExistsError(
            f"{where} already has a checkpoint of step{'s' if len(have) > 1 else ''} "
            f"{', '.join(map(str, have))}, which the import would write; pitstop never "
            "overwrites one. Import into another directory, pick the other steps with "
            "step=..., or delete those checkpoints first.")


def import_orbax(orbax_dir: PathLike, pitstop_dir: PathLike, *, step: int | None = None,
                 items: Iterable[str] | None = None, target: Any = None,
                 orbax_options: Any = None,
                 **manager_options: Any) -> list[int]:
    """Import every committed Orbax checkpoint in ``orbax_dir`` into ``pitstop_dir``.

    ``orbax_dir`` is either the directory of an ``orbax.checkpoint.CheckpointManager`` (one
    pitstop checkpoint per committed Orbax step, same step numbers; only the steps Orbax
    kept and finalized, as its ``all_steps()`` lists them) or one checkpoint directory
    (``StandardCheckpointer().save(path, tree)``, or one step directory of a manager),
    imported as one step: ``step=``, else the directory's name if it is a number, else 0.
    In a manager directory ``step=`` imports only that step. ``items`` imports only those
    items of a multi-item step (each step becomes ``{item: tree}``). ``target`` is the state
    the checkpoints were saved from (live, or abstract with ``jax.ShapeDtypeStruct``
    leaves), for a multi-item step a dict of item name -> state: only its structure is
    used (dtypes stay the saved ones), so that the import restores into it (see the module
    docstring); a checkpoint that does not match it raises
    :class:`pitstop.IncompatibleTargetError`. ``orbax_options`` is
    the ``ocp.CheckpointManagerOptions`` the Orbax manager was created with, when it named
    its steps otherwise than by plain numbers (only ``step_prefix``,
    ``step_format_fixed_length`` and ``step_name_format`` are used).

    What the imported trees hold is in this module's docstring. ``manager_options`` go to
    :class:`pitstop.CheckpointManager` (``writer_threads``, ``compression``, naming, ...);
    retention options are refused, since every imported step is kept. Saves are
    synchronous and each step is committed before the next is read; if one fails, the steps
    imported before it stay and the error names the failed one.

    Returns the imported steps, oldest first. Raises :class:`pitstop.CheckpointNotFoundError`
    when ``orbax_dir`` holds no committed Orbax checkpoint, :class:`pitstop.StepExistsError`
    (before anything is read) when ``pitstop_dir`` already has one of the steps,
    :class:`pitstop.UnsupportedStateError` for an item or value pitstop cannot import, and
    :class:`pitstop.CheckpointError` when Orbax fails to read a checkpoint.
    """
    ocp = _ocp()
    options = _pitstop_options(manager_options)
    step = None if step is None else step_arg(step)
    root = Path(os.path.abspath(os.fspath(orbax_dir)))
    if not root.is_dir():
        raise CheckpointNotFoundError(
            f"{root} is not a directory; pass the directory an Orbax CheckpointManager or "
            "StandardCheckpointer saved to")
    naming = _naming(orbax_options)
    steps = _committed_steps(ocp, root, naming)
    if steps:
        name_format = _name_format(ocp, naming)
        if step is not None:
            if step not in steps:
                raise CheckpointNotFoundError(
                    f"{root} has no committed Orbax checkpoint of step {step} (have: {steps})")
            steps = [step]
        try:
            paths = {s: ocp.path.step.find_step_path(root, name_format, step=s) for s in steps}
        except Exception as e:  # noqa: BLE001 - deleted meanwhile, unreadable, ...
            raise CheckpointError(_orbax_failure(
                f"cannot find the Orbax step directories of steps {steps} in {root}", e)) from e
    else:
        if ocp.path.atomicity_types.TMP_DIR_SUFFIX in root.name:
            raise CheckpointNotFoundError(
                f"{root} is a save Orbax never finalized (the run crashed or is still saving), "
                "not a committed checkpoint; pitstop imports committed ones only")
        if not _is_single_checkpoint(ocp, root):
            tmp = _uncommitted(ocp, root)
            raise CheckpointNotFoundError(
                f"{root} holds no committed Orbax checkpoint"
                + (f" (only saves Orbax never finalized: {', '.join(tmp)})" if tmp else "")
                + ". Pass the directory an Orbax CheckpointManager saved to, or one "
                "checkpoint that StandardCheckpointer saved"
                + ("; for a manager that named its steps otherwise than by plain numbers, "
                   "pass its options as orbax_options=" if orbax_options is None else "")
                + ".")
        one = step if step is not None else int(root.name) if root.name.isdigit() else 0
        steps, paths = [one], {one: root}

    _existing(pitstop_dir, steps, options.get("encryption"))
    # the first step is read (and matched to target=) before the pitstop directory is made:
    # a refused import leaves nothing behind
    first = _read_step(ocp, paths[steps[0]], steps[0], items, target)
    mgr = CheckpointManager(pitstop_dir, **options)
    try:
        for s in steps:
            state, metrics = first if s == steps[0] else _read_step(ocp, paths[s], s, items,
                                                                     target)
            mgr.save(s, state, metrics).wait()
    finally:
        mgr.close()
    return steps
