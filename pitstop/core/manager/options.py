"""The options of a :class:`~pitstop.core.manager.CheckpointManager`: one frozen dataclass
built from the keywords users type, checked (by :mod:`pitstop.core.arguments`) when it is
made, before anything is installed or written."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pitstop.core.arguments import (
    DEFAULT_SNAPSHOT,
    check_arguments,
    check_callables,
    check_encryption,
    check_incremental,
    check_naming,
    check_permissions,
    check_preemption,
    check_snapshot,
)
from pitstop.core.errors import InvalidArgumentError
from pitstop.core.format.hashing import DEFAULT
from pitstop.core.policy import KeepBest, KeepEverySteps, KeepLast, RetentionPolicy
from pitstop.core.runtime.signals import DEFAULT_SIGNALS, check_signals

if TYPE_CHECKING:
    from pitstop.core.policy import SavePolicy
    from pitstop.core.save.engine import SaveStats


@dataclass(frozen=True)
class ManagerOptions:
    """Every option of a manager but its directory, with today's defaults (the keywords of
    ``CheckpointManager``, documented in docs/quickstart.md's option table).

    Attributes:
        keep_last: keep the newest N checkpoints (retention; None: no such rule).
        keep_every_steps: also keep every checkpoint whose step is a multiple of N.
        keep_best: also keep the N best checkpoints by ``best_metric`` (needs it).
        best_metric: the metric ``keep_best`` and ``best_step()`` rank by.
        best_mode: "min" or "max": which values of ``best_metric`` are best.
        save_every_steps: ``step()`` saves every N steps.
        save_every_seconds: ``step()`` saves when this many seconds passed since the last save.
        save_policy: a policy of your own (``should_save(step, ctx)``), or-ed with the others.
        retention: retention policies of your own (each has ``keep(checkpoints)``).
        save_on_signals: the signals whose arrival saves at the next step boundary (None:
            none); SIGTERM and SIGINT then exit, SIGUSR1 goes on.
        mtbf_seconds: the mean time between failures: ``step()`` saves at the interval that
            loses the least time for it (AutoInterval).
        async_save: persist in the background (False: every save commits inline).
        max_in_flight: saves persisting at once (each holds one staging buffer).
        on_busy: what a periodic save does while the buffers persist: "skip" or "wait".
        memory_tier: None (on where /dev/shm is usable), True, False or a tmpfs directory.
        nonfinite_guard: check every saved array for NaN / inf (``rollback()`` uses it).
        hash_algorithm: the hash every byte written is covered by.
        compression: None, "zstd" or "zstd+shuffle".
        writer_threads: threads that write a save (None: min(4, cores)).
        copy_threads: threads that copy a snapshot (None: pitstop decides).
        hash_in_copy: hash large arrays while copying them into the staging buffer: a
            longer stall for less background work (training that keeps every core busy).
        durable: fsync what is written (False: faster, lost on a power cut).
        read_only: only read the directory: no lock, no writes, no engine.
        on_save: called with each save's :class:`SaveStats` once it committed.
        step_prefix: the prefix of checkpoint names when the directory is created.
        step_digits: the digits of the step in those names when the directory is created.
        distributed: "auto", True, False or a :class:`~pitstop.core.runtime.coordination.Coordinator`.
        storage_options: passed to the storage of a URL (fsspec's options).
        permissions: the mode of the directories pitstop creates (None: the umask decides).
        encryption: a :class:`pitstop.Encryption` (None: plaintext checkpoints).
        incremental: reference arrays unchanged since the previous save instead of writing them.
        snapshot: "eager" (copy everything in ``save()``) or "lazy".
        preemption: the cloud preemption notices to watch: None (off; ``PITSTOP_PREEMPTION``
            then applies), "auto", "gce", "aws", "azure" or a list of those.
        preemption_exit: exit (as SIGTERM asks) once a notice's save is durable, instead of
            training on (``PITSTOP_PREEMPTION_EXIT=1`` too).
        grace_seconds: a SIGTERM's deadline is its arrival plus this (``PITSTOP_GRACE_SECONDS``;
            30 under Kubernetes; else no deadline).
    """

    keep_last: int | None = None
    keep_every_steps: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"
    save_every_steps: int | None = None
    save_every_seconds: float | None = None
    save_policy: SavePolicy | None = None
    retention: Iterable[RetentionPolicy] | None = None
    save_on_signals: Iterable[str | int] | None = DEFAULT_SIGNALS
    mtbf_seconds: float | None = None
    async_save: bool = True
    max_in_flight: int = 1
    on_busy: str = "skip"
    memory_tier: bool | str | None = None
    nonfinite_guard: bool = False
    hash_algorithm: str = DEFAULT
    compression: str | None = None
    writer_threads: int | None = None
    copy_threads: int | None = None
    hash_in_copy: bool = False
    durable: bool = True
    read_only: bool = False
    on_save: Callable[[SaveStats], None] | None = None
    step_prefix: str | None = None
    step_digits: int | None = None
    distributed: Any = "auto"
    storage_options: Mapping[str, Any] | None = None
    permissions: int | None = 0o700
    encryption: Any = None
    incremental: bool = False
    snapshot: str = DEFAULT_SNAPSHOT
    preemption: str | Iterable[str] | None = None
    preemption_exit: bool = False
    grace_seconds: float | None = None

    def check(self, directory: Any) -> None:
        """Check ``directory`` and every option, in the order the manager always did (the
        first bad one raises :class:`~pitstop.core.errors.InvalidArgumentError`)."""
        check_arguments(directory, self.hash_algorithm, self.on_busy, self.keep_best,
                        self.best_metric, self.best_mode, self.compression,
                        self.max_in_flight, self.memory_tier, self.writer_threads,
                        self.copy_threads)
        check_callables(self.save_policy, self.retention, self.on_save)
        if not isinstance(self.hash_in_copy, bool):
            raise InvalidArgumentError(f"hash_in_copy must be True or False, got "
                                       f"{self.hash_in_copy!r}")
        check_snapshot(self.snapshot)
        check_encryption(self.encryption)
        check_incremental(self.incremental)
        check_naming(self.step_prefix, self.step_digits)
        check_permissions(self.permissions)
        check_signals(self.save_on_signals)  # all of them, before anything is installed
        self.preemption_settings()

    def preemption_settings(self) -> tuple[tuple[str, ...], bool, float | None]:
        """The sources to watch, whether to exit after a notice's save, and SIGTERM's grace
        (the keywords, or the environment where they are left at their defaults)."""
        return check_preemption(self.preemption, self.preemption_exit, self.grace_seconds)

    def retention_policies(self) -> list[RetentionPolicy]:
        """``retention`` and the ``keep_*`` options as one list of policies."""
        retention_list: list[RetentionPolicy] = list(self.retention or [])
        if self.keep_last is not None:
            retention_list.append(KeepLast(self.keep_last))
        if self.keep_every_steps is not None:
            retention_list.append(KeepEverySteps(self.keep_every_steps))
        if self.keep_best is not None:
            retention_list.append(KeepBest(self.keep_best, self.best_metric or "",
                                           self.best_mode))
        return retention_list
