"""Real multi-process JAX jobs (``jax.distributed`` on 127.0.0.1, CPU devices, gloo) saving
and restoring one checkpoint together; each process runs tests/adapters/jax/mp_worker.py.

One 2-process job saves (and checks the coordinator and a same-size restore on the way);
jobs of 1 and 4 processes restore what it saved; a 2-process job loses a process mid-save.
Every wait has a deadline; a job that fails or runs late is killed whole and the failure
shows every process's exit status, stderr and stdout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

import pitstop

HERE = Path(__file__).absolute().parent
ROOT = HERE.parents[2]
WORKER = HERE / "mp_worker.py"
RESULT = "PITSTOP_RESULT "
MARK = "PITSTOP_MARK "
#: the deadline of one job (start-up is 3-6 s on two busy cores; a job never needs more)
JOB_TIMEOUT_S = 150.0

class JobFailed(AssertionError):
    """A process failed, or the job ran past its deadline; the message holds every
    process's exit status, stderr and stdout."""


def free_port() -> int:
    """A port the kernel says is free now (process 0's coordination service binds it a
    moment later; another program taking it in between fails the job's start, loudly)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_job(scenario: str, processes: int, directory: Path, args: Mapping[str, Any] | None
              = None, *, devices: int = 2) -> list[subprocess.Popen[bytes]]:
    """Start ``processes`` worker processes of one job (``devices`` CPU devices each); with
    one process, a plain JAX process (no ``jax.distributed``)."""
    logs = directory.parent / f"logs-{directory.name}-{scenario}-{processes}-{time.monotonic_ns()}"
    logs.mkdir(parents=True)
    env = dict(os.environ)
    env.update({"JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
                "TF_CPP_MIN_LOG_LEVEL": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", ""))
                                              if p)})
    port = free_port() if processes > 1 else 0
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(processes):
            with open(logs / f"p{i}.out", "wb") as out, open(logs / f"p{i}.err", "wb") as err:
                p = subprocess.Popen(
                    [sys.executable, str(WORKER), scenario, str(i), str(processes), str(port),
                     str(directory), json.dumps(dict(args or {}))],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, cwd=str(ROOT),
                    start_new_session=True)
            p.logs = logs  # type: ignore[attr-defined]
            procs.append(p)
    except BaseException:
        kill_job(procs)
        raise
    return procs


def kill_job(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL every process still running (and what it started) and reap them all."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be refused
            pass


def _tail(path: Path, n: int) -> str:
    data = path.read_bytes() if path.exists() else b""
    return ("..." if len(data) > n else "") + data[-n:].decode("utf-8", "replace")


def describe(procs: list[subprocess.Popen[bytes]]) -> str:
    """Every process's exit status, stderr and stdout (tails)."""
    parts = []
    for i, p in enumerate(procs):
        rc = p.poll()
        how = "still running" if rc is None else (
            f"killed by signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}")
        logs: Path = p.logs  # type: ignore[attr-defined]
        parts.append(f"--- process {i} ({how}) stderr:\n{_tail(logs / f'p{i}.err', 5000)}\n"
                     f"--- process {i} stdout:\n{_tail(logs / f'p{i}.out', 2000)}")
    return "\n".join(parts)


def finish_job(procs: list[subprocess.Popen[bytes]], *, timeout: float = JOB_TIMEOUT_S,
               may_fail: frozenset[int] = frozenset()) -> list[dict[str, Any]]:
    """Wait for every process to exit; each one's result (``{"returncode": rc}`` for one in
    ``may_fail`` that exited with an error or a signal). Any other failure, or the deadline:
    the whole job is killed and :class:`JobFailed` raised with every process's output."""
    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [i for i, rc in enumerate(codes) if rc not in (None, 0) and i not in may_fail]
            if failed:
                kill_job(procs)
                raise JobFailed(f"process(es) {failed} of {len(procs)} failed:\n{describe(procs)}")
            if all(rc is not None for rc in codes):
                break
            if time.monotonic() > deadline:
                kill_job(procs)
                raise JobFailed(f"the job of {len(procs)} processes did not finish within "
                                f"{timeout:.0f} s:\n{describe(procs)}")
            time.sleep(0.05)
    except BaseException:
        kill_job(procs)  # KeyboardInterrupt too: never leave a process behind
        raise
    results: list[dict[str, Any]] = []
    for i, p in enumerate(procs):
        lines = (p.logs / f"p{i}.out").read_text("utf-8", "replace").splitlines()  # type: ignore[attr-defined]
        found = [json.loads(line[len(RESULT):]) for line in lines if line.startswith(RESULT)]
        if p.returncode != 0:
            results.append({"returncode": p.returncode, **(found[-1] if found else {})})
        elif not found:
            raise JobFailed(f"process {i} exited without a result:\n{describe(procs)}")
        else:
            results.append(found[-1])
    return results


