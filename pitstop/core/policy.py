"""When to save, and what to keep: small one-method policies with combinators.

A save policy answers ``should_save(step, ctx)`` cheaply on every training step (no
allocation, no file system access). A retention policy answers ``keep(checkpoints)`` with
the steps to keep. The manager combines what its keyword arguments ask for; users may pass
their own policy objects too.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pitstop.core.errors import InvalidArgumentError

log = logging.getLogger("pitstop")


def positive_int(name: str, value: Any) -> int:
    """``value`` as an int >= 1 (integral numpy scalars too); anything else is refused."""
    import operator
    if isinstance(value, (bool, float, str)) or value is None:
        raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}") from None
    if n < 1:
        raise InvalidArgumentError(f"{name} must be a positive integer, got {n}")
    return n


def positive_number(name: str, value: Any) -> float:
    """``value`` as a finite float > 0; anything else is refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value <= 0:
        raise InvalidArgumentError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def number_metric(name: str, value: Any) -> float:
    """The value of a metric that ranks checkpoints, as a float; anything but a real number
    (None, a string, a bool) is refused, naming the metric."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(
            f"metric {name!r} is {value!r}, but it ranks checkpoints (best_metric): pass a "
            "number, or leave it out of metrics on steps that have no value for it")
    return float(value)


# --------------------------------------------------------------------------- save policies
@dataclass
class SaveContext:
    """What a save policy may look at. Updated by the manager, never allocated per step."""

    last_save_step: int | None = None
    last_save_time: float = field(default_factory=time.monotonic)
    now: float = 0.0
    metrics: dict[str, Any] | None = None
    #: measured training time lost per save (seconds), for the automatic interval
    save_cost_s: float | None = None


class SavePolicy(Protocol):
    def should_save(self, step: int, ctx: SaveContext) -> bool: ...


class EveryNSteps:
    """Save when ``step`` is a multiple of ``n``."""

    def __init__(self, n: int) -> None:
        self.n = positive_int("save_every_steps", n)

    def should_save(self, step: int, ctx: SaveContext) -> bool:
        return step % self.n == 0 and step != ctx.last_save_step

    def __repr__(self) -> str:
        return f"EveryNSteps({self.n})"


class EverySeconds:
    """Save when at least ``seconds`` passed since the last save."""

    def __init__(self, seconds: float) -> None:
        self.seconds = positive_number("save_every_seconds", seconds)

    def should_save(self, step: int, ctx: SaveContext) -> bool:
        return ctx.now - ctx.last_save_time >= self.seconds

    def __repr__(self) -> str:
        return f"EverySeconds({self.seconds})"


class OnSteps:
    """Save at each of the given steps (Orbax's ``save_on_steps``); with
    ``save_every_steps`` too, the manager saves when either says so."""

    def __init__(self, steps: Any) -> None:
        if isinstance(steps, range):  # kept as it is: ``in`` is O(1), as in Orbax's container
            if steps and min(steps[0], steps[-1]) < 0:
                raise InvalidArgumentError(
                    f"OnSteps: every step must be an int >= 0, got {steps!r}")
            self.steps: range | frozenset[int] = steps
            return
        try:
            chosen = frozenset(steps)
        except TypeError:
            raise InvalidArgumentError(
                f"OnSteps takes a collection of steps, got {steps!r}") from None
        steps = set()
        for s in chosen:
            # numpy / JAX integers too (np.arange, as Orbax's save_on_steps takes them)
            n = None if isinstance(s, (bool, float, str)) else getattr(s, "__index__", None)
            if n is None or n() < 0:
                raise InvalidArgumentError(
                    f"OnSteps: every step must be an int >= 0, got {s!r}")
            steps.add(int(n()))
        self.steps = frozenset(steps)

    def should_save(self, step: int, ctx: SaveContext) -> bool:
        return step in self.steps and step != ctx.last_save_step

    def __repr__(self) -> str:
        if isinstance(self.steps, range):
            return f"OnSteps({self.steps!r})"
        return f"OnSteps({sorted(self.steps)})"


class OnImprovement:
    """Save when ``metric`` improves on the best value seen so far (min or max)."""

    def __init__(self, metric: str, mode: str = "min", best: float | None = None) -> None:
        if mode not in ("min", "max"):
            raise InvalidArgumentError("best_mode must be 'min' or 'max'")
        self.metric, self.mode, self.best = metric, mode, best

    def should_save(self, step: int, ctx: SaveContext) -> bool:
        if not ctx.metrics or self.metric not in ctx.metrics:
            return False
        v = number_metric(self.metric, ctx.metrics[self.metric])
        return math.isfinite(v) and self._better(v)

    def saved(self, step: int, ctx: SaveContext) -> None:
        """A snapshot was taken: its metric is the one to beat. (Not in ``should_save``: an
        improvement whose save was skipped, e.g. while busy, must still count as one.)"""
        if ctx.metrics and self.metric in ctx.metrics:
            v = number_metric(self.metric, ctx.metrics[self.metric])
            if math.isfinite(v) and self._better(v):
                self.best = v

    def _better(self, v: float) -> bool:
        return self.best is None or (v < self.best if self.mode == "min" else v > self.best)

    def __repr__(self) -> str:
        return f"OnImprovement({self.metric!r}, {self.mode!r})"


class AutoInterval:
    """The Young/Daly optimum: save every sqrt(2 x save cost x MTBF) seconds.

    The save cost is the measured training time lost per save (the stall plus the
    slowdown until commit), so the interval adapts as saves get cheaper or dearer.
    """

    def __init__(self, mtbf_seconds: float, min_interval_s: float = 1.0) -> None:
        self.mtbf = positive_number("mtbf_seconds", mtbf_seconds)
        self.min_interval_s = min_interval_s
        self.interval_s: float | None = None
        self._logged: float | None = None

    def update(self, cost_s: float) -> None:
        interval = max(self.min_interval_s, math.sqrt(2.0 * max(cost_s, 1e-6) * self.mtbf))
        self.interval_s = interval
        if self._logged is None or abs(interval - self._logged) > 0.25 * self._logged:
            log.info("pitstop: automatic save interval %.1f s (Young/Daly: save cost %.3f s, "
                     "MTBF %.0f s)", interval, cost_s, self.mtbf)
            self._logged = interval

    def should_save(self, step: int, ctx: SaveContext) -> bool:
        if self.interval_s is None:
            return True  # the first save (also after a restart) measures the cost
        return ctx.now - ctx.last_save_time >= self.interval_s

    def __repr__(self) -> str:
        return f"AutoInterval(mtbf={self.mtbf}, interval={self.interval_s})"


class AnyOf:
    """Save when any of the policies says so (each is asked, so stateful ones stay current)."""

    def __init__(self, *policies: SavePolicy) -> None:
        self.policies = [p for p in policies if p is not None]

    def should_save(self, step: int, ctx: SaveContext) -> bool:
        decision = False
        for p in self.policies:
            if p.should_save(step, ctx):
                decision = True
        return decision

    def saved(self, step: int, ctx: SaveContext) -> None:
        """Tell the policies that keep state that a save's snapshot was taken."""
        for p in self.policies:
            hook = getattr(p, "saved", None)
            if hook is not None:
                hook(step, ctx)

    def __repr__(self) -> str:
        return f"AnyOf({', '.join(map(repr, self.policies))})"


# --------------------------------------------------------------------------- retention
@dataclass(frozen=True)
class CheckpointInfo:
    """What retention knows of one committed checkpoint (kept in the directory's index)."""

    step: int
    metrics: dict[str, Any]
    ours: bool = True
    all_finite: bool | None = None
    protected: bool = False
    #: the older steps whose data this incremental checkpoint references (None: not known
    #: yet, an index written before references; read from the manifest)
    refs: tuple[int, ...] | None = ()


class RetentionPolicy(Protocol):
    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]: ...


