"""DTensor leaves (FSDP2, tensor parallel) on real torch.distributed process groups.

Every multi-rank check runs in real processes on gloo (tests/adapters/torch/dist_helpers.py,
scenarios in dist_worker.py); one world per scenario set, each rank doing many checks:

* world 1 writes the checkpoints (plain tensors + model + Adam; the same through FSDP2 on a
  one-device mesh; DTensors saved by ``save_sharded``), round-trips DTensors in place and
  refuses a Partial DTensor;
* world 2 saves DTensors sharded over its 2 ranks (one multi-rank save);
* worlds 2 and 4 restore all of them into ``Shard(0)``, ``Shard(1)``, ``Replicate()`` and
  2-D layouts (FSDP2 + TP's ``_StridedShard`` too), even and uneven, and into plain tensors;
* world 2 restores into DDP and FSDP2 models with Adam and trains on; and checks misuse.

Expected values are computed here, from the originals: each rank's local tensor must be its
``torch.chunk`` of the original and what torch's own ``distribute_tensor`` gives that rank.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torch.distributed")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("this torch has no gloo backend", allow_module_level=True)
pytest.importorskip("torch.distributed.tensor")

from dist_helpers import (  # noqa: E402  (after the skips)
    WorldFailed,
    finish_world,
    kill_world,
    run_world,
    start_world,
    wait_for_mark,
)
from dist_worker import dec, originals  # noqa: E402

from pitstop.adapters.torch._dtensor import _region, is_dtensor, tensor_leaf  # noqa: E402
from pitstop.adapters.torch._leaf import TensorLeaf  # noqa: E402
from pitstop.core.errors import UnsupportedStateError  # noqa: E402

TIMEOUT = 120.0  # a deadline for a hung world, never reached by a passing run


# --------------------------------------------------------------------------- worlds
@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The world-1 job: checkpoint directories and what it recorded."""
    tmp = tmp_path_factory.mktemp("dtensor")
    dirs = {"plain": str(tmp / "plain"), "fsdp1": str(tmp / "fsdp1"),
            "dtensor": str(tmp / "dtensor")}
    [result] = run_world("save1+save_sharded", 1, tmp,
                         args={"plain": dirs["plain"], "fsdp1": dirs["fsdp1"],
                               "dir": dirs["dtensor"]}, timeout=TIMEOUT)
    return {"tmp": tmp, "dirs": dirs, **result}


@pytest.fixture(scope="module")
def world2(saved: dict[str, Any]) -> list[dict[str, Any]]:
    """A 2-rank job: saves DTensors sharded over its ranks (``sharded2``), then restores
    every checkpoint into every layout, then the misuse checks, then the DDP and FSDP2
    restores of :func:`fsdp2` (one world for both: its start-up is most of its time)."""
    sources = {**saved["dirs"], "sharded2": sharded2(saved)}
    return run_world("save_sharded+reshard+misuse+fsdp", 2, saved["tmp"],
                     args={"dir": sources["sharded2"], "sources": sources,
                           "source": saved["dirs"]["dtensor"], "plain": saved["dirs"]["plain"],
                           "fsdp1": saved["dirs"]["fsdp1"]}, timeout=TIMEOUT)


def sharded2(saved: dict[str, Any]) -> str:
    """The checkpoint the 2-rank job of :func:`world2` writes."""
    return str(saved["tmp"] / "sharded2")


@pytest.fixture(scope="module")
def world4(saved: dict[str, Any], world2: list[dict[str, Any]]) -> list[dict[str, Any]]:
    sources = {"plain": saved["dirs"]["plain"], "dtensor": saved["dirs"]["dtensor"],
               "sharded2": sharded2(saved)}
    return [{"reshard": r} for r in run_world("reshard", 4, saved["tmp"],
                                               args={"sources": sources}, timeout=TIMEOUT)]


