"""Helpers shared by the Keras tests."""

from __future__ import annotations

import pytest


def on_backends(*names: str):
    """Run a slow (multi-process) test on these backends only: the Keras folder runs once
    per backend, and such tests are spread across the runs to keep the suite short, with
    the core promise on each: one of tests/adapters/keras/test_backup_and_restore.py's SIGKILL
    resume cases runs on each backend."""
    import keras

    return pytest.mark.skipif(keras.backend.backend() not in names,
                              reason=f"spread across backends: runs on {', '.join(names)}")


def weights_of(model) -> list:
    """The model's weights as numpy arrays."""
    import keras
    import numpy as np

    return [np.array(keras.ops.convert_to_numpy(v)) for v in model.weights]


def h5_tree(source) -> dict:
    """Every group and dataset of an HDF5 file: path -> (attrs, value bytes or None)."""
    import h5py

    out = {}
    with h5py.File(source, "r") as f:
        def visit(name, obj):
            attrs = {k: str(v) for k, v in obj.attrs.items()}
            out[name] = (attrs, obj[()].tobytes() if isinstance(obj, h5py.Dataset) else None)
        f.visititems(visit)
    return out
