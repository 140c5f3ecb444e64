"""Arguments of the manager's public calls, checked before anything is written: steps,
metrics, user metadata, constructor options, directories. A bad one raises
:class:`InvalidArgumentError` (a ``CheckpointError`` and a ``ValueError``) naming it; an
OSError from the file system becomes a ``CheckpointError`` that names the directory."""

from __future__ import annotations

import errno
import logging
import operator
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pitstop.core.directory.names import DEFAULT, Naming
from pitstop.core.errors import CheckpointError, InvalidArgumentError
from pitstop.core.format.hashing import ALGORITHMS
from pitstop.core.policy import number_metric, positive_int
from pitstop.core.storage import Storage, open_storage


def check_arguments(directory: Any, hash_algorithm: str, on_busy: str, keep_best: Any,
                     best_metric: Any, best_mode: str, compression: Any, max_in_flight: Any,
                     memory_tier: Any, writer_threads: Any, copy_threads: Any) -> None:
    if directory is None or (isinstance(directory, (str, bytes)) and not directory.strip()):
        raise InvalidArgumentError(
            f"directory must name a checkpoint directory, got {directory!r} (pitstop will not "
            "write into ./None or the working directory by accident)")
    if not isinstance(directory, (str, os.PathLike, Storage)):
        raise InvalidArgumentError(
            f"directory must be a path or a Storage, got {type(directory).__name__}")
    if not isinstance(directory, Storage) and "\0" in str(os.fspath(directory)):
        raise InvalidArgumentError(f"directory {directory!r} holds a NUL character")
    if hash_algorithm not in ALGORITHMS:
        raise InvalidArgumentError(f"hash_algorithm must be one of {sorted(ALGORITHMS)}, got "
                                   f"{hash_algorithm!r}")
    if on_busy not in ("skip", "wait"):
        raise InvalidArgumentError(f"on_busy must be 'skip' or 'wait', got {on_busy!r}")
    if keep_best is not None and not best_metric:
        raise InvalidArgumentError("keep_best needs best_metric (the metric name to rank by)")
    if best_mode not in ("min", "max"):
        raise InvalidArgumentError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
    if compression not in (None, "none", "zstd", "zstd+shuffle"):
        raise InvalidArgumentError(f"compression must be None, 'zstd' or 'zstd+shuffle', got "
                                   f"{compression!r}")
    positive_int("max_in_flight", max_in_flight)
    for name, value in (("writer_threads", writer_threads), ("copy_threads", copy_threads)):
        if value is not None:
            positive_int(name, value)
    if memory_tier is not None and not isinstance(memory_tier, (bool, str, os.PathLike)):
        raise InvalidArgumentError(
            f"memory_tier must be None (on where /dev/shm is usable), True, False or a "
            f"directory on a tmpfs; got {memory_tier!r}")
    if isinstance(memory_tier, (str, os.PathLike)) and not os.fspath(memory_tier):
        raise InvalidArgumentError("memory_tier must name a directory, got an empty path")


#: the snapshot mode a manager uses when none is given (one line to flip, see docs/torch.md)
DEFAULT_SNAPSHOT = "eager"
SNAPSHOT_MODES = ("eager", "lazy")


def check_snapshot(snapshot: Any) -> str:
    """``snapshot`` is "eager" (copy everything at save()) or "lazy" (copy parameters and
    optimizer state in the background until the next optimizer step)."""
    if not isinstance(snapshot, str) or snapshot not in SNAPSHOT_MODES:
        raise InvalidArgumentError(
            f"snapshot must be 'eager' (copy the whole state inside save()) or 'lazy' (copy "
            f"torch parameters and optimizer state in the background until the next "
            f"optimizer step), got {snapshot!r}")
    return snapshot


def check_naming(step_prefix: Any, step_digits: Any) -> None:
    """Check ``step_prefix`` and ``step_digits`` (each None or a valid part of a
    :class:`~pitstop.core.directory.names.Naming`); a bad one raises InvalidArgumentError naming it."""
    Naming(DEFAULT.prefix if step_prefix is None else step_prefix,
           DEFAULT.digits if step_digits is None else step_digits)


def check_permissions(permissions: Any) -> None:
    """``permissions`` is None (the umask decides) or a directory mode that keeps the owner's
    read, write and search bits (pitstop must use what it creates) and nothing beyond 0o777."""
    if permissions is None:
        return
    if type(permissions) is not int or not 0 <= permissions <= 0o777 or \
            permissions & 0o700 != 0o700:
        raise InvalidArgumentError(
            f"permissions must be None (follow the umask) or a directory mode from 0o700 to "
            f"0o777 that keeps the owner's rwx bits, e.g. 0o700 (owner only, the default) or "
            f"0o750 (group may read); got {permissions!r}")


#: the notice sources a manager can watch (``preemption=``; "auto" detects among them)
PREEMPTION_SOURCES = ("gce", "aws", "azure")


