"""Framework test folders that need a process of their own (tests/conftest.py, ISOLATED),
each run here as one pytest subprocess, so `pytest tests` covers them too.

The runs start in the background as soon as the suite is collected (tests/conftest.py),
longest first: one at a time while the main pytest process runs its own tests, so the two
share a 2-core machine, and two at a time once these tests (moved to the end of the
session) start waiting for their results, when the main process has nothing left to do.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: test folder -> the framework it needs; tests/conftest.py keeps these folders out of any
#: other pytest process (TensorFlow and torch's triton cannot share one; JAX reads its
#: device count from XLA_FLAGS once per process)
ISOLATED = {"tf": "tensorflow", "keras": "keras", "jax": "jax"}
#: a run's environment entry (read here, not passed on) naming a part of a folder: the folder
#: is run in parts, so that the last runs, which have both cores to themselves once the main
#: process is done, end together rather than one of them alone
PART = "PITSTOP_TEST_PART"
#: (folder, part) -> that part's files; the run of the folder without a part takes the rest
#: (a new file goes there). tests/adapters/jax's part "children": the tests whose time is mostly in
#: child processes of their own (about half the folder's time)
PARTS = {("jax", "children"): ["test_resume.py", "test_nnx_and_sharding_edges.py",
                               "test_multiprocess.py", "test_crash.py"]}
#: (folder, environment) of each run: the Keras folder once per backend (Keras fixes its
#: backend per process, from KERAS_BACKEND)
RUNS = [("tf", {}), ("jax", {}), ("jax", {PART: "children"}),
        *(("keras", {"KERAS_BACKEND": b}) for b in ("jax", "torch", "tensorflow"))]
IDS = [f"{f}-{e.get('KERAS_BACKEND', e.get(PART, ''))}".rstrip("-") for f, e in RUNS]
_BACKEND_MODULE = {"jax": "jax", "torch": "torch", "tensorflow": "tensorflow"}
TIMEOUT = 1500


def missing_module(folder: str, env: dict[str, str]) -> str | None:
    for module in (ISOLATED[folder], _BACKEND_MODULE.get(env.get("KERAS_BACKEND", ""))):
        if module and importlib.util.find_spec(module) is None:
            return module
    return None


#: the runs' usual length order on this project's CI machine, longest first (a run missing
#: here goes last): the last one to start is then a short one
LONGEST_FIRST = ["keras-tensorflow", "keras-torch", "keras-jax", "tf", "jax", "jax-children"]


class Background:
    """The runs on threads of their own: one worker from the start, a second one once a test
    waits for a result (``result(id)``), taking the runs longest first."""

    def __init__(self, ids: list[str]) -> None:
        wanted = [(i, f, e) for i, (f, e) in zip(IDS, RUNS, strict=True) if i in ids]
        order = {i: n for n, i in enumerate(LONGEST_FIRST)}
        self.queue = sorted(wanted, key=lambda w: order.get(w[0], len(order)))
        self.lock = threading.Lock()
        self.done: dict[str, threading.Event] = {i: threading.Event() for i, _f, _e in wanted}
        self.results: dict[str, subprocess.CompletedProcess | BaseException | None] = {}
        self.tmp = tempfile.mkdtemp(prefix="pitstop-isolated-")
        self.workers = [threading.Thread(target=self._work, name=f"isolated-suites-{n}",
                                         daemon=True) for n in range(2)]

    def start(self) -> None:
        self.workers[0].start()

    def _work(self) -> None:
        while True:
            with self.lock:
                if not self.queue:
                    return
                ident, folder, env = self.queue.pop(0)
            try:
                self.results[ident] = None if missing_module(folder, env) else run(
                    folder, env, os.path.join(self.tmp, ident))
            except BaseException as e:  # noqa: BLE001 - reported by the waiting test
                self.results[ident] = e
            self.done[ident].set()

    def result(self, ident: str) -> subprocess.CompletedProcess | BaseException | None:
        with self.lock:  # the main process has reached these tests: its core is free now
            if not self.workers[1].is_alive() and self.queue:
                self.workers[1].start()
        self.done[ident].wait(TIMEOUT + 60)
        return self.results.get(ident, TimeoutError(f"{ident} did not finish"))

    def close(self) -> None:
        for w in self.workers:
            if w.is_alive():
                w.join(timeout=TIMEOUT + 60)
        shutil.rmtree(self.tmp, ignore_errors=True)


def selection(folder: str, env: dict[str, str]) -> list[str]:
    """The pytest arguments of a run: its folder, or its part of it (see :data:`PARTS`)."""
    part = env.get(PART)
    if part is not None:
        return [f"tests/adapters/{folder}/{f}" for f in PARTS[(folder, part)]]
    others = [f for (of, _part), files in PARTS.items() if of == folder for f in files]
    return [f"tests/adapters/{folder}", *(f"--ignore=tests/adapters/{folder}/{f}" for f in others)]


def run(folder: str, env: dict[str, str], basetemp: str) -> subprocess.CompletedProcess:
    """``pytest tests/<folder>`` (or its part) in a process of its own (with its own temporary
    root, so two pytest processes never tidy each other's directories)."""
    child_env = {k: v for k, v in env.items() if k != PART}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={basetemp}",
         *selection(folder, env)],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT,
        env=dict(os.environ, **child_env, PYTHONPATH=os.pathsep.join(
            [str(ROOT), os.environ.get("PYTHONPATH", "")])))


# the suite-wide 300 s limit is per test; a folder's run may take longer on a loaded machine,
# and has its own limit (TIMEOUT) that reports which folder hung
@pytest.mark.timeout(TIMEOUT + 120)
@pytest.mark.parametrize(("folder", "env"), RUNS, ids=IDS)
def test_folder_in_its_own_process(folder: str, env: dict[str, str], request) -> None:
    module = missing_module(folder, env)
    if module is not None:
        pytest.skip(f"{module} is not installed")
    ident = request.node.callspec.id
    background = getattr(request.config, "pitstop_isolated", None)  # tests/conftest.py
    if background is not None and ident in background.done:
        r = background.result(ident)
    else:
        r = run(folder, env, str(request.getfixturevalue("tmp_path") / "run"))
    if isinstance(r, BaseException):
        raise r
    assert r is not None
    summary = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
    print(f"tests/adapters/{folder} {env}: {summary}")
    assert r.returncode == 0, f"tests/adapters/{folder} {env} failed:\n{r.stdout[-30000:]}\n{r.stderr[-5000:]}"
