"""Train a small Keras 3 model in a TensorFlow loop with pitstop's tf.train-style manager: stop
it any way you like, run it again, and it continues exactly where the last checkpoint left it.

    python examples/tf_train.py                  # trains, saving every 20 steps
    python examples/tf_train.py                  # again: "resuming from runs/tf_example/ckpt-8"

The only change from a tf.train script is the import. Everything that decides the next step
is in the checkpoint: weights, Adam's moments and iteration count (its learning-rate schedule
is recomputed from it), the tf.data position and shuffle state, the dropout generator and the
step counter.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from pitstop.adapters.tf import Checkpoint, CheckpointManager  # noqa: E402  (was: tf.train)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="runs/tf_example", help="checkpoint directory")
    p.add_argument("--steps", type=int, default=300, help="total training steps")
    p.add_argument("--save-every", type=int, default=20)
    args = p.parse_args()

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 16)).astype("float32")
    y = np.sin(x @ rng.normal(size=(16, 1))).astype("float32")
    data = iter(tf.data.Dataset.from_tensor_slices((x, y))
                .shuffle(512, seed=0, reshuffle_each_iteration=True).repeat().batch(32))

    hidden, head = keras.layers.Dense(64, activation="gelu"), keras.layers.Dense(1)
    model = keras.Sequential([hidden, head])
    model.build((None, 16))
    schedule = keras.optimizers.schedules.CosineDecay(3e-3, decay_steps=args.steps)
    optimizer = keras.optimizers.AdamW(schedule, weight_decay=0.01, clipnorm=1.0)
    dropout = tf.random.Generator.from_seed(0)
    step = tf.Variable(0, dtype=tf.int64)

    ckpt = Checkpoint(model=model, optimizer=optimizer, data=data, dropout=dropout, step=step)
    manager = CheckpointManager(ckpt, args.dir, max_to_keep=3)
    restored = manager.restore_or_initialize()
    print(f"resuming from {restored} (step {int(step)})" if restored
          else f"starting fresh in {args.dir}")

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            h = hidden(xb)
            h = h * tf.cast(dropout.uniform(tf.shape(h)) > 0.1, h.dtype) / 0.9
            loss = tf.reduce_mean((head(h) - yb) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    while int(step) < args.steps:
        loss = float(train_step(*next(data)))
        step.assign_add(1)
        n = int(step)
        if n % args.save_every == 0 or n == args.steps:
            manager.save()                  # returns after the snapshot; commits behind
        if n % 50 == 0:
            print(f"step {n:4d}  loss {loss:.4f}")
    manager.sync()
    print(f"done; checkpoints: {manager.checkpoints}")
    manager.close()


if __name__ == "__main__":
    main()
