"""The conformance battery (pitstop.testing.AdapterSuite) for JAX: pytrees of jax.Arrays
(sharded ones too), Optax states, typed and raw PRNG keys."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pitstop.testing import AdapterSuite, Bits

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

TX = optax.adam(1e-2)


def _loss(params, x, key):
    keep = jax.random.bernoulli(key, 0.9, x.shape)  # dropout on the inputs
    pred = jnp.where(keep, x / 0.9, 0.0) @ params["w"] + params["b"]
    return jnp.mean((pred - x.sum(axis=1, keepdims=True)) ** 2)


@jax.jit
def _step(params, opt_state, key):
    key, data, drop = jax.random.split(key, 3)
    x = jax.random.normal(data, (8, 4))
    loss, grads = jax.value_and_grad(_loss)(params, x, drop)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, key, loss


class TestJaxConformance(AdapterSuite):
    def _state(self, rows: int) -> dict[str, Any]:
        params = {"w": jnp.zeros((rows, 1)), "b": jnp.zeros(1)}
        return {"params": params, "opt_state": TX.init(params), "key": jax.random.key(0)}

    def make_state(self) -> dict[str, Any]:
        return self._state(4)

    def train_step(self, state: dict[str, Any], step: int) -> float:
        state["params"], state["opt_state"], state["key"], loss = _step(
            state["params"], state["opt_state"], state["key"])
        return float(loss)

    def wrong_shape_target(self) -> dict[str, Any]:
        return self._state(5)

    def to_host(self, obj: Any) -> Any:
        if isinstance(obj, jax.Array):
            if jax.dtypes.issubdtype(obj.dtype, jax.dtypes.prng_key):
                data = np.asarray(jax.random.key_data(obj))
                return Bits(f"key<{jax.random.key_impl(obj)}>", data.shape, data.tobytes())
            return Bits(f"jax.Array[{obj.dtype}]", tuple(obj.shape), np.asarray(obj).tobytes())
        return NotImplemented

    def leaf_examples(self, seed: int) -> dict[str, Any]:
        k = jax.random.key(seed)
        floats = ["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "complex64"]
        ints = ["int8", "int16", "int32", "uint8", "uint32"]
        mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
        return {
            **{d: jax.random.normal(jax.random.fold_in(k, i), (5,)).astype(d)
               for i, d in enumerate(floats)},
            **{d: jax.random.randint(jax.random.fold_in(k, 10 + i), (5,), 0, 100).astype(d)
               for i, d in enumerate(ints)},
            "bool": jax.random.bernoulli(k, 0.5, (9,)),
            "0-d": jnp.asarray(seed, jnp.float32),
            "empty": jnp.zeros((0, 3)),
            "sharded on 2 devices": jax.device_put(
                jnp.arange(8.0) * seed, NamedSharding(mesh, PartitionSpec("x"))),
            "typed key": jax.random.key(100 + seed),
            "rbg key": jax.random.key(100 + seed, impl="rbg"),
            "raw key": jax.random.PRNGKey(200 + seed),
            "numpy beside": np.arange(3, dtype=np.int64) + seed,
            "int": seed, "float": seed / 7, "str": f"run {seed}",
            "tuple": (seed, [seed * 0.5]),
        }
