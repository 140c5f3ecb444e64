"""Multi-rank saves on torch.distributed: real gloo worlds of 1, 2 and 4 processes on
127.0.0.1 (scenarios in dist_save_scenarios.py), a rank SIGKILLed in the middle of a save,
SIGTERM to one rank, every rank killed after its snapshot."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from dist_helpers import (  # noqa: E402
    RESULT,
    WorldFailed,
    describe,
    kill_world,
    run_world,
    start_world,
    wait_for_mark,
)
from dist_worker import dec, originals  # noqa: E402

from pitstop.core.format.validate import parse  # noqa: E402
from pitstop.core.restore.read import CheckpointReader  # noqa: E402
from pitstop.core.storage import LocalStorage  # noqa: E402

WORKER = Path(__file__).with_name("dist_save_worker.py")


def world(scenario: str, n: int, tmp: Path, **args: Any) -> list[dict[str, Any]]:
    return run_world(scenario, n, tmp, args, worker=WORKER, timeout=90)


def start(scenario: str, n: int, tmp: Path, **args: Any) -> list[Any]:
    return start_world(scenario, n, tmp, args, worker=WORKER)


def result_of(proc: Any, timeout: float = 60) -> dict[str, Any]:
    """The result line of one rank that exits by itself (the others may be dead)."""
    proc.wait(timeout)
    for line in Path(proc.out_path).read_text().splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    raise WorldFailed(f"rank {proc.rank} printed no result:\n{describe([proc])}")


def manifest(directory: Path, step: int) -> Any:
    path = directory / f"step_{step:010d}" / "manifest.json"
    return parse(path.read_bytes(), str(path))


def rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``t`` under Shard(0) on ``world`` ranks (torch.chunk's)."""
    size = math.ceil(t.shape[0] / world)
    return t[rank * size:(rank + 1) * size]


def same(a: dict[str, Any], b: torch.Tensor) -> bool:
    t = dec(a)
    return t.dtype == b.dtype and t.shape == b.shape and bool(
        (t.view(torch.uint8) == b.contiguous().view(torch.uint8)).all()) if t.numel() else \
        tuple(t.shape) == tuple(b.shape)


