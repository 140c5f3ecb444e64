"""Several processes (ranks) saving one checkpoint together, on the framework's own groups.

A :class:`Coordinator` is the only thing the core needs of a distributed job: all-gathers of
small byte strings, with timeouts, on two channels that never interleave: ``"control"`` (the
training thread: whether a step saves, which step a restore takes) and ``"persist"`` (the
engine's background thread: the two-phase commit). The adapters implement it on the
framework's engines (``torch.distributed`` process groups, the JAX coordination service).

A multi-rank save, as the engine runs it on every rank:

1. each rank hashes its snapshot, then all ranks exchange what they hold (key, size, hash);
   every rank computes the same :func:`plan`: each distinct stored value gets one writer
   (replicated state is written once, by ranks in turn; a shard by a rank that holds it);
2. each rank writes and fsyncs its part into the leader's (rank 0's) temporary checkpoint;
3. all ranks exchange their entries; rank 0 checks them (every shard of every sharded array
   is there), writes the manifest and publishes; all ranks learn the outcome.

A rank that fails or dies at any point means the checkpoint is not committed, and the
others get a :class:`CoordinationError` (a peer that stops answering, after ``timeout_s``).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from pitstop.core.errors import CheckpointError
from pitstop.core.format.schema import SHARD_MARK


class CoordinationError(CheckpointError):
    """The ranks of a distributed job could not agree (a rank died, timed out, or called
    pitstop differently from the others)."""


class Coordinator(ABC):
    """The collectives a multi-rank manager needs; every rank calls them in the same order."""

    #: this process's rank and the number of ranks
    rank: int
    world_size: int
    #: seconds a collective waits for the slowest rank before it fails
    timeout_s: float

    @abstractmethod
    def all_gather(self, data: bytes, *, what: str, channel: str = "control") -> list[bytes]:
        """Every rank's ``data``, indexed by rank. ``what`` names the exchange in errors;
        ``channel`` is ``"control"`` (training thread) or ``"persist"`` (engine thread)."""

    def close(self) -> None:
        """Release what the coordinator made (its groups); called by ``manager.close()``."""
        return None

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def all_gather_json(self, obj: Any, *, what: str, channel: str = "control",
                        op: str = "") -> list[Any]:
        """:meth:`all_gather` of JSON documents (never pickle: a rank's bytes are data).
        ``op`` names the call: ranks in different calls get a :class:`CoordinationError`."""
        raw = self.all_gather(json.dumps([op, obj], separators=(",", ":")).encode(),
                              what=what, channel=channel)
        try:
            docs = [json.loads(b) for b in raw]
            ops = [d[0] for d in docs]
        except (ValueError, TypeError, IndexError, KeyError) as e:
            raise CoordinationError(f"{what}: a rank sent an unreadable answer ({e})") from None
        if len(set(ops)) > 1:
            said = ", ".join(f"rank {r}: {o or '?'}" for r, o in enumerate(ops))
            raise CoordinationError(
                f"{what}: the ranks called pitstop differently ({said}); every rank must make "
                "the same calls (managers, step, save, restore, delete) in the same order")
        return [d[1] for d in docs]

    def all_gather_ints(self, values: list[int], *, what: str,
                        channel: str = "control") -> list[list[int]]:
        """Every rank's ``values`` (the same count on every rank): the per-step agreement,
        which a backend makes one small collective."""
        return [list(map(int, v)) for v in self.all_gather_json(values, what=what,
                                                                channel=channel, op="step")]

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size}"


@dataclass(frozen=True)
class Holding:
    """One stored value a rank holds: its key (a piece key for a shard), size and hash."""

    key: str
    nbytes: int
    hash: str


def plan(held: list[list[Holding]]) -> tuple[list[set[str]], dict[tuple[str, str], int]]:
    """Who writes what, computed identically on every rank from everyone's holdings.

    Each distinct ``(key, hash)`` is written once, by one rank that holds it; ranks take
    consecutive runs in the holders' order until they have their share of the bytes, so
    replicated state (DDP) is split evenly and each rank's part stays contiguous. Returns
    the keys each rank writes, and the writer of each ``(key, hash)``.
    """
    world = len(held)
    order: list[tuple[str, str, int]] = []
    holders: dict[tuple[str, str], list[int]] = {}
    for r, items in enumerate(held):
        for h in items:
            blob = (h.key, h.hash)
            who = holders.get(blob)
            if who is None:
                holders[blob] = [r]
                order.append((h.key, h.hash, h.nbytes))
            else:
                who.append(r)
    total = sum(n for _k, _h, n in order)
    share = total / world if world else 0
    load = [0] * world
    writes: list[set[str]] = [set() for _ in range(world)]
    writer: dict[tuple[str, str], int] = {}
    last = -1
    for key, digest, n in order:
        who = holders[(key, digest)]
        if last in who and load[last] + n / 2 <= share:
            r = last
        else:
            r = min(who, key=lambda x: (load[x], x))
        load[r] += n
        writes[r].add(key)
        writer[(key, digest)] = r
        last = r
    return writes, writer


def is_piece(key: str) -> bool:
    return SHARD_MARK in key
