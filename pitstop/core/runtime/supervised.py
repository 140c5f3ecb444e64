"""What a job tells ``pitstop run``: its checkpoint directory and the step it resumed from.

``pitstop run`` sets ``PITSTOP_SUPERVISOR`` to a file in a private temporary directory; a
CheckpointManager opened in the job appends one JSON line to it when it opens its directory,
one when it restores (the step, or null for a fresh start), and one when another writer
holds the directory ("locked_out"). Nothing else reads it.
Without that variable this costs one dictionary lookup; any error is swallowed (a debug
log at most): reporting never fails or slows the manager.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from typing import Any

log = logging.getLogger("pitstop")

#: the variable ``pitstop run`` sets for its job: the path of the file to append to
ENV = "PITSTOP_SUPERVISOR"


def report(event: str, **fields: Any) -> None:
    """Append ``{"event": event, "pid": ..., "time": ..., **fields}`` to the supervisor's
    file, when the job runs under ``pitstop run``; never raises."""
    path = os.environ.get(ENV)
    if not path:
        return
    try:
        line = json.dumps({"event": event, "pid": os.getpid(), "time": time.time(), **fields},
                          default=str, separators=(",", ":")) + "\n"
        # no O_CREAT: only the supervisor makes the file; once it is gone, nothing is written.
        # Nor through a symlink, nor to a FIFO or a device: a process that outlives its
        # supervisor still names a path in its removed private directory, which anyone may
        # fill. One write of a short line with O_APPEND: lines of several processes never
        # interleave
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | os.O_NONBLOCK
                     | getattr(os, "O_NOFOLLOW", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{path} is not a regular file")
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except Exception as e:  # noqa: BLE001 - reporting must never fail the manager
        log.debug("pitstop: could not tell the supervisor (%s) about %s: %s", path, event, e)
