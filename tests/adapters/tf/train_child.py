"""A TensorFlow training job for the exact-resume tests: a tf.function step with dropout
drawn from a tf.random.Generator, a shuffled tf.data pipeline (reshuffled each epoch,
repeated), Keras 3's Adam, and pitstop's tf.train-style manager saving every few steps.

Prints ``STEP <n> <loss as hex bytes>`` per step (a restarted run prints the steps it
repeats again), and writes every variable of the model and optimizer to ``final.npz``."""

from __future__ import annotations

import argparse
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["KERAS_BACKEND"] = "tensorflow"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from pitstop.adapters.tf import Checkpoint, CheckpointManager  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--kill-at", type=int, default=-1)
    a = p.parse_args()

    # bitwise-equal losses across processes need deterministic kernels and one thread
    # each (a reduction split another way under load rounds differently)
    tf.config.experimental.enable_op_determinism()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    keras.utils.set_random_seed(1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 6)).astype(np.float32)
    y = (x @ rng.normal(size=(6, 1))).astype(np.float32)
    data = iter(tf.data.Dataset.from_tensor_slices((x, y))
                .shuffle(96, seed=3, reshuffle_each_iteration=True).repeat().batch(16))
    hidden, head = keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)
    model = keras.Sequential([hidden, head])
    model.build((None, 6))
    opt = keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.01, 5, 0.9))
    opt.build(model.trainable_variables)
    gen = tf.random.Generator.from_seed(7)
    step = tf.Variable(0, dtype=tf.int64)
    ckpt = Checkpoint(model=model, optimizer=opt, gen=gen, data=data, step=step)
    manager = CheckpointManager(ckpt, a.dir, max_to_keep=2)
    resumed = manager.restore_or_initialize()
    print("RESUMED", resumed, int(step.numpy()), flush=True)

    @tf.function
    def train(xb, yb):
        with tf.GradientTape() as tape:
            h = hidden(xb)
            keep = tf.cast(gen.uniform(tf.shape(h)) > 0.25, h.dtype) / 0.75
            loss = tf.reduce_mean((head(h * keep) - yb) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    while int(step.numpy()) < a.steps:
        xb, yb = next(data)
        loss = train(xb, yb)
        step.assign_add(1)
        n = int(step.numpy())
        print(f"STEP {n} {np.float32(loss.numpy()).tobytes().hex()}", flush=True)
        if n % a.save_every == 0:
            manager.save()
        if n == a.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    manager.sync()
    np.savez(os.path.join(a.out, "final.npz"),
             **{f"v{i}": np.asarray(v.numpy()) for i, v in
                enumerate([*model.variables, *opt.variables, gen.state])})
    manager.close()
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
