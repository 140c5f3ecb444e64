"""What several JAX test files compare: a leaf's every bit (typed keys by implementation and
key data), and whole trees (structure, then leaves)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def bits(x: Any) -> tuple:
    """A leaf as everything its value is: kind (jax, numpy array or scalar), shape, dtype and
    bytes; a typed key as its implementation and key data; anything else by its repr."""
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        d = np.asarray(jax.random.key_data(x))
        return ("key", str(jax.random.key_impl(x)), d.shape, d.tobytes())
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        a = np.asarray(x)
        return ("jax" if isinstance(x, jax.Array) else type(x).__name__, a.shape,
                a.dtype.name, a.tobytes())
    return (type(x), repr(x))


def tree_bits(t: Any) -> list:
    return [bits(x) for x in jax.tree.leaves(t)]


def assert_same_tree(got: Any, want: Any) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want), (
        jax.tree.structure(got), jax.tree.structure(want))
    assert tree_bits(got) == tree_bits(want)
