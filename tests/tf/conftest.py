"""Shared helpers for the TensorFlow adapter tests (Keras 3 on its TensorFlow backend)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
tf = pytest.importorskip("tensorflow")

import pitstop  # noqa: E402


@pytest.fixture
def manager(tmp_path: Path):
    """``manager()`` -> a CheckpointManager on a fresh directory (same dir on each call):
    synchronous saves, no signal handlers, no memory tier, so each test is self-contained."""
    made = []

    def make(**kwargs):
        opts = dict(save_on_signals=None, memory_tier=False, async_save=False)
        opts.update(kwargs)
        m = pitstop.CheckpointManager(tmp_path / "ckpt", **opts)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()
