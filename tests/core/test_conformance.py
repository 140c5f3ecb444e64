"""The conformance battery (pitstop.testing.AdapterSuite) for the reference face: numpy
arrays, numpy and Python generators, and plain values."""

from __future__ import annotations

import random
from collections import OrderedDict, defaultdict, namedtuple
from typing import Any

import ml_dtypes
import numpy as np

from pitstop.testing import AdapterSuite

Best = namedtuple("Best", "step loss")


class TestNumpyConformance(AdapterSuite):
    def make_state(self) -> dict[str, Any]:
        return {"model": {"w": np.zeros((16, 4), np.float32), "b": np.zeros(4, np.float32)},
                "optimizer": {"w": np.zeros((16, 4), np.float32),
                              "b": np.zeros(4, np.float32), "lr": 0.05},
                "data": np.random.default_rng(7),
                "dropout": random.Random(3),
                "progress": {"seen": 0, "best": Best(-1, float("inf"))}}

    def train_step(self, state: dict[str, Any], step: int) -> float:
        m, o, rng = state["model"], state["optimizer"], state["data"]
        x = rng.standard_normal((8, 16), dtype=np.float32)
        keep = np.float32(state["dropout"].random() > 0.1)
        err = keep * (x @ m["w"]) + m["b"] - x[:, :4]
        o["w"] *= np.float32(0.9)
        o["w"] += x.T @ err / np.float32(8)
        o["b"] *= np.float32(0.9)
        o["b"] += err.mean(axis=0)
        m["w"] -= np.float32(o["lr"]) * o["w"]
        m["b"] -= np.float32(o["lr"]) * o["b"]
        loss = float(np.mean(err * err, dtype=np.float64))
        p = state["progress"]
        p["seen"] += 8
        if loss < p["best"].loss:
            p["best"] = Best(step, loss)
        return loss

    def leaf_examples(self, seed: int) -> dict[str, Any]:
        r = np.random.default_rng(seed)
        base = r.standard_normal(20)
        return {
            **{f"{d}": r.standard_normal(6).astype(d) for d in
               ("float16", "float32", "float64", "complex64", "complex128")},
            **{f"{d}": r.integers(0, 100, 5).astype(d) for d in
               ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")},
            "bool": r.integers(0, 2, 7).astype(bool) ^ np.array([seed % 2] * 7, bool),
            "bfloat16": r.standard_normal(6).astype(ml_dtypes.bfloat16),
            "float8_e4m3fn": r.standard_normal(6).astype(ml_dtypes.float8_e4m3fn),
            "float8_e5m2": r.standard_normal(6).astype(ml_dtypes.float8_e5m2),
            "0-d": np.array(r.standard_normal()),
            "empty": np.zeros((0, 3), np.float32) + seed,  # no bytes: only kind and shape
            "fortran order": np.asfortranarray(r.standard_normal((3, 4))),
            "strided view": base[::3],
            "numpy scalar": np.float32(seed + 0.5),
            "numpy int scalar": np.int64(seed),
            "int": 2**70 + seed,
            "float": seed / 3,
            "inf": float("inf") if seed == 1 else float("-inf"),
            "str": f"run {seed}",
            "bytes": bytes([seed, 0, 255]),
            "bool value": seed == 1,
            "None or value": None if seed == 1 else 0,
            "nested": {"list": [seed, [seed * 2.5]], "tuple": (seed, "x")},
            "namedtuple": Best(seed, seed * 0.25),
            "OrderedDict": OrderedDict(warmup=seed),
            "defaultdict": defaultdict(int, cats=seed),
            "Generator": np.random.default_rng(seed),
            "RandomState": np.random.RandomState(seed),
            "Random": random.Random(seed),
        }

    def wrong_shape_target(self) -> dict[str, Any]:
        state = self.make_state()
        state["model"]["b"] = np.zeros(5, np.float32)
        return state
