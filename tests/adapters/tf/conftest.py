"""TensorFlow adapter tests: TensorFlow (Keras 3 on its TensorFlow backend) or a skip. The
``manager`` fixture is in tests/conftest.py."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
tf = pytest.importorskip("tensorflow")
