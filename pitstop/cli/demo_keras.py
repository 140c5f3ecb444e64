"""The Keras 3 trainer of ``pitstop demo``: a Sequential MLP with dropout, Adam with a cosine
learning-rate schedule, ``train_on_batch`` on batches drawn from a seeded numpy Generator
every step; on the backend KERAS_BACKEND names (when it is unset the demo picks jax, the
quickest to start here, if installed). The model (weights and the dropout layer's seed generator), the
optimizer and the batch generator's state go straight into pitstop's state; the peer is
``model.save`` (the .keras file ModelCheckpoint writes: weights and optimizer)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from pitstop.cli.demo import ChildRun

D_IN, HIDDEN, D_OUT, BATCH = 256, 1024, 64, 64
PARAMS = D_IN * HIDDEN + HIDDEN + HIDDEN * D_OUT + D_OUT
DESCRIPTION = (f"a Keras 3 MLP ({PARAMS / 1e6:.2f} M parameters, dropout) on the "
               f"{os.environ.get('KERAS_BACKEND', 'jax')} backend, Adam with a cosine "
               "schedule, train_on_batch on batches from a seeded numpy Generator")
PEER = ("model.save", "the .keras file ModelCheckpoint writes: weights + optimizer")


def state_mib(steps: int) -> float:
    return (3 * PARAMS * 4 + steps * 8) / 2**20


def train(c: ChildRun) -> int:
    """One training run; with a checkpoint directory it resumes from it when it can."""
    import keras

    import pitstop.adapters.keras  # noqa: F401  (Keras objects in pitstop's state)

    keras.utils.set_random_seed(c.seed)
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.enable_op_determinism()
    init = np.random.default_rng(c.seed)
    teacher = (init.standard_normal((D_IN, D_OUT)) / 16).astype(np.float32)
    model = keras.Sequential([
        keras.Input((D_IN,)),
        keras.layers.Dense(HIDDEN, activation="gelu"),
        keras.layers.Dropout(0.1, seed=c.seed),
        keras.layers.Dense(D_OUT),
    ])
    schedule = keras.optimizers.schedules.CosineDecay(1e-3, decay_steps=c.steps)
    model.compile(optimizer=keras.optimizers.Adam(schedule), loss="mse")
    model.optimizer.build(model.trainable_variables)
    data = np.random.default_rng(c.seed + 1)
    losses = np.zeros(c.steps, np.float64)
    state: dict[str, Any] = {"model": model, "optimizer": model.optimizer,
                             "data": data.bit_generator.state, "losses": losses}
    mgr = c.manager()
    restored = None
    if mgr is not None:
        restored = mgr.restore(state)
        if restored is not None and not c.wrong_resume:  # --wrong-resume: forget the data RNG
            data.bit_generator.state = state["data"]
    start = c.restored(restored)

    def peer_save(path: str) -> None:
        model.save(path + ".keras")

    for step in range(start, c.steps):
        x = data.standard_normal((BATCH, D_IN), dtype=np.float32)
        y = np.tanh(x @ teacher) + np.float32(0.01) * data.standard_normal(
            (BATCH, D_OUT), dtype=np.float32)
        losses[step] = float(model.train_on_batch(x, y))
        state["data"] = data.bit_generator.state
        c.end_of_step(step, mgr, state, float(losses[step]), peer_save)
    arrays = {f"model.{i}.{v.path}": keras.ops.convert_to_numpy(v)
              for i, v in enumerate(model.variables)}
    arrays.update({f"optimizer.{i}.{v.path}": keras.ops.convert_to_numpy(v)
                   for i, v in enumerate(model.optimizer.variables)})
    arrays["losses"] = losses
    return c.finish(mgr, arrays)
