"""A Keras ``fit()`` with pitstop's BackupAndRestore, run as its own process by the tests.

    python fit_child.py OUT_DIR KIND [--kill-at N] [--term-at N] [--save-freq F]
                        [--policy mixed_float16] [--keras-callback]

KIND is functional, sequential or subclassed. The model has dropout (a seed generator),
batch normalization (non-trainable state) and a compiled metric; the data are shuffled
each epoch. ``--kill-at N`` SIGKILLs the process at the end of its N-th trained batch,
``--term-at N`` sends it SIGTERM there. At the end, OUT_DIR/result.json holds every logged
per-batch loss and the final weights and optimizer variables as bytes (hex).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
from pitstop.adapters.keras import BackupAndRestore  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("kind")
ap.add_argument("--kill-at", type=int, default=0)
ap.add_argument("--term-at", type=int, default=0)
ap.add_argument("--save-freq", default="3")
ap.add_argument("--epochs", type=int, default=3)
ap.add_argument("--policy", default="")
ap.add_argument("--keras-callback", action="store_true")
args = ap.parse_args()

if args.policy and args.policy != "float32":
    keras.mixed_precision.set_global_policy(args.policy)
keras.utils.set_random_seed(11)


class Net(keras.Model):
    def __init__(self) -> None:
        super().__init__()
        self.d1 = keras.layers.Dense(16, activation="relu")
        self.bn = keras.layers.BatchNormalization()
        self.drop = keras.layers.Dropout(0.25)
        self.d2 = keras.layers.Dense(1, dtype="float32")

    def call(self, x, training=False):
        return self.d2(self.drop(self.bn(self.d1(x), training=training), training=training))


def make() -> keras.Model:
    layers = [keras.layers.Dense(16, activation="relu"), keras.layers.BatchNormalization(),
              keras.layers.Dropout(0.25), keras.layers.Dense(1, dtype="float32")]
    if args.kind == "sequential":
        m = keras.Sequential([keras.Input((6,)), *layers])
    elif args.kind == "functional":
        inp = keras.Input((6,))
        h = inp
        for layer in layers:
            h = layer(h)
        m = keras.Model(inp, h)
    else:
        m = Net()
        m(np.zeros((1, 6), "float32"))  # builds every layer (Net has no build())
    m.compile(keras.optimizers.Adam(1e-2), "mse", metrics=["mae"])
    return m


rs = np.random.RandomState(0)
x = rs.randn(80, 6).astype("float32")
y = (x[:, :1] * 2 - x[:, 1:2] + 0.1 * rs.randn(80, 1)).astype("float32")
model = make()
logged: list[list] = []


class Record(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        logged.append([self.epoch, batch, float(logs["loss"])])
        if len(logged) == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if len(logged) == args.term_at:
            os.kill(os.getpid(), signal.SIGTERM)


freq = args.save_freq if args.save_freq == "epoch" else int(args.save_freq)
backup = os.path.join(args.out, "backup")
cb = (keras.callbacks.BackupAndRestore(backup, save_freq=freq, delete_checkpoint=False)
      if args.keras_callback else BackupAndRestore(backup, save_freq=freq, delete_checkpoint=False))
model.fit(x, y, batch_size=8, epochs=args.epochs, shuffle=True, verbose=0,
          callbacks=[cb, Record()], validation_data=(x[:16], y[:16]))


def dump(variables) -> list[str]:
    return [np.ascontiguousarray(keras.ops.convert_to_numpy(v)).tobytes().hex() for v in variables]


with open(os.path.join(args.out, "result.json"), "w") as f:
    json.dump({"logged": logged, "weights": dump(model.variables),
               "optimizer": dump(model.optimizer.variables)}, f)
