"""Small models and loops shared by the TensorFlow tests."""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

X = tf.random.stateless_normal((16, 3), seed=(1, 2))
Y = tf.random.stateless_normal((16, 2), seed=(3, 4))


def make_model(seed: int, build: bool = True, dropout: bool = True) -> keras.Model:
    """A small MLP; ``seed`` decides its initial weights (drawn when it is built)."""
    keras.utils.set_random_seed(seed)
    layers = [keras.layers.Dense(8, activation="relu")]
    if dropout:
        layers.append(keras.layers.Dropout(0.3, seed=seed + 1))
    layers.append(keras.layers.Dense(2))
    model = keras.Sequential(layers)
    if build:
        model.build((None, 3))
    return model


def train_step(model: keras.Model, opt: keras.optimizers.Optimizer) -> float:
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(X, training=True) - Y) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return float(loss)


def values(variables) -> list[np.ndarray]:
    return [np.array(v.numpy()) for v in variables]


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
        for x, y in zip(a, b, strict=True))


_KILLED_AFTER_SAVE = r"""
import os, signal, sys, time
os.environ["KERAS_BACKEND"] = "tensorflow"
import numpy as np, tensorflow as tf
from pitstop.adapters.tf import Checkpoint, CheckpointManager
n, kept = int(sys.argv[1]), []
for directory in sys.argv[2:]:
    v = tf.Variable(np.arange(n, dtype=np.float32))
    mgr = CheckpointManager(Checkpoint(v=v), directory, max_to_keep=2, memory_tier=True)
    mgr.save(); mgr.sync()
    mgr._mgr.hooks["before_write"] = lambda step: time.sleep(60)  # the commit never comes
    v.assign_add(tf.ones_like(v))
    print(mgr.save(), flush=True)
    kept.append(mgr)
os.kill(os.getpid(), signal.SIGKILL)
"""


def killed_after_save(directory: str, n: int) -> str:
    """Run a job that saves ``v = arange(n)`` as ckpt-1, then ``v + 1`` as ckpt-2, and is
    SIGKILLed right after that save returned (its commit held back): ckpt-2 lives only in
    the memory tier. Returns the path the second save returned."""
    return killed_after_saves(n, directory)[0]


def killed_after_saves(n: int, *directories: str) -> list[str]:
    """:func:`killed_after_save` in each of ``directories`` (a manager each), by one job
    killed once after the last (one job for several tests: its start is most of its time).
    The paths the second saves returned."""
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[3])
    r = subprocess.run([sys.executable, "-c", _KILLED_AFTER_SAVE, str(n), *directories],
                       text=True, capture_output=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=root))
    assert r.returncode == -9, r.stdout + r.stderr
    paths = r.stdout.split()
    assert len(paths) == len(directories), r.stdout + r.stderr
    return paths


def leaf_keys(tree, prefix=""):
    """The key paths of a captured TensorFlow state tree's leaves (the object graph left out)."""
    from pitstop.adapters.tf import _graph

    for k, v in tree.items():
        if k == _graph.GRAPH:
            continue
        p = f"{prefix}/{k}" if prefix else k
        if isinstance(v, dict):
            yield from leaf_keys(v, p)
        else:
            yield p


def rel(path, directory):
    """``path`` relative to ``directory`` (None stays None): paths compared across peers."""
    return None if path is None else os.path.relpath(path, directory)


def settle(mgr):
    """A pitstop manager's writes made visible to another reader (tf.train's: nothing to do)."""
    from pitstop.adapters.tf import CheckpointManager

    if isinstance(mgr, CheckpointManager):
        mgr.sync()
