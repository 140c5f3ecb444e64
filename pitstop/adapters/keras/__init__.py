"""Keras 3 support, on the TensorFlow, JAX and PyTorch backends alike.

>>> from pitstop.adapters.keras import ModelCheckpoint, BackupAndRestore  # was: keras.callbacks
>>> model.fit(x, y, epochs=10, callbacks=[ModelCheckpoint("ckpt/{epoch:02d}.keras"),
...                                       BackupAndRestore("backup", save_freq=100)])

``ModelCheckpoint`` takes Keras's arguments and writes Keras's files, from an in-memory
snapshot in the background, atomically, with an integrity record beside each file.
``BackupAndRestore`` takes Keras's arguments and resumes a ``fit()`` interrupted anywhere,
mid-epoch included, exactly: same batches, same dropout masks, same losses, bitwise-equal
weights. Keras models, layers, optimizers, metrics and ``keras.random.SeedGenerator`` also go
straight into :class:`pitstop.CheckpointManager`'s state.
"""

from __future__ import annotations

import keras

from pitstop.adapters.keras._adapter import KerasAdapter, writer_info
from pitstop.adapters.keras._leaf import KerasVariableLeaf
from pitstop.core.adapter import Plugin, register

if keras.backend.backend() == "torch":
    # a Keras layer is a torch.nn.Module there: load the torch adapter first, so that the
    # Keras adapter, registered in front of it, is the one asked about Keras objects
    from pitstop.adapters import torch as _torch  # noqa: F401

from pitstop.adapters.keras.backup_and_restore import (  # noqa: E402
    BackupAndRestore,
    FitStateAdapter,
)
from pitstop.adapters.keras.files import verify_file  # noqa: E402
from pitstop.adapters.keras.model_checkpoint import ModelCheckpoint  # noqa: E402

register(Plugin("keras", modules=("keras",), adapters=(FitStateAdapter(), KerasAdapter()),
                writer_info=writer_info))

__all__ = ["ModelCheckpoint", "BackupAndRestore", "KerasVariableLeaf", "verify_file"]
