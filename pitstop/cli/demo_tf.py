"""The TensorFlow trainer of ``pitstop demo``: a 2-layer MLP as a ``tf.Module``, SGD with
momentum and a decaying learning rate in a ``tf.function``, data and dropout masks from a
``tf.random.Generator`` every step. pitstop's manager saves the same objects
``tf.train.Checkpoint`` would (pitstop.adapters.tf); the peer is ``tf.train.Checkpoint.write``."""

from __future__ import annotations

from typing import Any

import numpy as np

from pitstop.cli.demo import ChildRun

D_IN, HIDDEN, D_OUT, BATCH = 256, 1024, 64, 64
PARAMS = D_IN * HIDDEN + HIDDEN + HIDDEN * D_OUT + D_OUT
DESCRIPTION = (f"a TensorFlow MLP (tf.Module, {PARAMS / 1e6:.2f} M parameters, dropout), SGD + "
               "momentum with a decaying learning rate, batches and dropout masks from a "
               "seeded tf.random.Generator every step")
PEER = ("tf.train.Checkpoint.write", "the same objects to one checkpoint, synchronous")


def state_mib(steps: int) -> float:
    return (2 * PARAMS * 4 + steps * 8) / 2**20


def train(c: ChildRun) -> int:
    """One training run; with a checkpoint directory it resumes from it when it can."""
    import tensorflow as tf

    import pitstop.adapters.tf  # noqa: F401  (TensorFlow objects in pitstop's state)

    tf.config.experimental.enable_op_determinism()
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    init = np.random.default_rng(c.seed)
    teacher = tf.constant(init.standard_normal((D_IN, D_OUT)).astype(np.float32) / 16)

    class MLP(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            s1, s2 = 1 / np.sqrt(D_IN), 1 / np.sqrt(HIDDEN)
            self.w1 = tf.Variable(init.uniform(-s1, s1, (D_IN, HIDDEN)).astype(np.float32),
                                  name="w1")
            self.b1 = tf.Variable(tf.zeros(HIDDEN), name="b1")
            self.w2 = tf.Variable(init.uniform(-s2, s2, (HIDDEN, D_OUT)).astype(np.float32),
                                  name="w2")
            self.b2 = tf.Variable(tf.zeros(D_OUT), name="b2")

    class Momentum(tf.Module):
        def __init__(self, model: MLP) -> None:
            super().__init__()
            self.velocity = [tf.Variable(tf.zeros_like(v)) for v in model.trainable_variables]
            self.iterations = tf.Variable(0, dtype=tf.int64)

    model = MLP()
    params = list(model.trainable_variables)
    opt = Momentum(model)
    gen = tf.random.Generator.from_seed(c.seed + 1)
    losses = np.zeros(c.steps, np.float64)
    state: dict[str, Any] = {"model": model, "optimizer": opt, "rng": gen, "losses": losses}
    mgr = c.manager()
    restored = None
    if mgr is not None:
        restored = mgr.restore(state)
        if restored is not None and c.wrong_resume:  # on purpose: forget the random stream
            gen.reset_from_seed(c.seed + 99)
    start = c.restored(restored)

    @tf.function
    def train_step() -> tf.Tensor:
        x = gen.normal((BATCH, D_IN))
        y = tf.tanh(x @ teacher) + 0.01 * gen.normal((BATCH, D_OUT))
        keep = tf.cast(gen.uniform((BATCH, HIDDEN)) > 0.1, tf.float32) / 0.9
        with tf.GradientTape() as tape:
            h = tf.nn.gelu(x @ model.w1 + model.b1) * keep
            loss = tf.reduce_mean(tf.square(h @ model.w2 + model.b2 - y))
        grads = tape.gradient(loss, params)
        lr = 0.05 * 0.99 ** tf.cast(opt.iterations, tf.float32)
        for p, v, g in zip(params, opt.velocity, grads, strict=True):
            v.assign(0.9 * v + g)
            p.assign_sub(lr * v)
        opt.iterations.assign_add(1)
        return loss

    peer = tf.train.Checkpoint(model=model, optimizer=opt, rng=gen,
                               losses=tf.Variable(losses))

    def peer_save(path: str) -> None:
        peer.losses.assign(losses)
        peer.write(path + "/ckpt")

    for step in range(start, c.steps):
        losses[step] = float(train_step())
        c.end_of_step(step, mgr, state, float(losses[step]), peer_save)
    names = [v.name.split(":")[0] for v in params]
    arrays = {f"model.{n}": v.numpy() for n, v in zip(names, params, strict=True)}
    arrays.update({f"optimizer.velocity.{n}": v.numpy()
                   for n, v in zip(names, opt.velocity, strict=True)})
    arrays["rng"] = gen.state.numpy()
    arrays["losses"] = losses
    return c.finish(mgr, arrays)
