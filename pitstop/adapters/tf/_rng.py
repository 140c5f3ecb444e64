"""TensorFlow's global generator (``tf.random.get_global_generator()``) for :class:`pitstop.RNG`.

Only a global generator that already exists is saved (pitstop never creates one, which would
seed it nondeterministically). Random ops that do not draw from a ``tf.random.Generator``
(``tf.random.uniform`` with op seeds) keep hidden per-kernel state TensorFlow does not expose:
they cannot be resumed exactly by any checkpoint; use a ``tf.random.Generator``.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import stateful_random_ops

log = logging.getLogger("pitstop")


def get_state() -> dict[str, Any]:
    gen = stateful_random_ops.global_generator
    if gen is None:
        return {}
    return {"global_generator": {"algorithm": int(gen.algorithm),
                                 "state": [int(x) for x in gen.state.numpy()]}}


def set_state(state: dict[str, Any]) -> None:
    saved = state.get("global_generator") if isinstance(state, dict) else None
    if not saved:
        return
    gen = tf.random.get_global_generator()
    if int(gen.algorithm) != int(saved["algorithm"]):
        tf.random.set_global_generator(tf.random.Generator.from_state(
            np.array(saved["state"], np.int64), saved["algorithm"]))
        return
    gen.reset(np.array(saved["state"], np.int64))