class KeepLast:
    def __init__(self, n: int) -> None:
        self.n = positive_int("keep_last", n)

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        return {c.step for c in sorted(checkpoints, key=lambda c: c.step)[-self.n:]}


class KeepEverySteps:
    def __init__(self, k: int) -> None:
        self.k = positive_int("keep_every_steps", k)

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        return {c.step for c in checkpoints if c.step % self.k == 0}


class KeepBest:
    def __init__(self, n: int, metric: str, mode: str = "min") -> None:
        n = positive_int("keep_best", n)
        if mode not in ("min", "max"):
            raise InvalidArgumentError("best_mode must be 'min' or 'max'")
        self.n, self.metric, self.mode = n, metric, mode

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        scored = []
        for c in checkpoints:
            v = c.metrics.get(self.metric)
            if isinstance(v, (int, float)) and math.isfinite(v):
                scored.append((v if self.mode == "min" else -v, -c.step, c.step))
        return {s for _, _, s in sorted(scored)[: self.n]}


class KeepAll:
    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        return {c.step for c in checkpoints}


def to_delete(checkpoints: Sequence[CheckpointInfo], policies: Sequence[RetentionPolicy],
              protect: set[int] = frozenset()) -> list[int]:  # type: ignore[assignment]
    """Steps retention may delete: ours, not kept by any policy, never the newest, never the
    newest all-finite one, never a protected one."""
    if not policies or not checkpoints:
        return []
    mine = [c for c in checkpoints if c.ours]
    keep: set[int] = set(protect)
    for p in policies:
        keep |= p.keep(mine)
    keep.add(max(c.step for c in checkpoints))
    if mine:  # our own newest too, even when a foreign checkpoint has a higher step
        keep.add(max(c.step for c in mine))
    finite = [c.step for c in checkpoints if c.all_finite]
    if finite:
        keep.add(max(finite))
    keep |= {c.step for c in checkpoints if c.protected}
    return sorted(c.step for c in mine if c.step not in keep)