def run_job(scenario: str, processes: int, directory: Path,
            args: Mapping[str, Any] | None = None, *, devices: int = 2
            ) -> list[dict[str, Any]]:
    return finish_job(start_job(scenario, processes, directory, args, devices=devices))


# ---------------------------------------------------------------------------- one saving job
@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """A checkpoint directory written by 2 processes (2 devices each): steps 1, 2 and 4."""
    directory = tmp_path_factory.mktemp("jaxmp") / "ckpt"
    results = run_job("save", 2, directory, {"probe": True, "restore_here": True,
                                              "retention": True,
                                              "skip": True})
    return directory, results


def test_the_coordinator_exchanges_on_two_channels_and_cleans_up(saved: Any) -> None:
    _directory, results = saved
    for rank, r in enumerate(results):
        probe = r["probe"]
        assert probe["instance"] == "probe.0"
        assert probe["channels_in_order"] is True  # two threads, 25 rounds each, no mix-up
        assert probe["big_ok"] is True and probe["empty"] is True
        assert probe["ints"] == [[0, 7], [1, 7]]
        # 28 rounds on "control" and 25 on "persist", 8 to a batch: the older batches were
        # deleted; the newest is all that is left until every process closed, then nothing
        assert probe["keys_before_close"] == sorted(
            [f"control/3/{seq}/{r}" for seq in range(24, 28) for r in (0, 1)]
            + ["persist/3/24/0", "persist/3/24/1"]), rank
        assert probe["keys_after_close"] == []
        assert "is closed" in probe["closed_error"]
    error = results[0]["probe"]["timeout_error"]
    assert error is not None and error.startswith("asking nobody: process 0 of 2 (alone.0) "
                                                  "waited 1 s for process 1 (DEADLINE_EXCEEDED")
    assert "Restart the job" in error and "JaxCoordinator(name=...)" in error
    assert "type.googleapis.com" not in error


def test_processes_agree_on_all_steps_after_retention_and_on_preemption(saved: Any) -> None:
    """Retention runs on process 0; once wait() returned, every process lists what it left
    (process 1 used to list [0, 2, 4] while process 0 said [2, 4]). A SIGTERM on process 1
    alone is every process's reached_preemption(5), and both save step 5 before leaving."""
    _directory, results = saved
    for rank, r in enumerate(results):
        got = r["retention"]
        assert got["all_steps"] == [2, 4], rank
        assert got["before_signal"] is False and got["reached"] is True, rank
        assert got["noted"] == 1 and got["closed"] is True, rank
        assert got["after"] == [4, 5], rank  # keep_last=2


