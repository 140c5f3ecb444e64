"""Reliability scenarios: each promise pitstop makes, tried a counted number of times.

Every scenario module exposes ``SCENARIOS``: name -> ``run(trials, seed, workdir) -> Result``.
A scenario never raises on a broken promise; it counts it as a failure and keeps a short
description (with the seed and trial), so a full run reports every failure it met.
``benchmarks/torture.py`` runs them all at full count; ``tests/reliability`` at a reduced one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path


@dataclasses.dataclass
class Result:
    """The counts of one scenario run: how many trials, how many broke a promise, and why."""

    scenario: str
    trials: int = 0
    failures: int = 0
    details: list[str] = dataclasses.field(default_factory=list)
    #: scenario-specific counts that show the trials really exercised something
    #: (commits seen, kills mid-save, fallbacks taken, ...)
    counts: dict[str, int] = dataclasses.field(default_factory=dict)

    def fail(self, detail: str) -> None:
        """Count one broken promise; keep the first few descriptions."""
        self.failures += 1
        if len(self.details) < 20:
            self.details.append(detail)

    def bump(self, name: str, by: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + by

    def line(self) -> str:
        """``scenario: trials, failures`` as the torture command prints it."""
        extra = "".join(f", {k} {v}" for k, v in sorted(self.counts.items()))
        return f"{self.scenario}: {self.trials} trials, {self.failures} failures{extra}"


Scenario = Callable[[int, int, Path], Result]