def test_save_on_2_ranks_restore_on_1_2_4_and_back(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    got = world("world_save+world_restore", 2, tmp_path, dir=str(d), step=2)
    saved = [r["world_save"] for r in got]
    assert [r["committed"] for r in saved] == [True, True]
    assert saved[0]["record"] == saved[1]["record"]  # DDP: the same everywhere

    m = manifest(d, 2)
    assert m.world == 2 and m.format_version == "2.1"
    # replicated state once: the files hold each stored value once (the model and Adam,
    # written half by each rank; each rank's own tensor; each shard of the DTensors)
    unique = sum(p.length for _k, p in m.stored())
    assert sum(m.files.values()) < 1.2 * unique + 4096 * len(m.files)
    assert {f.split("-")[1] for f in m.files} == {"r00000", "r00001"}
    assert set(m.view(1).arrays) == set(m.arrays)
    assert m.rank_specific() == ["info", "mine"]
    # every shard of the DTensors, with its place in the global tensor
    assert [s.index for s in m.arrays["t/b"].shards] == [[[0, 3], [0, 3]], [[3, 5], [0, 3]]]

    orig = originals()

    def check(results: list[dict[str, Any]], step: int, saved_world: int, plus: float) -> None:
        n = len(results)
        for rank, r in enumerate(results):
            src = rank % saved_world
            assert r["step"] == step
            if step == 2:
                assert r["record"] == saved[0]["record"]
                # the same save through DCP, loaded by DCP on this world: the same bytes
                assert r["dcp_agrees"] == {k: True for k in orig}, r["dcp_agrees"]
            assert same(r["mine"], torch.full((4,), float(src + plus)))
            assert r["info"] == {"rank": src}
            for k, v in orig.items():
                assert same(r["t"][k], rows(v, rank, n)), (n, rank, k)
            changed = [w for w in r["warnings"] if "restored by" in w]
            assert bool(changed) == (n != saved_world), r["warnings"]
            if changed:
                assert "'info', 'mine'" in changed[0]

    check([r["world_restore"] for r in got], 2, 2, 10)
    # one process, no process group: rank 0's part, whole tensors assembled from shards
    with pytest.warns(UserWarning, match="restored by 1"):
        from dist_save_scenarios import ddp_state  # noqa: PLC0415

        import pitstop
        state = ddp_state(5)
        state["t"] = {k: torch.full_like(v, -7) for k, v in orig.items()}
        with pitstop.CheckpointManager(d, read_only=True) as mgr:
            assert mgr.restore(state) == 2
    assert state["mine"].tolist() == [10.0] * 4 and state["info"] == {"rank": 0}
    assert all(torch.equal(state["t"][k], v) for k, v in orig.items())
    # four ranks: resharded; they go on saving step 3, which two ranks restore
    check(world("world_restore", 4, tmp_path, dir=str(d), save_again=3), 2, 2, 10)
    assert manifest(d, 3).world == 4
    check(world("world_restore", 2, tmp_path, dir=str(d)), 3, 4, 10)


def test_a_rank_killed_in_the_middle_of_a_save(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    procs = start("kill_mid_save", 2, tmp_path, dir=str(d), misuse=str(tmp_path / "misuse"))
    try:
        wait_for_mark(procs[1], "writing 2", timeout=60)
        procs[1].kill()
        r = result_of(procs[0])
    finally:
        kill_world(procs)
    assert r["error"]["type"] == "CheckpointWriteError", r
    assert "lost the other ranks" in r["error"]["message"]
    assert "not committed" in r["error"]["message"]
    assert r["waited_s"] < 25  # the peer's death was seen, not the 30 s timeout
    assert r["latest"] == 1
    assert r["listing"] == [".pitstop", "step_0000000001"]  # nothing of step 2 is left

    # before that, in the same world: ranks that disagree fail together, at once
    m = r["misuse"]
    # a manager made on rank 0 alone waits for the others, then says what to do
    assert m["lonely"]["type"] == "CoordinationError", m
    assert "rank(s) [1] have not made theirs within 3 s" in m["lonely"]["message"]
    assert "distributed=False" in m["lonely"]["message"]
    assert 3 <= m["lonely_s"] < 25
    # and the ranks' next managers still meet (below)
    assert m["steps"]["type"] == "CoordinationError", m
    assert "rank 0: 3, rank 1: 4" in m["steps"]["message"]
    assert m["bad_state"]["is_checkpoint_error"], m
    assert "rank 1" in m["bad_state"]["message"]
    assert m["waited_s"] < 25
    assert m["exists"]["type"] == "StepExistsError"
    assert m["steps_after"] == [6]


def test_sigterm_to_one_rank_saves_the_same_step_on_every_rank(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    procs = start("signal_loop", 2, tmp_path, dir=str(d))
    try:
        wait_for_mark(procs[1], "training", timeout=60)
        os.kill(procs[1].pid, signal.SIGTERM)
        for p in procs:
            p.wait(60)
    finally:
        kill_world(procs)
    assert [p.returncode for p in procs] == [-signal.SIGTERM] * 2, describe(procs)
    steps = sorted(p.name for p in d.iterdir() if p.name.startswith("step_"))
    assert steps[0] == "step_0000000000" and len(steps) == 2, steps  # save_every_steps: 0
    reader = CheckpointReader(LocalStorage(str(d), create=False), steps[-1])
    m = reader.manifest
    assert m.world == 2
    # each rank's own tensor holds the step it saved: the same boundary on both
    for rank in (0, 1):
        reader.manifest = m.view(rank)
        assert reader.load()["mine"].tolist() == [m.step] * 4


def test_every_rank_killed_after_its_snapshot_resumes_from_memory(tmp_path: Path) -> None:
    d, tier = tmp_path / "ck", tmp_path / "tier"
    tier.mkdir()
    procs = start("tier_crash", 2, tmp_path, dir=str(d), tier=str(tier))
    try:
        for p in procs:
            wait_for_mark(p, "snapshot 2", timeout=60)
        time.sleep(0.2)  # save() returned on both (the mark comes from the persist thread)
    finally:
        kill_world(procs)
    assert sorted(p.name for p in d.iterdir() if p.name.startswith("step_")) == [
        "step_0000000001"]
    got = world("tier_resume", 2, tmp_path, dir=str(d), tier=str(tier))
    from dist_save_scenarios import expected_ddp  # noqa: PLC0415
    for rank, r in enumerate(got):
        assert r["step"] == 2
        assert r["steps"] == [1, 2]
        assert same(r["mine"], torch.full((4,), float(rank + 100)))
        assert r["record"] == expected_ddp(rank, 1)
    assert manifest(d, 2).world == 2