@pytest.fixture(scope="module")
def fsdp2(world2: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The world-1 checkpoints restored into DDP and FSDP2 models on 2 ranks (in world2)."""
    return [r["fsdp"] for r in world2]


# --------------------------------------------------------------------------- expectations
def chunk(x: torch.Tensor, n: int, dim: int, i: int) -> torch.Tensor:
    """Rank ``i``'s part of ``x`` split ``n`` ways on ``dim`` (``torch.chunk``; empty past
    the last chunk of an uneven split)."""
    parts = torch.chunk(x, n, dim)
    return parts[i] if i < len(parts) else x.narrow(dim, x.shape[dim], 0)


def expected(layout: str, x: torch.Tensor, world: int, coord: list[int]) -> torch.Tensor:
    """What the rank at ``coord`` holds of ``x`` in ``layout`` (dist_worker.layouts)."""
    if layout == "S0":
        return chunk(x, world, 0, coord[0])
    if layout == "R":
        return x
    if x.dim() < 2:
        if layout == "SSxS0":  # rows split by "tp" (mesh dim 1) first, then by "dp"
            return chunk(chunk(x, 2, 0, coord[1]), 2, 0, coord[0])
        return x  # Shard(1) does not apply: restored as a plain tensor
    return {
        "S1": lambda: chunk(x, world, 1, coord[0]),
        "S0xS1": lambda: chunk(chunk(x, 2, 0, coord[0]), 2, 1, coord[1]),
        "SSxS0": lambda: chunk(chunk(x, 2, 0, coord[1]), 2, 0, coord[0]),
        "RxS1": lambda: chunk(x, 2, 1, coord[1]),
    }[layout]()


def same(got: dict[str, Any], want: torch.Tensor, what: str) -> None:
    """``got`` (dist_worker.enc) holds exactly ``want``'s dtype, shape and bytes."""
    t = dec(got)
    assert (t.dtype, tuple(t.shape)) == (want.dtype, tuple(want.shape)), \
        f"{what}: {t.dtype}{list(t.shape)}, expected {want.dtype}{list(want.shape)}"
    a = t.contiguous().reshape(-1).view(torch.uint8)
    b = want.detach().contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(a, b), f"{what}: values differ\n got {t}\nwant {want}"


# --------------------------------------------------------------------------- world 1
def test_dtensor_round_trip_in_place_on_one_rank(saved: dict[str, Any]) -> None:
    s = saved["save1"]
    assert s["fsdp1_kinds"] == ["DTensor"]  # FSDP2 made every parameter a DTensor
    assert s["roundtrip_step"] == 1
    for k, v in originals().items():
        same(s["roundtrip_t"][k], v, f"t/{k}")
    for k, v in s["fsdp1"]["params"].items():
        same(s["roundtrip"]["params"][k], dec(v), f"model/{k}")
    for i, st in s["fsdp1"]["opt"].items():
        assert s["roundtrip"]["opt"][i]["kinds"] == st["kinds"]
        for k in ("step", "exp_avg", "exp_avg_sq"):
            same(s["roundtrip"]["opt"][i][k], dec(st[k]), f"opt/state/{i}/{k}")
    assert s["roundtrip_same_objects"]  # same Parameters (DTensors), same moment tensors
    assert s["roundtrip_trains"]


def test_dtensors_are_stored_as_shards_with_their_global_index(saved: dict[str, Any]) -> None:
    m = saved["save1"]["fsdp1_manifest"]
    assert m["t/a"] == [[[0, 8], [0, 6]]]
    assert m["model/2.weight"] == [[[0, 3], [0, 10]]]
    assert m["opt/state/1/exp_avg"] == [[[0, 10]]]
    assert m["opt/state/0/step"] is None  # a plain tensor: an ordinary entry
    assert saved["save_sharded"]["steps"] == [1]


def test_partial_dtensor_is_refused_with_the_fix(saved: dict[str, Any]) -> None:
    e = saved["save1"]["partial_save"]
    assert e["type"] == "UnsupportedStateError" and e["is_checkpoint_error"]
    for part in ("'grad_sum'", "Partial", "redistribute", "full_tensor()"):
        assert part in e["message"]
    assert saved["save1"]["partial_committed"] == []


# --------------------------------------------------------------------------- resharding
@pytest.mark.parametrize("world", [2, 4])
def test_restore_reshards_into_any_layout(world: int, request: pytest.FixtureRequest) -> None:
    results = request.getfixturevalue(f"world{world}")
    orig = originals()
    checked = 0
    for rank, res in enumerate(results):
        r = res["reshard"]
        assert r["same_objects"], f"rank {rank}: a restore replaced a DTensor or its storage"
        for what, rep in r["reports"].items():
            assert (rep["step"], rep["missing"], rep["mismatched"]) == (1, [], []), \
                f"rank {rank} {what}: {rep}"
        for layout, coord in r["coords"].items():
            for k, x in orig.items():
                want = expected(layout, x, world, coord)
                if k in r["truth"][layout]:  # the test's idea of the layout is torch's
                    same(r["truth"][layout][k], want, f"rank {rank} torch's {layout} of {k}")
                for src, got in r["restored"].items():
                    same(got[layout][k], want, f"rank {rank} {src} -> {layout}: t/{k}")
                    checked += 1
    # every source, layout, tensor and rank; uneven and empty shards included
    sources = {2: ["plain", "fsdp1", "dtensor", "sharded2"],
               4: ["plain", "dtensor", "sharded2"]}[world]
    assert sorted(results[0]["reshard"]["restored"]) == sorted(sources)
    assert checked == world * len(sources) * len(orig) * (6 if world == 4 else 3)


