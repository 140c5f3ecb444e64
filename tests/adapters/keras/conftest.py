"""Keras 3 adapter tests, on the backend ``KERAS_BACKEND`` names (tests/test_isolated_suites.py
runs this folder once per backend, each in its own process), or a skip."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
keras = pytest.importorskip("keras")
pytest.importorskip({"jax": "jax", "torch": "torch", "tensorflow": "tensorflow"}.get(
    os.environ["KERAS_BACKEND"], os.environ["KERAS_BACKEND"]))


def pytest_configure(config) -> None:
    # markers of Keras's own test files, run here against pitstop's classes
    config.addinivalue_line("markers", "requires_trainable_backend: Keras's own marker")

