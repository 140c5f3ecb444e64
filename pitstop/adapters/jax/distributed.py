"""Multi-process saves on JAX: the ranks agree through the coordination service's key-value
store, which ``jax.distributed.initialize`` starts in process 0.

Why the key-value store and not a JAX collective: the engine's commit runs on a background
thread while training runs jitted computations; an XLA collective started from a second
thread would interleave differently on different processes (and needs arrays on devices).
The coordination service answers plain gRPC calls from any thread, holds a few kilobytes of
JSON per exchange, and every wait on it takes a deadline, so a rank that died or hangs
becomes a :class:`CoordinationError` on the others, not a hang.

An exchange (``all_gather``) is: each rank writes
``pitstop/<instance>/<channel>/<batch>/<seq>/<rank>``, takes the keys already there in one
call and waits for the missing ones, each wait at most what is left of ``timeout_s``. Rounds
are numbered per channel ("control" for the training thread, "persist" for the engine's
thread), so the two never mix; a step's agreement costs two or three calls to the service.
A rank that has read every key of round ``n + 1`` knows that every rank finished reading
round ``n`` (each wrote ``n + 1`` after it); so once the first round of a batch of rounds
is complete, the leader deletes the whole previous batch in one call, and
:meth:`JaxCoordinator.close` removes what is left once every rank has closed.

Instance ids line up across processes by construction order: each process counts the
coordinators it makes (per name), so the k-th manager made on every rank talks to the k-th
manager of the others. Every rank must therefore make its distributed CheckpointManagers in
the same order (as with ``torch.distributed.new_group``); a manager made on only some ranks
(an evaluation process's own) needs a name of its own::

    mgr = pitstop.CheckpointManager(dir, distributed=JaxCoordinator(name="eval"))

How a dead peer shows: with JAX's defaults the coordination service itself aborts the
surviving processes (SIGABRT) once the dead one missed its heartbeats
(``heartbeat_timeout_seconds`` of ``jax.distributed.initialize``; at once when process 0
died), whatever pitstop does: the save under way is never committed and the previous
checkpoint stays the newest. With ``jax.config.update("jax_enable_recoverability", True)``
set before ``initialize``, the survivors live on and pitstop's wait ends after ``timeout_s``
with a :class:`CoordinationError`.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from typing import Any

from pitstop.core.errors import InvalidArgumentError
from pitstop.core.runtime.coordination import CoordinationError, Coordinator

#: how long a rank waits for the others in one exchange by default (the slowest rank's
#: write of its part of a save is inside one), as for torch.distributed
DEFAULT_TIMEOUT_S = 600.0
#: the channels of :class:`pitstop.core.runtime.coordination.Coordinator`
CHANNELS = ("control", "persist")
#: the top of pitstop's keys in the coordination service's store
ROOT = "pitstop"

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")
#: coordinators made in this process, per name: the instance ids every rank computes alike
_made: Counter[str] = Counter()
_made_lock = threading.Lock()


def _client() -> Any:
    """The coordination-service client of ``jax.distributed.initialize``, or None."""
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover - a JAX without this module
        return None
    return getattr(distributed.global_state, "client", None)


def _reason(e: BaseException) -> str:
    """JAX's message without its gRPC payload annotations: "DEADLINE_EXCEEDED: GetKeyValue()
    timed out with key: pitstop/auto.0/control/0/3/1 and duration: 600s"."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return re.sub(r"\s*\[type\.googleapis\.com/[^\]]*\]", "", text).strip()


