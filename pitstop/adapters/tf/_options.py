"""tf.train's ``CheckpointOptions`` given to pitstop's ``Checkpoint`` and ``CheckpointManager``:
checked, honoured where they mean something to pitstop (write callbacks), and said once to
be ignored where they do not (device placement, sharding)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from pitstop.core.errors import InvalidArgumentError

log = logging.getLogger("pitstop")


def call_back(fn: Callable[..., Any], path: str) -> None:
    """A write callback of ``CheckpointOptions``, called as tf.train calls it (with the save
    path when it takes an argument), once the checkpoint is committed."""
    try:
        takes = bool(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        takes = True
    try:
        fn(path) if takes else fn()
    except Exception:  # the checkpoint is committed: a failing callback does not undo it
        log.exception("pitstop: the write callback %r failed for %s", fn, path)


#: the CheckpointOptions fields pitstop has no use for, each said once
_IGNORED_OPTIONS = {
    "experimental_io_device": "pitstop reads and writes its files from the host",
    "experimental_sharding_callback": "pitstop lays out its own data files",
    "experimental_skip_slot_variables": "every variable the object graph reaches is saved "
                                        "and restored",
}
_warned_options: set[str] = set()


def check(options: Any, call: str) -> Any:
    """``options`` checked as tf.train's ``CheckpointOptions``: None, or one whose
    ``experimental_write_callbacks`` are honoured (called after the commit) and whose
    ``enable_async`` pitstop's asynchronous saves already give; fields pitstop has no use
    for are said once to be ignored."""
    if options is None:
        return None
    if not isinstance(options, tf.train.CheckpointOptions):
        raise InvalidArgumentError(
            f"{call}(options=...) takes a tf.train.CheckpointOptions, got "
            f"{type(options).__name__} {options!r}")
    for field, why in _IGNORED_OPTIONS.items():
        if getattr(options, field, None) and field not in _warned_options:
            _warned_options.add(field)
            log.warning("pitstop: CheckpointOptions(%s=%r) is ignored: %s", field,
                        getattr(options, field), why)
    return options
