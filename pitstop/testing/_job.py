"""The training job the SIGKILL test runs in a child process, and its driver.

The child imports the suite's test module by its file, builds the suite's state, restores
it through a :class:`pitstop.CheckpointManager`, trains the remaining steps with the suite's
``train_step``, saving every step, and prints, one line each (prefixed with :data:`TAG`)::

    start <restored step or None>
    step <n> <loss as float.hex()>
    final <JSON {path: sha256} of the suite's fingerprint of the state>

The parent (``AdapterSuite.test_sigkill_resumes_exactly``) reads these lines; the job it
kills waits after printing the chosen step, and is SIGKILLed there, while that step's save
may still be persisting.
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TAG = "pitstop-conformance"


def load_suite(file: str, qualname: str) -> Any:
    """An instance of the suite class ``qualname`` of the test module at ``file``."""
    folder = os.path.dirname(os.path.abspath(file))
    if folder not in sys.path:
        sys.path.insert(0, folder)  # the module's helpers beside it, as pytest imports them
    name = f"_pitstop_conformance_{Path(file).stem}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the suite's module {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj()


def main(file: str, qualname: str, directory: str, steps: int, pause_at: int = -1) -> None:
    """The child's whole job (see the module's docstring). At step ``pause_at``, once it is
    printed, the job reads stdin to its end: the parent kills it meanwhile, while that
    step's save may still be persisting."""
    import pitstop

    suite = load_suite(file, qualname)
    state = suite.make_state()
    # every step saved (a save due while the previous one persists waits for it)
    options = {**suite.manager_options(), "save_every_steps": 1, "keep_last": 2,
               "on_busy": "wait"}
    with pitstop.CheckpointManager(directory, **options) as mgr:
        restored = mgr.restore(state)
        print(f"{TAG} start {restored}", flush=True)
        for step in range(0 if restored is None else restored + 1, steps):
            loss = float(suite.train_step(state, step))
            mgr.step(step, state, metrics={"loss": loss})
            if step == 0:
                mgr.wait()  # a kill from now on finds a checkpoint to resume from
            print(f"{TAG} step {step} {loss.hex()}", flush=True)
            if step == pause_at:
                sys.stdin.read()
    final = suite.fingerprint(state)
    from pitstop.testing._bits import digest
    print(f"{TAG} final {json.dumps(digest(final))}", flush=True)


def start(file: str, qualname: str, directory: Path, steps: int, log: Path,
          pause_at: int = -1) -> subprocess.Popen:
    """Start the child job in a session of its own (a SIGKILL to its group takes any worker
    processes too); its stderr goes to ``log``."""
    code = ("import sys; from pitstop.testing._job import main; "
            "main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))")
    with open(log, "wb") as err:
        return subprocess.Popen(
            [sys.executable, "-c", code, file, qualname, str(directory), str(steps),
             str(pause_at)], stdin=subprocess.PIPE if pause_at >= 0 else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=err, start_new_session=True)


class Output:
    """A child's protocol lines, read as they come."""

    def __init__(self, proc: subprocess.Popen, log: Path) -> None:
        self.proc, self.log = proc, log
        self.start: int | None | str = "never printed"
        self.losses: dict[int, str] = {}
        self.final: dict[str, str] | None = None
        self._rest = b""

    def read_until(self, stop_step: int | None, timeout: float) -> bool:
        """Read lines until ``step <stop_step>`` (True) or the end of the output (False)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()  # read raw: a buffered reader hides lines from select
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self._rest:
                line, self._rest = self._rest.split(b"\n", 1)
                if self._parse(line.decode(errors="replace").strip()) == stop_step and \
                        stop_step is not None:
                    return True
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the conformance job printed nothing for {timeout:.0f} s; "
                                   f"its stderr:\n{self.stderr()}")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return False
                self._rest += chunk

    def _parse(self, line: str) -> int | None:
        if not line.startswith(TAG + " "):
            return None
        what, _, rest = line[len(TAG) + 1:].partition(" ")
        if what == "start":
            self.start = None if rest == "None" else int(rest)
        elif what == "step":
            n, loss = rest.split()
            self.losses[int(n)] = loss
            return int(n)
        elif what == "final":
            self.final = json.loads(rest)
        return None

    def stderr(self, tail: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-tail:]
        except OSError:
            return "(no stderr)"

    def finish(self, timeout: float) -> int:
        """Read to the end and wait for the exit; the exit status."""
        self.read_until(None, timeout)
        return self.proc.wait(timeout=timeout)