def test_two_processes_save_one_checkpoint(saved: Any) -> None:
    directory, results = saved
    for rank, r in enumerate(results):
        # found by itself: the manager saw jax.distributed and made the coordinator
        assert r["coordinator"] == ["JaxCoordinator", "auto.0", rank, 2]
        assert r["steps"] == [1, 2, 4]  # save(1), then step() every 2 steps
        assert r["keys_left"] == []  # both managers closed: nothing left in the store
    with pitstop.CheckpointManager(directory, read_only=True) as mgr:
        assert mgr.all_steps() == [1, 2, 4]
        m = mgr.metadata(4)
    assert m.world == 2 and len(m.ranks) == 1
    # each shard of each global array once (a shard two processes hold is written once),
    # and together the shards make the array
    expect = {"w": (4, 4), "across": (2, 4), "within": (2, 2), "train/params/dense/kernel": (4, 4),
              "train/opt_state/0/1/dense/kernel": (4, 4),  # Adam's mu
              "train/opt_state/0/2/dense/kernel": (4, 4)}  # and nu
    for key, (n, itemsize) in expect.items():
        entry = m.arrays[key]
        assert entry.shards is not None and len(entry.shards) == n, (key, entry)
        assert entry.shape == [8, 8]
        assert len({tuple(map(tuple, s.index or [])) for s in entry.shards}) == n
        assert sum(s.length for s in entry.shards) == 8 * 8 * itemsize
    # arrays every process holds whole (P()), the keys, the step and Adam's count: one entry
    # that rank 1's view shares; per-process state: rank 1's own
    whole = ["rep", "train/step", "train/params/dense/bias", "train/opt_state/0/0",
             "train/opt_state/0/1/dense/bias", "train/opt_state/0/2/dense/bias",
             "key/key_data", "gkey/key_data", "raw_key"]
    assert all(m.arrays[k].shards is None for k in whole)
    rank1 = m.ranks[0]
    assert sorted(rank1.arrays) == ["local"] and not rank1.absent
    assert m.values["seen"] == 4 and rank1.values is not None and rank1.values["seen"] == 14
    # every distinct byte once: 6 global 8x8 arrays (one float16) 1408 B, the whole ones
    # 160 B, and each process's own 24 B
    stored = m.stored()
    assert len({(p.file, p.offset) for _k, p in stored}) == len(stored)
    assert sum(p.length for _k, p in stored) == 1408 + 160 + 2 * 24
    assert any(f.startswith("data-r00001") for f in m.files)  # process 1 wrote its part


def test_a_busy_process_makes_every_process_skip_and_count_it(saved: Any) -> None:
    """Process 0 had a free buffer at step 4, process 1 none: both skipped step 4 (neither
    saved it alone), both counted it, and the next save says it follows one skip."""
    _directory, results = saved
    assert [r["skip"]["free_at_4"] for r in results] == [True, False]
    for r in results:
        assert r["skip"]["saved"] == [2, 6]
        assert r["skip"]["steps"] == [2, 6]
        assert r["skip"]["skipped"] == [1, [4]]
        assert r["skip"]["before"] == [[2, 0], [6, 1]]


def test_restore_on_the_same_two_processes_into_another_sharding(saved: Any) -> None:
    _directory, results = saved
    for rank, r in enumerate(results):
        restore = r["restore"]
        assert restore["step"] == 4
        assert restore["problems"] == [], rank
        assert restore["load_problems"] == [], rank
        assert restore["warnings"] == []  # same number of processes: nothing to say


#: what an eval_shape target (no sharding) of each global array gets on the job of 2
#: processes x 2 devices that saved it: the saved layout
AS_SAVED = {"w": ["('x',)", {"x": 4}, []], "across": ["('p',)", {"p": 2, "l": 2}, []],
            "within": ["(None, 'l')", {"p": 2, "l": 2}, []]}


def test_restore_on_the_same_two_processes_into_the_saved_shardings(saved: Any) -> None:
    _directory, results = saved
    for r in results:
        assert r["restore"]["as_saved"] == AS_SAVED


def test_load_into_an_abstract_typed_key_that_spans_processes(saved: Any) -> None:
    _directory, results = saved
    for r in results:
        assert r["restore"]["abstract_key_load"] == []


