"""A :class:`~pitstop.core.manager.CheckpointManager` in a job of several ranks: the ranks
agree at each step boundary, delete together and restore the same step together. A part of
the manager (a mixin), kept apart so that the manager's face stays short."""

from __future__ import annotations

import json
import logging
import time
import warnings
from collections.abc import Mapping
from typing import Any

from pitstop.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedFormatError,
)
from pitstop.core.restore.read import RestoreReport
from pitstop.core.runtime.coordination import CoordinationError, Coordinator
from pitstop.core.save.engine import Engine, SaveHandle
from pitstop.core.tree import FlatState

log = logging.getLogger("pitstop")


class Ranks:
    """The manager's half for several ranks (see :class:`~pitstop.core.manager.CheckpointManager`)."""

    def _step_world(self, engine: Engine, step: int, state: Any,
                    metrics: Mapping[str, Any] | None, clean: dict[str, Any] | None
                    ) -> SaveHandle | None:
        """``step()`` of one rank: the ranks decide together, so all save the same steps."""
        want = False
        if self._policy is not None:
            ctx = self._ctx
            ctx.now = time.monotonic()
            ctx.metrics = clean or None
            want = self._policy.should_save(step, ctx)
        exists = step in self._catalog.index or step in engine.pending_steps()
        busy = want and self.on_busy != "wait" and not self.pool.can_acquire()
        # (bit 1: the step exists on a rank; bit 2: a rank's buffers are all persisting)
        want, problem, signal = self._agree(step, want, int(exists) | 2 * int(busy), "step")
        if signal:  # (one that arrives after the exchange is acted on at the next step)
            return self._handle_signal(step, state, metrics)
        if not want:
            return None
        if problem & 1:
            log.info("pitstop: step %d not saved: it exists already on a rank", step)
            return None
        if problem:  # every rank skips it together, and says so
            self._skipped(step, world=True)
            return None
        with self._api_lock:
            return self._save(step, state, metrics, block=True, periodic=True)

    def _delete_world(self, step: int, coord: Coordinator) -> None:
        """``delete(step)`` on every rank: the leader deletes, the others forget the step."""
        where = f"delete({step}) in {self.directory}"
        steps = coord.all_gather_json(step, what=where, op="delete")
        if len(set(steps)) > 1:
            raise CoordinationError(
                f"delete() was called for different steps on the ranks ({steps}); nothing "
                "was deleted")
        error: CheckpointError | None = None
        if coord.leader:
            try:
                if step not in self._committed(hidden=True):
                    raise CheckpointNotFoundError(
                        f"no checkpoint of step {step} in {self.directory}")
                self._catalog.delete(step)
            except CheckpointError as e:
                error = e
        lead = coord.all_gather_json(None if error is None else str(error), what=where,
                                     op="deleted")[0]
        if error is not None:
            raise error
        if lead:
            raise CheckpointError(f"rank 0 could not delete step {step}: {lead}")
        if not coord.leader:
            self._catalog.forget(step)
        self._recovered_all = self._res.recovered = [
            r for r in self._recovered_all if r.step != step]

    def _restore_world(self, flat: FlatState, step: int | None, strict: bool,
                       coord: Coordinator) -> tuple[int | None, RestoreReport | None]:
        """The restore of one rank: every rank restores the same step. A checkpoint that any
        rank finds corrupt (or unreadable) is given up by all of them, which then take the
        previous one together; any other refusal stops every rank."""
        asked = coord.all_gather_json([step, self._committed(hidden=step is not None)],
                                      what=f"restoring from {self.directory}", op="restore")
        if len({json.dumps(a[0]) for a in asked}) > 1:
            wanted = ", ".join(f"rank {r}: {'the newest' if a[0] is None else f'step {a[0]}'}"
                               for r, a in enumerate(asked))
            raise CoordinationError(
                f"restore() from {self.directory} asked for different steps on the ranks "
                f"({wanted}); nothing was restored. Every rank must resume from the same step")
        lead = asked[0][1]
        if step is not None and step not in lead:
            raise CheckpointNotFoundError(
                f"no checkpoint of step {step} in {self.directory} (have: {lead[-10:]})")
        corrupt = linked = 0
        for s in [step] if step is not None else reversed(lead):
            outcome, report = "ok", None
            error: CheckpointError | None = None
            told: list[bool] = [False]

            def checked(problem: CheckpointError | None, s: int = s,
                        told: list[bool] = told) -> None:
                """Every rank's checks done: a refusal anywhere stops all before a byte is
                written."""
                told[0] = True
                said = coord.all_gather_json(
                    None if problem is None else [_kind_of(problem), str(problem)],
                    op="restore-check", what=f"restoring step {s} from {self.directory}")
                others = [(r, p) for r, p in enumerate(said) if p and r != coord.rank]
                if problem is None and others:
                    err = CoordinationError(
                        f"restoring step {s} from {self.directory}: nothing was restored, "
                        "because " + "; ".join(f"rank {r}: {p[1]}" for r, p in others))
                    err.other_rank = True  # type: ignore[attr-defined]
                    raise err

            try:
                try:
                    report = self._restore_one(s, flat, strict, checked, newest=True)
                except CheckpointError as e:
                    if not told[0]:
                        checked(e)  # failed before its checks: the others learn it there
                    raise
            except CoordinationError as e:
                outcome, error = "skipped" if getattr(e, "other_rank", False) else "refused", e
            except CorruptCheckpointError as e:
                outcome, error = "linked" if e.linked else "corrupt", e
            except UnsupportedFormatError as e:
                outcome, error = "newer", e
            except CheckpointError as e:
                outcome, error = "refused", e
            said = coord.all_gather_json([outcome, None if error is None else str(error)],
                                         op="restore-step",
                                         what=f"restoring step {s} from {self.directory}")
            bad = [(r, o, why) for r, (o, why) in enumerate(said) if o not in ("ok", "skipped")]
            if not bad:
                return s, report
            text = "; ".join(f"rank {r}: {why}" for r, _o, why in bad)
            if step is not None or any(o == "refused" for _r, o, _w in bad):
                if error is not None:
                    raise error
                raise CoordinationError(
                    f"the restore of step {s} from {self.directory} failed on other ranks "
                    f"({text}); every rank of a job must resume from the same step")
            msg = (f"pitstop: checkpoint {self._path(s)} could not be restored on every rank "
                   f"({text}); all ranks fall back to the previous one")
            log.error(msg)
            warnings.warn(msg, stacklevel=4)
            if any(o == "linked" for _r, o, _w in bad):
                linked += 1  # a file with a second name: refused, left in place
            elif any(o == "corrupt" for _r, o, _w in bad):
                corrupt += 1
                if coord.leader:
                    self._quarantine(s)
                else:
                    self._catalog.forget(s)  # the leader moves it aside
        if corrupt or linked:
            raise CorruptCheckpointError(
                f"no valid checkpoint in {self.directory}: {corrupt + linked} failed "
                "verification on a rank" + (
                    f"; {linked} hold a file with a second name (a hard link): left in place, "
                    "not moved aside. Break the links (remove the linked copy, or replace it "
                    "with one made by cp -a) and restore() again" if linked else
                    " (moved aside); restore() again starts from scratch"),
                checkpoint=self.directory)
        return None, None

    def _agree(self, step: int, want: bool, problem: int, call: str
               ) -> tuple[bool, int, int]:
        """Every rank's view of this step boundary: whether any wants to save, the problems
        of any rank (bits OR-ed: 1 the step exists, 2 its buffers are busy; 0: none), and
        the signal to act on now (0: none): one any rank had
        received when it called, which becomes every rank's, so all of them save at this
        step and then act on it."""
        coord = self._coord
        assert coord is not None
        signal = self._signals.pending or 0
        said = coord.all_gather_ints([step, int(want), signal, int(problem)],
                                     what=f"{call}({step}) in {self.directory}")
        steps = [a[0] for a in said]
        if len(set(steps)) > 1:
            raise CoordinationError(
                f"{call}() was called with different steps on the ranks ("
                + ", ".join(f"rank {r}: {x}" for r, x in enumerate(steps))
                + f") in {self.directory}; every rank must call it with the same step, in "
                "the same order")
        signal = max(a[2] for a in said)
        if signal and self._signals.pending is None:
            self._signals.pending = signal  # received by another rank: acted on here too
        problems = 0
        for a in said:
            problems |= a[3]
        return any(a[1] for a in said), problems, signal


def _kind_of(e: CheckpointError) -> str:
    return "corrupt" if isinstance(e, CorruptCheckpointError) else \
        "newer" if isinstance(e, UnsupportedFormatError) else "refused"
