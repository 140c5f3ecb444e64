"""Multi-rank saves on ``torch.distributed``: the ranks' agreement runs on the job's own
process group, through two gloo groups of pitstop's own.

Why groups of its own: the engine's commit runs on a background thread while training runs
its collectives (NCCL all-reduces of DDP/FSDP) on the default group; collectives of two
threads on one group would interleave differently on different ranks. gloo works on host
memory (pitstop exchanges a few kilobytes of JSON, never tensors of the state) and honours
a timeout, so a rank that died or hangs becomes an error on the others, not a hang.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist

from pitstop.core.errors import InvalidArgumentError
from pitstop.core.runtime.coordination import CoordinationError, Coordinator

log = logging.getLogger("pitstop")

#: how long a rank waits for the others in one exchange by default (the slowest rank's
#: write of its part of a save is inside one)
DEFAULT_TIMEOUT_S = 600.0
#: while the ranks make their coordinators: a warning after this wait, checks this often
_MEET_WARN_S = 30.0
_MEET_SLICE_S = 5.0
#: coordinators made in this process (every rank makes them in the same order)
_made = 0
#: what an exchange's kind says a rank was doing (for the error when ranks differ)
_KINDS = {1: "a step()/save() boundary", 2: "an exchange of data"}


def _gloo_reason(e: BaseException) -> str:
    """gloo's message without its source location and advice: "Connection closed by peer
    [127.0.0.1]:7841", "Timed out waiting 20000ms for recv operation to complete"."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically")[0].rstrip(".")


class ProcessGroupCoordinator(Coordinator):
    """The ranks of ``group`` (the default group when None) as pitstop's coordinator.

    Construct it, like the manager that uses it, on every rank of the default group, in
    the same order: making process groups is a collective call."""

    def __init__(self, group: Any = None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise InvalidArgumentError(
                "torch.distributed is not initialized in this process; call "
                "torch.distributed.init_process_group(...) before making the CheckpointManager")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or \
                timeout_s <= 0:
            raise InvalidArgumentError(f"timeout_s must be a positive number of seconds, got "
                                       f"{timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        ranks = None if group is None else dist.get_process_group_ranks(group)
        self._meet(ranks)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            self._groups = {c: dist.new_group(ranks, timeout=timeout, backend="gloo")
                            for c in ("control", "persist")}
        except (RuntimeError, ValueError) as e:
            raise CoordinationError(
                f"cannot make pitstop's gloo groups on {self.describe()} ({e}); pitstop needs "
                "the gloo backend (built into torch) next to the job's own") from e

    def _meet(self, ranks: list[int] | None) -> None:
        """Wait, through the job's store, until every rank makes its coordinator too: making
        the groups is a collective, which would hang for good where a manager is made on
        some ranks only (``if rank == 0: CheckpointManager(...)``, as with torch.save)."""
        global _made
        _made += 1
        try:
            store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, ValueError, AttributeError):
            return  # no store to meet through: the group collective alone
        members = ranks if ranks is not None else list(range(dist.get_world_size()))
        me = dist.get_rank()
        prefix = f"pitstop/coordinator/{_made}/{'-'.join(map(str, members))}"
        keys = [f"{prefix}/{r}" for r in members]
        store.set(f"{prefix}/{me}", "1")
        waited = 0.0
        while True:
            step = min(_MEET_SLICE_S, self.timeout_s - waited)
            try:
                store.wait(keys, datetime.timedelta(seconds=step))
                return
            except (RuntimeError, dist.DistError):  # (DistStoreError on timeout)
                waited += step
            missing = [r for r, k in zip(members, keys, strict=True) if not store.check([k])]
            text = (f"rank {me} made a pitstop CheckpointManager with every rank of its job, "
                    f"but rank(s) {missing} have not made theirs")
            if waited >= self.timeout_s:
                _made -= 1  # as if never made: the ranks' next coordinators still meet
                raise CoordinationError(
                    f"{text} within {self.timeout_s:g} s. A manager of a multi-rank job is made "
                    "on every rank (each writes its part of the checkpoint). To save from "
                    "this rank alone, pass distributed=False (the other ranks' state is then "
                    "not saved)")
            if waited == _MEET_WARN_S:
                log.warning("pitstop: %s yet (waited %g s); it waits up to %g s. A manager made "
                            "on some ranks only waits here: pass distributed=False to save "
                            "from one rank alone", text, waited, self.timeout_s)

    def _head(self, kind: int, n: int, values: list[int], what: str, channel: str
              ) -> list[list[int]]:
        """The first collective of every exchange, of one shape whatever the call: its
        kind, a length and up to 6 integers per rank. Ranks in different calls then learn it
        here (gloo would abort the process on collectives of different sizes)."""
        group = self._groups.get(channel)
        if group is None:
            raise CoordinationError(f"{what}: the coordinator of {self.describe()} is closed")
        mine = torch.tensor([kind, n, *values, *[0] * (6 - len(values))], dtype=torch.int64)
        outs = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._run(lambda: dist.all_gather(outs, mine, group=group, async_op=True), what)
        heads = [o.tolist() for o in outs]
        if len({h[0] for h in heads}) > 1:
            said = ", ".join(f"rank {r}: {_KINDS.get(h[0], h[0])}" for r, h in enumerate(heads))
            raise CoordinationError(
                f"{what}: the ranks called pitstop differently ({said}); every rank must "
                "make the same calls (step, save, restore ...) in the same order")
        return heads

    def all_gather(self, data: bytes, *, what: str, channel: str = "control") -> list[bytes]:
        heads = self._head(2, len(data), [], what, channel)
        group = self._groups[channel]
        longest = max(1, max(h[1] for h in heads))
        mine = torch.zeros(longest, dtype=torch.uint8)
        if data:
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        outs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        self._run(lambda: dist.all_gather(outs, mine, group=group, async_op=True), what)
        return [bytes(o[:h[1]].numpy()) for o, h in zip(outs, heads, strict=True)]

    def all_gather_ints(self, values: list[int], *, what: str,
                        channel: str = "control") -> list[list[int]]:
        if len(values) > 6:
            return super().all_gather_ints(values, what=what, channel=channel)
        return [h[2:2 + len(values)] for h in self._head(1, len(values), values, what, channel)]

    def _run(self, start: Any, what: str) -> None:
        try:
            work = start()
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:  # gloo: a peer closed its connection, or the timeout
            raise CoordinationError(
                f"{what}: {self.describe()} lost the other ranks ({_gloo_reason(e)}): a rank "
                f"died, hangs (the wait is {self.timeout_s:g} s), or stopped calling pitstop "
                "in step with the others. Restart the job (every rank) to resume from the "
                "newest committed step") from e

    def close(self) -> None:
        groups, self._groups = self._groups, {}
        if not (dist.is_available() and dist.is_initialized()):
            return
        for g in groups.values():
            try:
                dist.destroy_process_group(g)
            except (RuntimeError, ValueError):  # the job tore the default group down already
                pass
