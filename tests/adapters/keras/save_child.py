"""Trains a 64 MiB Keras model with pitstop's ModelCheckpoint saving at every batch, until
it is killed (the tests SIGKILL it while files are being written).

    python save_child.py OUT_DIR
"""

from __future__ import annotations

import os
import sys

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
from pitstop.adapters.keras import ModelCheckpoint  # noqa: E402

out = sys.argv[1]
model = keras.Sequential([keras.Input((2048,)), *[keras.layers.Dense(2048) for _ in range(4)]])
model.compile("sgd", "mse")
x = np.ones((64, 2048), "float32")
model.fit(x, x, batch_size=8, epochs=10_000, verbose=0,
          callbacks=[ModelCheckpoint(os.path.join(out, "m-{epoch}-{batch}.keras"), save_freq=1,
                                     keep_last=3)])
