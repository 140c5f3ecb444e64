"""Real multi-process torch.distributed worlds for tests: N processes on gloo, 127.0.0.1.

Each rank is a fresh ``python tests/adapters/torch/dist_worker.py <scenario> <rank> <world> <port>
<tmpdir> [json args]`` process (torch imported once per process, ``OMP_NUM_THREADS=1``).
With ``port`` 0 (the default) rank 0 opens the job's ``TCPStore`` on a port the kernel
picks and writes it to a rendezvous file the other ranks wait for: no port is guessed, so
no two worlds (or other programs) can race for one. A scenario is a function in
dist_worker.py (see its docstring); each rank prints its JSON result as the last line of its
stdout, which :func:`finish_world` returns, one dict per rank.

>>> results = run_world("reshard", 2, tmp_path, args={"sources": {...}})
>>> procs = start_world("save_loop", 2, tmp_path)      # lower level: kill a rank mid-way
>>> wait_for_mark(procs[1], "saved 3", timeout=30); procs[1].kill()

Nothing here ever hangs a test: every wait has a deadline; a rank that fails or a world
that runs out of time gets every rank killed (after a stack dump of the live ones) and a
:class:`WorldFailed` carrying every rank's exit status, stdout and stderr.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

HERE = Path(__file__).absolute().parent  # not resolve(): a linked checkout keeps its root
ROOT = HERE.parents[2]
WORKER = HERE / "dist_worker.py"
#: the line prefix a rank's result is printed after (its last line of stdout)
RESULT = "PITSTOP_RESULT "
#: the line prefix of progress marks (``ctx.mark(text)`` in a scenario)
MARK = "PITSTOP_MARK "
#: environment variable naming the rendezvous file (rank 0 writes the store's port there)
RENDEZVOUS_ENV = "PITSTOP_TEST_RENDEZVOUS"
#: how long a rank waits for its peers at start-up and in collectives (seconds)
PEER_TIMEOUT_ENV = "PITSTOP_TEST_PEER_TIMEOUT"


class WorldFailed(AssertionError):
    """A rank exited with an error, died, or the world ran past its deadline. The message
    holds every rank's exit status and the tails of its stderr and stdout."""


def _loopback_interface() -> str | None:
    """The loopback interface's name, for gloo (which otherwise resolves the host name and
    may pick an address the sandbox cannot reach)."""
    try:
        names = [name for _i, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return None


def start_world(scenario: str, world: int, tmp_path: Path | str,
                args: Mapping[str, Any] | None = None, *, port: int = 0,
                env: Mapping[str, str] | None = None, peer_timeout: float = 60.0,
                worker: Path | str = WORKER) -> list[subprocess.Popen[bytes]]:
    """Start ``world`` rank processes running ``scenario`` (``"a+b"`` runs several in one
    world) and return them at once, rank order. ``tmp_path`` is the scenario's shared
    directory; ``args`` a JSON-able dict every rank gets. ``port`` 0: rendezvous through a
    file (race-free); another port: ``MASTER_ADDR``/``MASTER_PORT`` on 127.0.0.1.
    ``peer_timeout``: how long a rank waits for its peers (start-up, each collective).
    ``worker``: the script each rank runs (dist_worker.py, or one that registers more
    scenarios and calls ``dist_worker.main``).

    Each ``Popen`` has ``.rank``, ``.out_path`` and ``.err_path`` (its stdout / stderr files)
    and ``.run_dir``. Finish with :func:`finish_world` (or :func:`kill_world`)."""
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}")
    tmp = Path(tmp_path)
    run_dir = tmp / f".world-{scenario.replace('+', '_')}-{world}-{uuid.uuid4().hex[:8]}"
    run_dir.mkdir(parents=True)
    child_env = dict(os.environ)
    child_env.update({
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", ""))
                                      if p),
        RENDEZVOUS_ENV: str(run_dir / "rendezvous.port"),
        PEER_TIMEOUT_ENV: str(peer_timeout),
        # CPU/gloo worlds: torch need not probe GPUs (env= can give a world some)
        "CUDA_VISIBLE_DEVICES": "",
    })
    lo = _loopback_interface()
    if lo is not None:
        child_env.setdefault("GLOO_SOCKET_IFNAME", lo)
    if env:
        child_env.update(env)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(world):
            out_path = run_dir / f"rank{rank}.out"
            err_path = run_dir / f"rank{rank}.err"
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                p = subprocess.Popen(
                    [sys.executable, str(worker), scenario, str(rank), str(world), str(port),
                     str(tmp), json.dumps(dict(args or {}))],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=child_env,
                    cwd=str(ROOT), start_new_session=True)
            p.rank = rank  # type: ignore[attr-defined]
            p.out_path = out_path  # type: ignore[attr-defined]
            p.err_path = err_path  # type: ignore[attr-defined]
            p.run_dir = run_dir  # type: ignore[attr-defined]
            procs.append(p)
    except BaseException:
        kill_world(procs)
        raise
    return procs