@pytest.mark.parametrize("processes,devices", [(1, 8), (4, 2)], ids=["1-process", "4-processes"])
def test_restore_on_another_number_of_processes(saved: Any, processes: int, devices: int
                                                ) -> None:
    directory, _results = saved
    results = run_job("restore", processes, directory, {"saved_world": 2}, devices=devices)
    for rank, r in enumerate(results):
        assert r["coordinator"] == (None if processes == 1 else "JaxCoordinator")
        assert r["step"] == 4
        assert r["problems"] == [], rank  # global arrays resharded; rank r got rank r % 2's
        assert r["load_problems"] == [], rank
        # a job of 8 devices cannot hold the saved meshes of 4: refused on every rank (the
        # rank that found it says why, the others that it failed there)
        assert r["as_saved"].startswith(("IncompatibleTargetError", "CoordinationError"))
    refusals = [r["as_saved"] for r in results if "IncompatibleTargetError" in r["as_saved"]]
    assert refusals and all(
        "'w'" in t and "its mesh has 4 devices and this job has 8" in t
        and "sharding=NamedSharding(mesh, P(...))" in t for t in refusals)
    for rank, r in enumerate(results):
        if processes == 1:  # (a one-process target sharding: the key data is moved there)
            assert r["abstract_key_load"] == []
        said = " ".join(r["warnings"])
        assert f"was saved by 2 ranks and is restored by {processes}" in said, r["warnings"]
        assert f"rank {rank} gets saved rank {rank % 2}'s" in said


# ---------------------------------------------------------------------------- a process dies
def test_a_process_killed_mid_save_aborts_the_job_and_commits_nothing(tmp_path: Path) -> None:
    """JAX's default: the coordination service notices the missing heartbeats and aborts the
    survivor (SIGABRT) while it waits in the save's exchange; step 2 never commits and
    step 1 stays the newest, as a fresh manager sees after the job is gone."""
    directory = tmp_path / "ckpt"
    procs = start_job("die", 2, directory, {"victim": 1, "heartbeat_s": 3})
    results = finish_job(procs, may_fail=frozenset({0, 1}))
    assert results[1]["returncode"] == -signal.SIGKILL, describe(procs)
    # JAX ends the survivor itself; pitstop's own wait (600 s) never comes to an end
    assert results[0]["returncode"] == -signal.SIGABRT, describe(procs)
    assert "error" not in results[0]  # it never got an answer to print
    logs: Path = procs[0].logs  # type: ignore[attr-defined]
    assert (MARK + "saving 2") in (logs / "p0.out").read_text("utf-8", "replace")
    err = (logs / "p0.err").read_text("utf-8", "replace")
    assert "Terminating process because the JAX distributed service detected fatal " \
           "errors" in err and "stopped sending heartbeats" in err, err[-3000:]
    with pitstop.CheckpointManager(directory, read_only=True) as mgr:
        assert mgr.all_steps() == [1]
        assert mgr.latest_step() == 1
        with pytest.warns(UserWarning, match="saved by 2 ranks and is restored by 1"):
            assert int(mgr.load()["train"]["step"]) == 1
    # the leader's half-written step 2 is a temporary directory, which the next writer sweeps
    assert [p.name for p in directory.iterdir() if "step_0000000002" in p.name and
            not p.name.startswith(".tmp-")] == []
    assert any(p.name.startswith(".tmp-step_0000000002") for p in directory.iterdir())
    with pitstop.CheckpointManager(directory) as mgr:
        assert mgr.all_steps() == [1]
    assert not any("step_0000000002" in p.name for p in directory.iterdir())


def test_with_recoverability_the_survivor_gets_an_error(tmp_path: Path) -> None:
    """With ``jax_enable_recoverability`` the survivor lives on: the save's exchange ends
    after the coordinator's timeout with an error that says what happened and what to do,
    and nothing is committed."""
    directory = tmp_path / "ckpt"
    procs = start_job("die", 2, directory, {"victim": 1, "recoverable": True, "timeout_s": 2})
    results = finish_job(procs, may_fail=frozenset({1}))
    assert results[1]["returncode"] == -signal.SIGKILL, describe(procs)
    error = results[0]["error"]
    # the save's error (the handle's), naming the exchange, the process waited for and why
    assert error.startswith("CheckpointWriteError: saving step 2 to "), error
    assert "exchanging what each rank holds: process 0 of 2 (auto.0) waited 2 s for " \
           "process 1 (DEADLINE_EXCEEDED" in error
    assert "Restart the job (every process)" in error
    assert error.endswith("The step is not committed; committed checkpoints are intact.")
    with pitstop.CheckpointManager(directory, read_only=True) as mgr:
        assert mgr.all_steps() == [1]
