"""Hugging Face Trainer integration tests: transformers (and torch) or a skip; this folder on
sys.path, so its tests share hf_helpers.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))