def kill_world(procs: list[subprocess.Popen[bytes]], *, dump_stacks: bool = False) -> None:
    """SIGKILL every rank still running and reap them all (first, with ``dump_stacks``, ask
    the live ones for a Python stack dump on stderr: where a hung world was waiting)."""
    live = [p for p in procs if p.poll() is None]
    if dump_stacks and live:
        for p in live:
            _signal(p, signal.SIGUSR1)
        time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            _signal(p, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process SIGKILL cannot end
            pass


def _signal(p: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # its own session: whatever it started goes too
    except (ProcessLookupError, PermissionError):
        try:
            p.send_signal(sig)
        except ProcessLookupError:
            pass


def _tail(path: Path, n: int = 6000) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        return f"<unreadable: {e}>"
    text = data[-n:].decode("utf-8", "replace")
    return ("..." if len(data) > n else "") + text


def describe(procs: list[subprocess.Popen[bytes]]) -> str:
    """Every rank's exit status, stderr and stdout tails (for failure messages)."""
    parts = []
    for p in procs:
        rc = p.poll()
        state = "still running" if rc is None else (
            f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}")
        parts.append(f"--- rank {p.rank} ({state}) stderr:\n"  # type: ignore[attr-defined]
                     f"{_tail(p.err_path)}\n"  # type: ignore[attr-defined]
                     f"--- rank {p.rank} stdout:\n"  # type: ignore[attr-defined]
                     f"{_tail(p.out_path, 2000)}")  # type: ignore[attr-defined]
    return "\n".join(parts)


def finish_world(procs: list[subprocess.Popen[bytes]], timeout: float = 60.0,
                 *, expect_failure: Mapping[int, bool] | None = None) -> list[dict[str, Any]]:
    """Wait (at most ``timeout`` seconds) for every rank to exit and return each rank's
    result dict, rank order. A rank that exits non-zero (unless ``expect_failure[rank]``,
    whose result is then ``{"returncode": rc}``) or a world past its deadline: every rank
    is killed and :class:`WorldFailed` raised with all their output."""
    expected = dict(expect_failure or {})
    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [p for p, rc in zip(procs, codes, strict=True)
                      if rc is not None and rc != 0
                      and not expected.get(p.rank)]  # type: ignore[attr-defined]
            if failed:
                kill_world(procs, dump_stacks=True)
                ranks = ", ".join(str(p.rank) for p in failed)  # type: ignore[attr-defined]
                raise WorldFailed(f"rank(s) {ranks} of {len(procs)} failed:\n{describe(procs)}")
            if all(rc is not None for rc in codes):
                break
            if time.monotonic() > deadline:
                kill_world(procs, dump_stacks=True)
                raise WorldFailed(f"the world of {len(procs)} ranks did not finish within "
                                  f"{timeout:.0f} s (stacks of the live ranks are in their "
                                  f"stderr):\n{describe(procs)}")
            time.sleep(0.05)
    except BaseException:
        kill_world(procs)  # KeyboardInterrupt included: never leave ranks behind
        raise
    results = []
    for p in procs:
        if p.returncode != 0:
            results.append({"returncode": p.returncode})
            continue
        results.append(_result(p, procs))
    return results


def _result(p: subprocess.Popen[bytes], procs: list[subprocess.Popen[bytes]]) -> dict[str, Any]:
    lines = Path(p.out_path).read_text("utf-8", "replace").splitlines()  # type: ignore[attr-defined]
    for line in reversed(lines):
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])  # type: ignore[no-any-return]
    raise WorldFailed(f"rank {p.rank} exited without printing a result:\n"  # type: ignore[attr-defined]
                      f"{describe(procs)}")


def run_world(scenario: str, world: int, tmp_path: Path | str,
              args: Mapping[str, Any] | None = None, *, timeout: float = 60.0,
              env: Mapping[str, str] | None = None,
              worker: Path | str = WORKER) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``world`` ranks to the end; each rank's result dict, rank order.
    Raises :class:`WorldFailed` (with every rank's stderr) when a rank fails or the world
    runs past ``timeout`` seconds; never leaves a process behind."""
    procs = start_world(scenario, world, tmp_path, args, env=env,
                        peer_timeout=max(10.0, timeout), worker=worker)
    return finish_world(procs, timeout)


def wait_for_mark(proc: subprocess.Popen[bytes], text: str, timeout: float = 30.0) -> None:
    """Wait until the rank printed the progress mark ``text`` (``ctx.mark(text)``); raise
    :class:`WorldFailed` when it exits first or ``timeout`` passes (the rank is left running:
    the caller kills the world)."""
    want = MARK + text
    deadline = time.monotonic() + timeout
    while True:
        out = Path(proc.out_path).read_text("utf-8", "replace")  # type: ignore[attr-defined]
        if any(line == want for line in out.splitlines()):
            return
        if proc.poll() is not None:
            raise WorldFailed(f"rank {proc.rank} exited (status {proc.returncode}) before "  # type: ignore[attr-defined]
                              f"{text!r}:\n{describe([proc])}")
        if time.monotonic() > deadline:
            raise WorldFailed(f"rank {proc.rank} did not reach {text!r} within "  # type: ignore[attr-defined]
                              f"{timeout:.0f} s:\n{describe([proc])}")
        time.sleep(0.05)
