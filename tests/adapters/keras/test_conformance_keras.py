"""The conformance battery (pitstop.testing.AdapterSuite) for Keras 3 objects in pitstop's own
manager, on the backend KERAS_BACKEND names (this folder runs once per backend)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from pitstop.testing import AdapterSuite, Bits

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
keras = pytest.importorskip("keras")

from keras_helpers import on_backends  # noqa: E402

import pitstop  # noqa: E402


def _model(units: int) -> keras.Model:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(units, activation="relu"),
                              keras.layers.Dropout(0.2, seed=5), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


class TestKerasConformance(AdapterSuite):
    # a killed and two restarted Keras processes: on one backend (each backend's own SIGKILL
    # resume is one of tests/adapters/keras/test_backup_and_restore.py's cases)
    test_sigkill_resumes_exactly = on_backends("jax")(AdapterSuite.test_sigkill_resumes_exactly)

    def _state(self, units: int) -> dict[str, Any]:
        keras.utils.set_random_seed(0)  # python, numpy and the backend's global generators
        model = _model(units)
        return {"model": model, "optimizer": model.optimizer,
                "data": np.random.default_rng(1), "rng": pitstop.RNG()}

    def make_state(self) -> dict[str, Any]:
        return self._state(8)

    def train_step(self, state: dict[str, Any], step: int) -> float:
        x = state["data"].standard_normal((8, 4)).astype("float32")
        loss = state["model"].train_on_batch(x, x.sum(axis=1, keepdims=True))
        return float(np.asarray(loss).reshape(-1)[0])

    def wrong_shape_target(self) -> dict[str, Any]:
        return self._state(9)

    def to_host(self, obj: Any) -> Any:
        if isinstance(obj, keras.Variable):
            value = np.array(obj.numpy())
            return Bits(f"keras.Variable[{obj.dtype}]", tuple(obj.shape), value.tobytes())
        if isinstance(obj, (keras.layers.Layer, keras.optimizers.Optimizer)):
            return {type(obj).__name__: list(obj.variables)}
        if isinstance(obj, keras.random.SeedGenerator):
            return {"SeedGenerator": obj.state}
        return NotImplemented

    def leaf_examples(self, seed: int) -> dict[str, Any]:
        r = np.random.default_rng(seed)
        keras.utils.set_random_seed(seed)
        layer = keras.layers.Dense(2)
        layer.build((None, 3))
        return {
            **{d: keras.Variable(r.normal(size=5).astype("float32"), dtype=d)
               for d in ("float32", "float16", "bfloat16")},
            "int32": keras.Variable(r.integers(0, 100, 5).astype("int32"), dtype="int32",
                                     trainable=False),
            "0-d": keras.Variable(float(seed)),
            "empty": keras.Variable(np.zeros((0, 3), "float32")),
            "layer": layer,
            "SeedGenerator": keras.random.SeedGenerator(100 + seed),
            "numpy beside": np.arange(3, dtype=np.int64) + seed,
            "int": seed, "float": seed / 7, "str": f"run {seed}",
        }
