"""JAX support: put JAX pytrees straight into the state you give the manager.

>>> state = {"params": params, "opt_state": opt_state, "key": key}
>>> start = mgr.restore(state)       # replaces the pytrees inside ``state`` (JAX arrays are
...                                  # immutable); None on a fresh run
>>> new = mgr.load(target=abstract)  # a new pytree, arrays placed as ``abstract`` says
...                                  # (or as saved, where it gives no sharding)
>>> arrays = load_arrays(mgr)        # jax.Arrays with the saved shardings (mgr.load(): numpy)

Saved: ``jax.Array`` of every dtype numpy or ml_dtypes holds (sharded arrays shard by shard,
each distinct shard once), raw ``uint32`` and typed PRNG keys (every implementation), any
registered pytree node (dataclasses, Flax ``struct`` dataclasses, ``FrozenDict``, NNX
``State`` and modules), Optax states. Multi-process jobs (``jax.distributed``) save one
checkpoint together through :class:`JaxCoordinator`, which a manager finds by itself.
Imported by the adapter registry the first time a JAX object shows up in a state (or any
unknown object once JAX is imported).
"""

from __future__ import annotations

from typing import Any

from pitstop.adapters.jax._adapter import JaxAdapter, is_typed_key
from pitstop.adapters.jax._ambient import ambient_coordinator, ambient_rank
from pitstop.adapters.jax._leaf import JaxArrayLeaf, allow_dtype_cast
from pitstop.adapters.jax._saved import abstract_state, load_arrays
from pitstop.core.adapter import Plugin, register

register(Plugin(
    "jax", modules=("jax", "flax", "optax"),
    # after the adapters of specific frameworks (a Keras variable on the JAX backend is
    # Keras's): this one also takes any registered pytree node
    fallbacks=(JaxAdapter(),),
    coordinator=ambient_coordinator, rank=ambient_rank))


def __getattr__(name: str) -> Any:
    # Orbax (and the tensorstore it brings) is imported only by those who convert
    if name == "import_orbax":
        from pitstop.interop.orbax import import_orbax

        return import_orbax
    if name == "export_orbax":
        from pitstop.interop.orbax_export import export_orbax

        return export_orbax
    if name == "JaxCoordinator":  # multi-process saves (jax.distributed)
        from pitstop.adapters.jax.distributed import JaxCoordinator

        return JaxCoordinator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["JaxAdapter", "JaxArrayLeaf", "is_typed_key", "import_orbax", "export_orbax",
           "JaxCoordinator", "allow_dtype_cast", "abstract_state", "load_arrays"]
