"""A process of ``pitstop demo`` (the reference run, or ``pitstop run`` supervising the
training) whose report lines (``pid``, ``step``, ``restored``, ``save``, ``done``) and stderr
are read on threads while it runs."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable

#: every child runs single-threaded: bitwise reproducible, and kind to a shared machine
ENV = {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "TF_ENABLE_ONEDNN_OPTS": "0",
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
    "PYTHONUNBUFFERED": "1",
}


class Watched:
    """A process whose stdout (the child's report lines) and stderr are read on threads."""

    def __init__(self, cmd: list[str], on_err: Callable[[str], None] | None = None) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, **ENV})
        self.pids: list[int] = []
        self.restored: list[int | None] = []
        #: per process (pid): the last step it reported finished
        self.last_step: dict[int, int] = {}
        self.saves: list[tuple[int, float, float]] = []
        self.done = False
        self.err_lines: list[str] = []
        self._on_err = on_err
        self._threads = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=self._read_err, daemon=True)]
        for t in self._threads:
            t.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            kind, _, rest = line.strip().partition(" ")
            try:
                if kind == "pid":
                    self.pids.append(int(rest))
                elif kind == "step" and self.pids:
                    self.last_step[self.pids[-1]] = int(rest)
                elif kind == "restored":
                    self.restored.append(None if rest == "None" else int(rest))
                elif kind == "save":
                    s, a, b = rest.split()
                    self.saves.append((int(s), float(a), float(b)))
                elif kind == "done":
                    self.done = True
            except ValueError:
                pass  # a line of the framework's own, not a report

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err_lines.append(line)
            if self._on_err is not None:
                self._on_err(line)

    def wait(self, timeout: float = 300) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        # the report lines are all in the pipe once the process exited; on a busy machine the
        # reader threads may need a while to drain them (a leftover holding the pipe open is
        # the only reason to give up, hence a bound)
        for t in self._threads:
            t.join(60)
        return rc

    def tail(self) -> str:
        return "".join(self.err_lines)[-4000:]
