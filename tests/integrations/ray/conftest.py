"""Ray Train integration tests: ray and torch, or a skip; this folder on sys.path (the
training loop the workers run is a module here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("ray.train")

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