@pytest.mark.parametrize("world", [2, 4])
def test_restore_into_plain_tensors_assembles_the_whole_array(
        world: int, request: pytest.FixtureRequest) -> None:
    for rank, res in enumerate(request.getfixturevalue(f"world{world}")):
        for src, got in res["reshard"]["plain_target"].items():
            for k, x in originals().items():
                same(got[k], x, f"rank {rank} {src} -> plain t/{k}")


def test_uneven_layouts_include_empty_shards(world4: list[dict[str, Any]]) -> None:
    """3 rows on 4 ranks: rank 3 holds none of ``c`` and restores nothing into it."""
    for src in ("dtensor", "sharded2"):
        assert world4[3]["reshard"]["restored"][src]["S0"]["c"]["shape"] == [0, 7]


def test_a_multi_rank_save_stores_each_shard_once(saved: dict[str, Any],
                                                  world2: list[dict[str, Any]]) -> None:
    """Saved on 2 ranks (restored on 2 and 4 above): each rank's shard of ``t`` once, with
    its global index; each replicated tensor of ``r`` once, not once per rank."""
    import pitstop

    assert [r["save_sharded"]["steps"] for r in world2] == [[1], [1]]
    with pitstop.CheckpointManager(sharded2(saved), read_only=True) as mgr:
        arrays = mgr.metadata(1).arrays
    for k, x in originals().items():
        n = x.shape[0]
        top = -(-n // 2)
        assert [s.index for s in arrays[f"t/{k}"].shards] == [
            [[0, top], *[[0, m] for m in x.shape[1:]]],
            [[top, n], *[[0, m] for m in x.shape[1:]]]], k
        assert [s.index for s in arrays[f"r/{k}"].shards] == [[[0, m] for m in x.shape]], k


# --------------------------------------------------------------------------- misuse
def test_partial_target_is_refused(world2: list[dict[str, Any]]) -> None:
    for res in world2:
        e = res["misuse"]["partial"]
        assert e["type"] == "UnsupportedStateError" and e["is_checkpoint_error"]
        assert "'t/a'" in e["message"] and "redistribute" in e["message"]


def test_target_of_another_global_shape_is_refused_untouched(
        world2: list[dict[str, Any]]) -> None:
    for res in world2:
        m = res["misuse"]
        assert m["shape"]["type"] == "IncompatibleTargetError"
        assert "'t/a'" in m["shape"]["message"] and "[8, 6]" in m["shape"]["message"]
        assert "[6, 6]" in m["shape"]["message"]
        assert m["shape_untouched"]


def test_strided_shard_that_is_not_one_block_is_refused(world2: list[dict[str, Any]]) -> None:
    rows = {0: "[0, 1, 4, 5]", 1: "[2, 3, 6, 7]"}
    for rank, res in enumerate(world2):
        m = res["misuse"]
        assert m["strided"]["type"] == "UnsupportedStateError"
        assert rows[rank] in m["strided"]["message"] and "'t/a'" in m["strided"]["message"]
        assert m["strided_untouched"]


# --------------------------------------------------------------------------- DDP, FSDP2
def _same_record(got: dict[str, Any], want: dict[str, Any], what: str,
                 shard: tuple[int, int] | None = None) -> None:
    """A model_record equals another, or (``shard=(rank, world)``) its rows of each tensor:
    FSDP2 shards every parameter and moment on dim 0."""
    def part(t: torch.Tensor) -> torch.Tensor:
        return t if shard is None or t.dim() == 0 else chunk(t, shard[1], 0, shard[0])

    assert got["params"].keys() == want["params"].keys()
    for k, v in want["params"].items():
        same(got["params"][k], part(dec(v)), f"{what} param {k}")
    assert got["opt"].keys() == want["opt"].keys()
    for i, st in want["opt"].items():
        for k in ("step", "exp_avg", "exp_avg_sq"):
            same(got["opt"][i][k], part(dec(st[k])), f"{what} opt {i}/{k}")


def test_ddp_restores_and_continues_as_the_uninterrupted_run(
        saved: dict[str, Any], fsdp2: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(fsdp2):
        assert res["ddp_step"] == 1
        _same_record(res["ddp"], saved["save1"]["plain"], f"rank {rank} DDP")
        _same_record(res["ddp_continued"], saved["save1"]["continued"],
                     f"rank {rank} DDP, one step on")


@pytest.mark.parametrize("src", ["plain", "fsdp1"])
def test_fsdp2_restores_params_and_moments_into_a_fresh_optimizer(
        src: str, saved: dict[str, Any], fsdp2: list[dict[str, Any]]) -> None:
    """The usual resume: the optimizer has no state yet; its moments come back as DTensors
    laid out as their parameters."""
    for rank, res in enumerate(fsdp2):
        assert res[f"fresh_{src}_step"] == 1
        assert res[f"fresh_{src}_same_params"]
        _same_record(res[f"fresh_{src}"], saved["save1"][src], f"rank {rank} FSDP2 <- {src}",
                     shard=(rank, 2))
        for i, st in res[f"fresh_{src}"]["opt"].items():
            assert st["kinds"] == {"step": "Tensor", "exp_avg": "DTensor",
                                   "exp_avg_sq": "DTensor"}, f"opt {i}"


def test_fsdp2_continues_as_the_uninterrupted_run(saved: dict[str, Any],
                                                  fsdp2: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(fsdp2):
        _same_record(res["fresh_plain_continued"], saved["save1"]["continued"],
                     f"rank {rank} FSDP2, one step on", shard=(rank, 2))


def test_fsdp2_restores_moments_in_place(saved: dict[str, Any],
                                         fsdp2: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(fsdp2):
        assert res["stepped_step"] == 1 and res["stepped_same_moments"]
        _same_record(res["stepped"], saved["save1"]["fsdp1"], f"rank {rank} FSDP2 stepped",
                     shard=(rank, 2))


# --------------------------------------------------------------------------- in process
@pytest.mark.parametrize("shape,mesh,placements", [
    ((8, 6), (2,), ["S0"]), ((5, 3), (4,), ["S0"]), ((3, 7), (4,), ["S1"]),
    ((10, 4), (2, 2), ["S0", "S1"]), ((8, 4), (2, 2), ["SS0", "S0"]),
    ((16, 4), (2, 2), ["SS0", "S0"]), ((6, 6), (2, 2), ["R", "S0"]), ((7,), (4,), ["R"]),
    ((9, 5), (2, 2), ["S0", "S0"]),
])
def test_regions_agree_with_torchs_planner(shape: tuple[int, ...], mesh: tuple[int, ...],
                                           placements: list[str]) -> None:
    """The region of every mesh coordinate is what DCP's planner computes (without any
    process group: coordinates given)."""
    from itertools import product

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    made = [Replicate() if p == "R" else _StridedShard(0, split_factor=2) if p == "SS0"
            else Shard(int(p[1])) for p in placements]
    for coord in product(*(range(n) for n in mesh)):
        region = _region(shape, mesh, coord, made, "w")
        sizes, offsets = _compute_local_shape_and_global_offset(shape, mesh, list(coord), made)
        assert tuple(b - a for a, b in region) == tuple(sizes), coord
        if all(sizes):
            assert tuple(a for a, _ in region) == tuple(offsets), coord


def test_region_refuses_what_is_not_one_block() -> None:
    from torch.distributed.tensor.placement_types import _StridedShard

    with pytest.raises(UnsupportedStateError, match=r"tensor 'w'.*rows \[0, 1, 4, 5\]"):
        _region((8, 2), (2,), (0,), [_StridedShard(0, split_factor=2)], "w")


def test_plain_tensors_stay_plain_leaves() -> None:
    t = torch.zeros(3)
    assert not is_dtensor(t) and type(tensor_leaf(t, "x")) is TensorLeaf


# --------------------------------------------------------------------------- the harness
def test_a_failing_rank_fails_the_world_with_its_stderr(tmp_path: Path) -> None:
    with pytest.raises(WorldFailed) as e:
        run_world("hold", 2, tmp_path, args={"fail": 1}, timeout=TIMEOUT)
    text = str(e.value)
    # rank 0, blocked in its barrier, was killed or failed on its own when its peer left
    assert re.match(r"rank\(s\) (0, )?1 of 2 failed", text), text[:200]
    assert "RuntimeError: boom from rank 1" in text and "--- rank 0 (" in text


def test_a_killed_rank_never_hangs_the_others(tmp_path: Path) -> None:
    procs = start_world("hold", 2, tmp_path, args={"sleeper": 1}, peer_timeout=20)
    try:
        wait_for_mark(procs[0], "ready", timeout=TIMEOUT)
        wait_for_mark(procs[1], "ready", timeout=TIMEOUT)
        procs[1].kill()  # SIGKILL mid-way, as a preempted machine
        with pytest.raises(WorldFailed) as e:
            finish_world(procs, timeout=TIMEOUT, expect_failure={1: True})
    finally:
        kill_world(procs)
    assert "rank(s) 0 of 2 failed" in str(e.value)  # gloo tells rank 0 its peer is gone
    assert procs[1].returncode == -9
    assert all(p.poll() is not None for p in procs)  # nothing left behind
