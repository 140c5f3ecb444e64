"""torch adapter tests: torch or a skip. The ``manager`` fixture is in tests/conftest.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