class JaxCoordinator(Coordinator):
    """The processes of the JAX job (``jax.distributed.initialize``) as pitstop's coordinator.

    ``name``: the instance's name when the ranks do not make their managers in the same
    order (see the module docstring); the k-th coordinator of one name on every rank talk
    to each other. ``timeout_s``: how long one exchange waits for the slowest rank (a
    rank's part of a save is written inside one). A manager closes the coordinator it made
    itself (``distributed="auto"``); one passed as ``distributed=`` is the caller's to
    :meth:`close` (on every rank)."""

    #: rounds of one channel whose keys stay in the store together: the leader deletes a
    #: batch once every process wrote the first round of the next (one call per batch)
    rounds_per_batch = 64

    def __init__(self, name: str | None = None, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or \
                not timeout_s > 0:
            raise InvalidArgumentError(
                f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if name is not None and (not isinstance(name, str) or not _NAME.fullmatch(name)):
            raise InvalidArgumentError(
                f"name must be 1-100 letters, digits, '_', '.' or '-', got {name!r}")
        client = _client()
        if client is None:
            raise InvalidArgumentError(
                "JAX's distributed runtime is not initialized in this process; call "
                "jax.distributed.initialize(...) before making the CheckpointManager")
        from jax._src import distributed

        state = distributed.global_state
        self.timeout_s = float(timeout_s)
        # from initialize's arguments: no backend is started to learn them
        self.rank = int(state.process_id)
        self.world_size = int(state.num_processes)
        self._client: Any = client
        base = name if name is not None else "auto"
        with _made_lock:
            k = _made[base]
            _made[base] += 1
        #: this coordinator's keys are under ``<ROOT>/<instance>/``
        self.instance = f"{base}.{k}"
        self._prefix = f"{ROOT}/{self.instance}"
        self._seq = dict.fromkeys(CHANNELS, 0)
        self._closed = False

    def describe(self) -> str:
        return f"process {self.rank} of {self.world_size} ({self.instance})"

    def all_gather(self, data: bytes, *, what: str, channel: str = "control") -> list[bytes]:
        if channel not in self._seq:
            raise InvalidArgumentError(f"{what}: unknown channel {channel!r} (one of "
                                       f"{', '.join(CHANNELS)})")
        if self._closed:
            raise CoordinationError(f"{what}: the coordinator of {self.describe()} is closed")
        client = self._client
        seq = self._seq[channel]
        self._seq[channel] = seq + 1
        batch, rank = seq // self.rounds_per_batch, self.rank
        round_ = f"{self._prefix}/{channel}/{batch}/{seq}"
        deadline = time.monotonic() + self.timeout_s
        try:
            client.key_value_set_bytes(f"{round_}/{rank}", bytes(data), allow_overwrite=False)
            # one call takes what the others wrote already (all of it, for the last to come)
            have = {int(k.rsplit("/", 1)[1]): v
                    for k, v in client.key_value_dir_get_bytes(round_)}
        except Exception as e:  # noqa: BLE001 - JaxRuntimeError: the service is gone
            raise self._lost(what, None, e) from e
        have[rank] = bytes(data)
        for r in range(self.world_size):
            if r in have:
                continue
            left_ms = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                have[r] = client.blocking_key_value_get_bytes(f"{round_}/{r}", left_ms)
            except Exception as e:  # noqa: BLE001 - JaxRuntimeError (DEADLINE_EXCEEDED, ...)
                raise self._lost(what, r, e) from e
        if seq % self.rounds_per_batch == 0 and batch > 0 and self.leader:
            # every process wrote this round, so each finished reading the batch before
            self._delete(f"{self._prefix}/{channel}/{batch - 1}")
        return [have[r] for r in range(self.world_size)]

    def _lost(self, what: str, peer: int | None, e: BaseException) -> CoordinationError:
        """The error of an exchange that could not complete, with what to do about it."""
        reason = _reason(e)
        if peer is None:
            waited = "could not reach JAX's coordination service"
        elif reason.startswith("DEADLINE_EXCEEDED"):
            waited = f"waited {self.timeout_s:g} s for process {peer}"
        else:
            waited = f"lost JAX's coordination service waiting for process {peer}"
        return CoordinationError(
            f"{what}: {self.describe()} {waited} ({reason}): a process died, hangs, or "
            "stopped calling pitstop in step with the others (every process must make its "
            "CheckpointManagers in the same order and call save() / step() / restore() alike; "
            "a manager made on only some processes needs "
            "distributed=JaxCoordinator(name=...)). Restart the job (every process) to resume "
            "from the newest committed step")

    def _delete(self, key: str) -> None:
        try:
            self._client.key_value_delete(key)
        except Exception:  # noqa: BLE001 - housekeeping only: a few bytes stay in the store
            pass

    def close(self) -> None:
        """Stop answering; once every process has closed, its keys leave the store.

        Each process marks itself closed; one that sees every mark deletes the instance's
        keys (the newest batch of rounds of each channel, which no process could know was
        read by all before). Never waits: with a process that died before closing, a few
        kilobytes stay in the store until the job ends."""
        if self._closed:
            return
        self._closed = True
        client = self._client
        try:
            client.key_value_set_bytes(f"{self._prefix}/closed/{self.rank}", b"",
                                       allow_overwrite=True)
            marks = client.key_value_dir_get_bytes(f"{self._prefix}/closed")
        except Exception:  # noqa: BLE001 - the job's runtime is shut down or gone
            return
        if len(marks) >= self.world_size:
            self._delete(self._prefix)

    def __repr__(self) -> str:
        return f"JaxCoordinator({self.describe()}, timeout_s={self.timeout_s:g})"