def check_preemption(preemption: Any, preemption_exit: Any, grace_seconds: Any
                     ) -> tuple[tuple[str, ...], bool, float | None]:
    """The checked preemption options, the environment applied where a keyword is left at
    its default: (sources to watch, "auto" kept as such; exit after the save; SIGTERM's
    grace in seconds or None). ``PITSTOP_PREEMPTION`` (comma separated) applies when
    ``preemption`` is None, ``PITSTOP_PREEMPTION_EXIT=1`` when ``preemption_exit`` is False,
    ``PITSTOP_GRACE_SECONDS`` (then Kubernetes' 30 s under Kubernetes) when ``grace_seconds``
    is None. A bad value raises InvalidArgumentError naming it and the accepted ones."""
    accepted = "None, 'auto', 'gce', 'aws', 'azure' or a list of those"
    where = "preemption"
    if preemption is None:
        env = os.environ.get("PITSTOP_PREEMPTION", "").strip()
        preemption = None if env.lower() in ("", "off", "none", "0") else env
        where = "PITSTOP_PREEMPTION"
    if preemption is None:
        names: list[Any] = []
    elif isinstance(preemption, str):
        names = [n.strip() for n in preemption.split(",")]
    elif isinstance(preemption, Iterable) and not isinstance(preemption, (bytes, Mapping)):
        names = list(preemption)
    else:
        raise InvalidArgumentError(f"{where} must be {accepted}; got {preemption!r}")
    sources: list[str] = []
    for name in names:
        if not isinstance(name, str) or name.lower() not in ("auto", *PREEMPTION_SOURCES):
            raise InvalidArgumentError(f"{where}: {name!r} is not a notice source; use "
                                       f"{accepted} (e.g. preemption='gce')")
        if name.lower() not in sources:
            sources.append(name.lower())
    if not isinstance(preemption_exit, bool):
        raise InvalidArgumentError(f"preemption_exit must be True or False, got "
                                   f"{preemption_exit!r}")
    if not preemption_exit:
        env = os.environ.get("PITSTOP_PREEMPTION_EXIT", "").strip().lower()
        if env not in ("", "0", "false", "no", "off", "1", "true", "yes", "on"):
            raise InvalidArgumentError(f"PITSTOP_PREEMPTION_EXIT must be 1 or 0, got {env!r}")
        preemption_exit = env in ("1", "true", "yes", "on")
    if preemption_exit and not sources:
        logging.getLogger("pitstop").warning(
            "pitstop: preemption_exit is set but no notice source is watched (preemption=None "
            "and no PITSTOP_PREEMPTION): it does nothing. Pass preemption='auto' (or 'gce', "
            "'aws', 'azure'); SIGTERM exits after its save in any case.")
    return tuple(sources), preemption_exit, _grace(grace_seconds)


def _grace(grace_seconds: Any) -> float | None:
    where = "grace_seconds"
    if grace_seconds is None:
        env = os.environ.get("PITSTOP_GRACE_SECONDS", "").strip()
        if not env:
            return 30.0 if os.environ.get("KUBERNETES_SERVICE_HOST") else None
        where = "PITSTOP_GRACE_SECONDS"
        try:
            grace_seconds = float(env)
        except ValueError:
            raise InvalidArgumentError(f"PITSTOP_GRACE_SECONDS must be a number of seconds "
                                       f"(e.g. 30), got {env!r}") from None
    if isinstance(grace_seconds, bool) or not isinstance(grace_seconds, (int, float)) or \
            not grace_seconds > 0 or grace_seconds == float("inf"):
        raise InvalidArgumentError(
            f"{where} must be "
            f"{'unset' if where.isupper() else 'None'} (no deadline for SIGTERM) or a positive "
            f"number of seconds (Kubernetes' terminationGracePeriodSeconds, e.g. 30), got "
            f"{grace_seconds!r}")
    return float(grace_seconds)


def check_callables(save_policy: Any, retention: Any, on_save: Any) -> None:
    if save_policy is not None and not callable(getattr(save_policy, "should_save", None)):
        raise InvalidArgumentError(
            f"save_policy must have should_save(step, ctx) (e.g. pitstop.EveryNSteps(100)), got "
            f"{type(save_policy).__name__}")
    if retention is not None:
        if isinstance(retention, (str, bytes)) or not isinstance(retention, Iterable):
            raise InvalidArgumentError("retention must be a list of retention policies, e.g. "
                                       "[pitstop.KeepLast(3)]")
        for r in retention:
            if not callable(getattr(r, "keep", None)):
                raise InvalidArgumentError(
                    f"retention holds a {type(r).__name__}, which has no keep(checkpoints); "
                    "use policies such as pitstop.KeepLast(3), pitstop.KeepBest(2, 'loss')")
    if on_save is not None and not callable(on_save):
        raise InvalidArgumentError(f"on_save must be callable (it gets each save's SaveStats), "
                                   f"got {type(on_save).__name__}")


