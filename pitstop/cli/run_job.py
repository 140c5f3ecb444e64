"""The job ``pitstop run`` supervises, as the operating system sees it: how a run ended
(status or signal), which processes its group still has, the signal that follows it when
the supervisor dies, and the events its CheckpointManagers report."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import signal
import sys
from collections.abc import Callable
from typing import Any


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe(returncode: int, *, killed: bool = False) -> str:
    """``status 1`` / ``signal SIGKILL``: how a run ended, as Popen's returncode says
    (``killed``: the supervisor sent the SIGKILL)."""
    if returncode < 0:
        name = signal_name(-returncode)
        hint = " (kill -9, a scheduler, or the out-of-memory killer: see dmesg)" \
            if -returncode == signal.SIGKILL and not killed else ""
        return f"signal {name}{hint}"
    return f"status {returncode}"


def exit_status(returncode: int) -> int:
    """The shell's exit status of a run: 128+N for signal N."""
    return 128 - returncode if returncode < 0 else returncode


def seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"


def group_members(pgid: int) -> list[int] | None:
    """The live (not zombie) processes of process group ``pgid`` (Linux: from /proc), or
    None where /proc cannot tell."""
    members: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue  # gone meanwhile
        fields = raw[raw.rfind(b")") + 2:].split()
        if len(fields) > 2 and fields[0] != b"Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def _group_alive(pgid: int) -> bool:
    members = group_members(pgid)
    if members is not None:
        return bool(members)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _death_signal() -> Callable[[], None] | None:
    """A preexec function that has the kernel send SIGTERM to the job when the supervisor
    dies (PR_SET_PDEATHSIG: Linux), so a SIGKILLed supervisor leaves no job running on;
    None where that is not available."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def setup() -> None:
        prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the supervisor died before prctl: no signal will come
            os.kill(os.getpid(), signal.SIGTERM)

    return setup


class Events:
    """The JSON lines CheckpointManagers in the job append (:mod:`pitstop.core.runtime.supervised`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        out = []
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                out.append(event)
        return out
