"""Imported by the forkserver that a ResumableLoader starts (as a preload module), never by
the training process: children of that forkserver inherit its blocked SIGTERM/SIGINT (see
``_workers``); every child that is not a ResumableLoader worker gets them unblocked before
it runs its target, so other code's processes still end on ``Process.terminate()``."""

from __future__ import annotations

import functools
import signal
from multiprocessing.process import BaseProcess
from typing import Any

from pitstop.adapters.torch._workers import SIGNALS, SUPPORTED, WorkerInit


def _is_resumable_worker(process: BaseProcess) -> bool:
    for a in getattr(process, "_args", ()) or ():
        if isinstance(a, WorkerInit) or (
                isinstance(a, functools.partial)
                and any(isinstance(x, WorkerInit) for x in a.args)):
            return True
    return False


def _install() -> None:
    original = BaseProcess._bootstrap  # type: ignore[attr-defined]
    if getattr(original, "_pitstop_guard", False):
        return

    @functools.wraps(original)
    def bootstrap(self: BaseProcess, *args: Any, **kwargs: Any) -> Any:
        if not _is_resumable_worker(self):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
        return original(self, *args, **kwargs)

    bootstrap._pitstop_guard = True  # type: ignore[attr-defined]
    BaseProcess._bootstrap = bootstrap  # type: ignore[attr-defined]


if SUPPORTED:
    _install()