#: the largest step a checkpoint directory records (its index holds at most 18 digits)
MAX_STEP = 10 ** 18 - 1


def step_arg(step: Any) -> int:
    """A step as a Python int: ints and integral numpy (or framework) scalars; never a bool,
    a float or a string, nor more than :data:`MAX_STEP`."""
    if type(step) is int and 0 <= step <= MAX_STEP:  # the per-step fast path
        return step
    if isinstance(step, bool) or isinstance(step, (float, str, bytes)) or step is None:
        raise InvalidArgumentError(f"step must be a non-negative int, got {step!r}")
    try:
        value = operator.index(step)
    except TypeError:
        raise InvalidArgumentError(
            f"step must be a non-negative int, got {type(step).__name__} {step!r}") from None
    if value < 0:
        raise InvalidArgumentError(f"step must be a non-negative int, got {value}")
    if value > MAX_STEP:
        raise InvalidArgumentError(
            f"step {value} is larger than a checkpoint directory records (at most {MAX_STEP}, "
            "18 digits); count steps from 0 (a global step, not a timestamp in nanoseconds)")
    return value


def clean_metrics(metrics: Any, best_metric: str | None) -> dict[str, Any]:
    """Metrics as JSON values, checked before anything is written: numbers (also numpy and
    framework scalars), strings, bools and None; the ranking metric must be a number."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise InvalidArgumentError(
            f"metrics must be a mapping of name -> value, e.g. {{'loss': 0.5}}; got "
            f"{type(metrics).__name__}")
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if not isinstance(k, str):
            raise InvalidArgumentError(f"metric names must be strings, got {k!r}")
        if not isinstance(v, (int, float, str)) and v is not None:
            item = getattr(v, "item", None)
            if not callable(item):
                raise InvalidArgumentError(
                    f"metric {k!r} must be a number or a string, got {type(v).__name__}")
            try:
                v = item()  # numpy / framework scalars, one-element arrays and tensors
            except Exception as e:  # noqa: BLE001 - numpy ValueError, torch RuntimeError, ...
                raise InvalidArgumentError(
                    f"metric {k!r} must be a single number; got a {type(v).__name__} of "
                    f"shape {tuple(getattr(v, 'shape', ()))} ({e}). Pass e.g. "
                    "loss.mean().item().") from None
            if not isinstance(v, (int, float, str, bool)) and v is not None:
                raise InvalidArgumentError(
                    f"metric {k!r} must be a number or a string, got {type(v).__name__}")
        if k == best_metric:
            number_metric(k, v)
        out[k] = v
    return out


def check_user_metadata(user_metadata: Any) -> dict[str, Any]:
    if user_metadata is None:
        return {}
    if not isinstance(user_metadata, Mapping):
        raise InvalidArgumentError(
            f"user_metadata must be a mapping, got {type(user_metadata).__name__}")
    from pitstop.core.tree import encode_value
    out = dict(user_metadata)
    encode_value(out, "user_metadata")  # refused now, not in the background persist
    return out


def open_directory(directory: Any, **kwargs: Any) -> Storage:
    if isinstance(directory, Storage):
        return directory
    return wrap_os(open_storage, os.fspath(directory), directory, **kwargs)


def wrap_os(fn: Callable[..., Any], where: str, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args)``, with an OSError turned into a CheckpointError that names ``where``."""
    try:
        return fn(*args, **kwargs)
    except OSError as e:
        if isinstance(e, NotADirectoryError):
            what = "is not a directory (or a part of its path is a file)"
        elif isinstance(e, FileExistsError):
            what = f"holds a file where pitstop needs a directory ({e.filename})"
        elif isinstance(e, PermissionError) or e.errno in (errno.EROFS, errno.EACCES,
                                                            errno.EPERM):
            what = (f"is not writable by this process ({e.strerror}); open it with "
                    "read_only=True to restore or load only")
        else:
            what = f"cannot be used ({type(e).__name__}: {e})"
        raise CheckpointError(f"checkpoint directory {where} {what}") from e


def check_encryption(encryption: Any) -> None:
    """``encryption`` is None or a :class:`pitstop.Encryption` (the key, already checked)."""
    if encryption is None:
        return
    from pitstop.core.format.crypto import Encryption
    if not isinstance(encryption, Encryption):
        raise InvalidArgumentError(
            f"encryption must be None or pitstop.Encryption(...), got a "
            f"{type(encryption).__name__} (a raw key is never accepted as an argument: "
            "pitstop.Encryption(key=callable) or the PITSTOP_ENCRYPTION_KEY variable)")


def check_incremental(incremental: Any) -> None:
    """``incremental`` is a bool (incremental checkpoints on or off)."""
    if type(incremental) is not bool:
        raise InvalidArgumentError(
            f"incremental must be True or False (reference arrays unchanged since the previous "
            f"save instead of writing them again), got {incremental!r}")
