"""TensorFlow support: tf.train's Checkpoint and CheckpointManager with one import changed,
and TensorFlow objects straight in the state you give pitstop's own manager.

>>> from pitstop.adapters.tf import Checkpoint, CheckpointManager   # was: tf.train
>>> ckpt = Checkpoint(model=model, optimizer=opt, step=step)
>>> manager = CheckpointManager(ckpt, "/runs/a", max_to_keep=3)
>>> manager.restore_or_initialize()

>>> state = {"model": model, "opt": optimizer, "gen": tf.random.Generator.from_seed(0),
...          "data": iter(dataset), "step": tf.Variable(0, dtype=tf.int64)}
>>> start = mgr.restore(state)               # None on a fresh run

Every trackable object (``tf.train.Checkpoint``, ``tf.Module``, Keras 3 models, layers and
optimizers on the TensorFlow backend, ``tf.random.Generator``, ``tf.data`` iterators) is saved
as the object graph ``tf.train.Checkpoint`` would save, keyed as TensorFlow keys it, and
restored by TensorFlow's matching rules, values for objects created later included. Variables
of every dtype (bfloat16 too) are read at the snapshot and assigned on restore; a ``tf.data``
iterator's opaque state is kept as bytes. This module is imported by the adapter registry the
first time a TensorFlow object shows up in a state.
"""

from __future__ import annotations

from pitstop.adapters.tf import _rng
from pitstop.adapters.tf._adapter import TensorHint, TrackableAdapter, VariableAdapter
from pitstop.adapters.tf._leaf import VariableLeaf
from pitstop.adapters.tf._runs import NotFoundError
from pitstop.adapters.tf.checkpoint import Checkpoint, CheckpointLoadStatus
from pitstop.adapters.tf.manager import CheckpointManager, latest_checkpoint
from pitstop.core.adapter import Plugin, RNGProvider, register

register(Plugin(
    "tf", modules=("tensorflow",),
    adapters=(TensorHint(), TrackableAdapter(), VariableAdapter()),
    rng=RNGProvider("tensorflow", "tensorflow", _rng.get_state, _rng.set_state)))

__all__ = ["Checkpoint", "CheckpointManager", "CheckpointLoadStatus", "latest_checkpoint",
           "NotFoundError", "VariableLeaf"]
