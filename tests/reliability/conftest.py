"""The reliability tests run the scenarios of ``benchmarks/reliability`` at a reduced count:
the repository root must be importable for ``benchmarks.reliability``."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
