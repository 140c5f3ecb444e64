"""Host identity: which machine and which boot of it a process runs on (a file or lock
written by a process of this boot may name a pid that is still this machine's)."""

from __future__ import annotations


def boot_id() -> str:
    """This boot's id (``/proc/sys/kernel/random/boot_id``); "" where the system has none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
