"""The conformance battery (pitstop.testing.AdapterSuite) for TensorFlow: tf.Module graphs of
variables of every dtype, tf.random.Generator, tf.data iterators."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from pitstop.testing import AdapterSuite, Bits

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")


class Linear(tf.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.w = tf.Variable(tf.zeros((rows, 1)))
        self.b = tf.Variable(tf.zeros(1))


class Momentum(tf.Module):
    """SGD with momentum; its slots are tracked beside the model's variables."""

    def __init__(self, model: Linear) -> None:
        super().__init__()
        self.model = model
        self.slots = [tf.Variable(tf.zeros_like(v)) for v in (model.w, model.b)]
        self.iterations = tf.Variable(0, dtype=tf.int64)


class TestTfConformance(AdapterSuite):
    def _state(self, rows: int) -> dict[str, Any]:
        features = np.random.default_rng(0).normal(size=(64, rows)).astype("float32")
        data = tf.data.Dataset.from_tensor_slices(features).shuffle(
            64, seed=1, reshuffle_each_iteration=True).repeat().batch(8)
        return {"opt": Momentum(Linear(rows)), "gen": tf.random.Generator.from_seed(7),
                "data": iter(data)}

    def make_state(self) -> dict[str, Any]:
        return self._state(4)

    def train_step(self, state: dict[str, Any], step: int) -> float:
        opt, gen = state["opt"], state["gen"]
        model = opt.model
        x = next(state["data"])
        with tf.GradientTape() as tape:
            keep = tf.cast(gen.uniform(tf.shape(x)) > 0.1, x.dtype) / 0.9
            pred = (x * keep) @ model.w + model.b
            loss = tf.reduce_mean((pred - tf.reduce_sum(x, axis=1, keepdims=True)) ** 2)
        for v, slot, g in zip((model.w, model.b), opt.slots,
                              tape.gradient(loss, [model.w, model.b]), strict=True):
            slot.assign(0.9 * slot + g)
            v.assign_sub(0.01 * slot)
        opt.iterations.assign_add(1)
        return float(loss)

    def wrong_shape_target(self) -> dict[str, Any]:
        return self._state(5)

    def to_host(self, obj: Any) -> Any:
        if isinstance(obj, tf.Variable):
            return Bits(f"tf.Variable[{obj.dtype.name}]", tuple(obj.shape),
                        obj.numpy().tobytes())
        if isinstance(obj, tf.random.Generator):
            return {"state": obj.state, "algorithm": int(obj.algorithm)}
        if isinstance(obj, tf.Module):
            return {type(obj).__name__: list(obj.variables)}
        if isinstance(obj, tf.data.Iterator):
            # its state is opaque: the losses after a resume show whether it came back
            return Bits("tf.data.Iterator", (), b"")
        return NotImplemented

    @staticmethod
    def _module(seed: int) -> Linear:
        m = Linear(2)
        m.w.assign(tf.fill((2, 1), float(seed)))
        return m

    def leaf_examples(self, seed: int) -> dict[str, Any]:
        r = np.random.default_rng(seed)
        dtypes = [tf.float32, tf.float64, tf.float16, tf.bfloat16, tf.complex64]
        ints = [tf.int8, tf.int16, tf.int32, tf.int64, tf.uint8]
        return {
            **{d.name: tf.Variable(tf.cast(r.normal(size=5), d)) for d in dtypes},
            **{d.name: tf.Variable(tf.cast(r.integers(0, 100, 5), d)) for d in ints},
            "bool": tf.Variable(r.integers(0, 2, 9).astype(bool) ^ bool(seed % 2)),
            "0-d": tf.Variable(float(seed)),
            "empty": tf.Variable(tf.zeros((0, 3))),
            "module": self._module(seed),
            "tf.random.Generator": tf.random.Generator.from_seed(100 + seed),
            "numpy beside": np.arange(3, dtype=np.int64) + seed,
            "int": seed, "float": seed / 7, "str": f"run {seed}",
            "tuple": (seed, [seed * 0.5]),
        }
