"""A checkpoint's own shape, dtype and sharding, as a restore target: what Orbax's
``restore(step)`` without arguments gives (``jax.Array`` leaves, placed as they were saved)."""

from __future__ import annotations

from typing import Any

import jax

from pitstop.adapters.jax._adapter import IMPL, KEY_DATA
from pitstop.adapters.jax._leaf import describe, sharding_from
from pitstop.core.errors import CheckpointNotFoundError, UnsupportedStateError
from pitstop.core.format.dtypes import decode_dtype
from pitstop.core.tree import decode_value, unflatten


def abstract_state(mgr: Any, step: int | None = None) -> Any:
    """The structure of checkpoint ``step`` (the newest when None) with a
    ``jax.ShapeDtypeStruct`` per array, carrying the sharding the save recorded (None for
    an array saved on one device, or by a pitstop that recorded none), and the saved values
    as they are; typed PRNG keys as typed-key structs. ``mgr.load(step, target=...)`` of it
    returns ``jax.Array`` leaves placed as saved. A recorded sharding this job's devices
    cannot hold is refused, naming the array, the sharding and what to pass instead."""
    if step is None:
        step = mgr.latest_step()
        if step is None:
            raise CheckpointNotFoundError(f"no checkpoint in {mgr.directory}")
    m = mgr.metadata(step)
    leaves: dict[str, Any] = {}
    for key, entry in m.arrays.items():
        sharding, why = sharding_from(m.layouts.get(key))
        if why is not None:
            raise UnsupportedStateError(
                f"step {step} of {mgr.directory}: array {key!r} was saved as "
                f"{describe(m.layouts[key])}, which this job's devices cannot hold: {why}; "
                "pass load() a target whose ShapeDtypeStruct for it has a sharding= of this "
                "job's devices")
        leaves[key] = jax.ShapeDtypeStruct(tuple(entry.shape), decode_dtype(entry.dtype),
                                           sharding=sharding)
    leaves.update({k: decode_value(v) for k, v in m.values.items()})
    tree = leaves if m.structure is None else unflatten(m.structure, leaves)
    return _typed_keys(tree)


def load_arrays(mgr: Any, step: int | None = None) -> Any:
    """Checkpoint ``step`` (the newest when None) as ``jax.Array``s placed with the shardings
    the save recorded (one device where none was), as Orbax's ``restore(step)`` returns it;
    ``mgr.load(step)`` without a target returns numpy arrays instead."""
    if step is None:
        step = mgr.latest_step()
    return mgr.load(step, target=abstract_state(mgr, step))


def _typed_keys(tree: Any) -> Any:
    """``{"key_data": struct, "impl": name}`` pairs (how a typed key is saved) as typed-key
    structs, so the load makes typed keys again."""
    if isinstance(tree, dict):
        if set(tree) == {KEY_DATA, IMPL} and isinstance(tree[KEY_DATA], jax.ShapeDtypeStruct) \
                and isinstance(tree[IMPL], str):
            data, impl = tree[KEY_DATA], tree[IMPL]
            key = jax.eval_shape(lambda d: jax.random.wrap_key_data(d, impl=impl), data)
            return jax.ShapeDtypeStruct(key.shape, key.dtype)  # placed as its data was saved
        return {k: _typed_keys(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_typed_keys(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_typed_keys(v) for v in tree)
    return tree
