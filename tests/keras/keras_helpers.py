"""Helpers shared by the Keras tests."""

from __future__ import annotations

import pytest


def on_backends(*names: str):
    """Run a slow (multi-process) test on these backends only: the Keras folder runs once
    per backend, and such tests are spread across the runs to keep the suite short, with
    the core promise (tests/keras/test_backup_and_restore.py's SIGKILL resume) on all."""
    import keras

    return pytest.mark.skipif(keras.backend.backend() not in names,
                              reason=f"spread across backends: runs on {', '.join(names)}")
