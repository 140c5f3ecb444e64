"""Probe scenarios for multi-rank saves: what real users do wrong and what goes wrong around
them (misuse, failures, kills, exact resume, FSDP2 resharding). Registered into
dist_worker's ``SCENARIOS`` by dist_probe_worker.py; test_distributed_user_scenarios.py starts the
worlds and judges the results. See dist_worker.py for how a scenario is written.

Every scenario catches what a pitstop call raises (``error_of`` / :func:`timed`) and
reports it, so one misbehaving call never hides the others' results.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
import warnings
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from dist_save_scenarios import coordinator  # type: ignore[import-not-found]
from dist_worker import (  # type: ignore[import-not-found]
    RESULT,
    Ctx,
    distribute,
    enc,
    error_of,
    layouts,
    make_model,
    mesh_of,
    model_record,
    originals,
    say,
    scenario,
    train_step,
)


def opts(**kw: Any) -> dict[str, Any]:
    """A self-contained manager: no signal handlers, no memory tier (unless asked)."""
    out: dict[str, Any] = {"save_on_signals": None, "memory_tier": False}
    out.update(kw)
    return out


def small_state(rank: int, value: float = 0.0) -> dict[str, Any]:
    """Replicated ``w``, a per-rank tensor ``mine`` and a per-rank value ``info``."""
    return {"w": torch.arange(12.0) + value, "mine": torch.full((3,), float(rank) + value),
            "info": {"rank": rank, "v": value}}


def timed(fn: Any) -> dict[str, Any]:
    """:func:`error_of` plus how long the call took (``s``)."""
    t0 = time.monotonic()
    out = error_of(fn)
    out["s"] = round(time.monotonic() - t0, 2)
    return out


def exit_now(out: dict[str, Any]) -> NoReturn:
    """Print the result and leave without the harness's final barrier (the job's groups may
    be broken on purpose)."""
    say(RESULT + json.dumps(out))
    os._exit(0)


def step_of(restored: Any) -> int:
    """A restore's step as a plain int (it must have restored one)."""
    assert restored is not None, "nothing was restored"
    return int(restored)


def identity(directory: Any) -> str:
    return json.loads((directory / ".pitstop" / "directory.json").read_text())["directory_id"]


# --------------------------------------------------------------------------- misuse
@scenario
def p_order(ctx: Ctx) -> dict[str, Any]:
    """Managers of two directories made in a different order on the ranks (A then B on rank
    0, B then A on rank 1). Only made and closed: a save would wait out the timeout."""
    import pitstop

    out: dict[str, Any] = {"made": {}, "errors": {}}
    mgrs = {}
    for name in (["A", "B"] if ctx.rank == 0 else ["B", "A"]):
        try:
            mgrs[name] = pitstop.CheckpointManager(ctx.tmp / f"order-{name}",
                                                   distributed=coordinator(5), **opts())
        except Exception as e:  # noqa: BLE001
            out["errors"][name] = f"{type(e).__name__}: {e}"
    dist.barrier()
    for name, mgr in mgrs.items():
        out["made"][name] = {"id": mgr.directory_id, "disk": identity(ctx.tmp / f"order-{name}")}
    for mgr in mgrs.values():
        mgr.close()
    # two managers (two directories) per rank, made in the same order, used alternately
    a = pitstop.CheckpointManager(ctx.tmp / "two-A", distributed=coordinator(10), **opts())
    b = pitstop.CheckpointManager(ctx.tmp / "two-B", distributed=coordinator(10), **opts())
    for s in (1, 2, 3):
        a.step(s, small_state(ctx.rank, s))
        a.save(s, small_state(ctx.rank, s))
        b.save(s, small_state(ctx.rank, 10 * s))
    a.wait()
    b.wait()
    sa, sb = small_state(ctx.rank, -1), small_state(ctx.rank, -1)
    out["two"] = {"a": step_of(a.restore(sa)), "b": step_of(b.restore(sb)),
                  "mine_a": sa["mine"][0].item(), "mine_b": sb["mine"][0].item(),
                  "steps": [a.all_steps(), b.all_steps()]}
    a.close()
    b.close()
    return out


@scenario
def p_with(ctx: Ctx) -> dict[str, Any]:
    """A `with mgr:` block left on an exception on rank 1 (whose process lives on, as in a
    loop that catches and logs) while rank 0 goes on saving (3 s coordinator timeout)."""
    import pitstop

    out: dict[str, Any] = {}
    try:
        with pitstop.CheckpointManager(ctx.tmp / "with", distributed=coordinator(3),
                                       **opts()) as mgr:
            mgr.save(1, small_state(ctx.rank)).wait()
            if ctx.rank == 1:
                raise ValueError("a bug in rank 1's training code")
            out["save2"] = timed(lambda: mgr.save(2, small_state(ctx.rank)).wait())
            out["step3"] = timed(lambda: mgr.step(3, small_state(ctx.rank)))
    except ValueError as e:
        out["raised"] = str(e)
    out["listing"] = sorted(os.listdir(ctx.tmp / "with"))
    dist.barrier()  # the job's own group is intact: later managers still work
    return out


@scenario
def p_restore(ctx: Ctx) -> dict[str, Any]:
    """Restore misuse on a 2-rank checkpoint (steps 1, 2, 3): different steps asked on the
    ranks, a missing step, a refusal on one rank only, strict=False with other extra/missing
    keys per rank, load() and read_only managers on every rank, rollback, NaN on one rank."""
    import pitstop

    out: dict[str, Any] = {}
    d = ctx.tmp / "restore"
    with pitstop.CheckpointManager(d, distributed=coordinator(10), async_save=False,
                                   nonfinite_guard=True, **opts()) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, small_state(ctx.rank, s))
        # NaN on rank 1 only, in an array (save) and in the metrics (step): no save anywhere
        bad = small_state(ctx.rank, 4)
        if ctx.rank == 1:
            bad["mine"][0] = float("nan")
        out["nan_save"] = error_of(lambda: mgr.save(4, bad).wait())
        out["nan_step"] = error_of(lambda: mgr.step(
            5, small_state(ctx.rank, 5), metrics={"loss": float("nan") if ctx.rank else 1.0}))
        out["steps"] = mgr.all_steps()
        # restore(step=N) with N missing
        out["missing"] = error_of(lambda: mgr.restore(small_state(ctx.rank), step=99))
        # a refusal on rank 1 only (an extra key, strict): rank 0's state?
        st = small_state(ctx.rank, -1)
        if ctx.rank == 1:
            st["extra"] = torch.zeros(2)
        out["refused"] = error_of(lambda: mgr.restore(st, strict=True))
        out["refused_w0"] = float(st["w"][0])
        # strict=False: rank 1 has an extra key, rank 0 lacks one
        st = small_state(ctx.rank, -1)
        if ctx.rank == 1:
            st["extra"] = torch.zeros(2)
        else:
            del st["mine"]
        r = mgr.restore(st, strict=False)
        assert r is not None
        out["nonstrict"] = {"step": int(r), "missing": r.missing_keys,
                            "unexpected": r.unexpected_keys, "w0": float(st["w"][0]),
                            "mine": st["mine"].tolist() if "mine" in st else None}
        # load() without a target: this rank's part
        got = mgr.load()
        out["load"] = {"mine": got["mine"].tolist(), "info": got["info"]}
        # rollback(): the newest all-finite step
        st = small_state(ctx.rank, -1)
        out["rollback"] = step_of(mgr.rollback(st))
        out["rollback_mine"] = st["mine"].tolist()
    dist.barrier()
    # read-only managers on every rank: each its own part
    with pitstop.CheckpointManager(d, read_only=True) as ro:
        st = small_state(ctx.rank, -1)
        out["ro"] = {"step": step_of(ro.restore(st)), "mine": st["mine"].tolist(),
                     "info": st["info"], "load": ro.load()["info"]}
    dist.barrier()
    # different steps asked on the ranks (last: the ranks may be left apart)
    with pitstop.CheckpointManager(d, distributed=coordinator(10), **opts()) as mgr:
        st = small_state(ctx.rank, -1)
        out["apart"] = error_of(lambda: mgr.restore(st, step=1 + ctx.rank))
        out["apart_w0"] = float(st["w"][0])
        st = small_state(ctx.rank, -1)
        out["apart_none"] = error_of(lambda: mgr.restore(st, step=None if ctx.rank else 1))
        out["apart_none_w0"] = float(st["w"][0])
    return out


@scenario
def p_resave(ctx: Ctx) -> dict[str, Any]:
    """Going on after the newest checkpoints left the directory: a restore of an older step
    (save() and step() of the next steps), delete() on every rank, delete() on one rank."""
    import pitstop

    out: dict[str, Any] = {}
    with pitstop.CheckpointManager(ctx.tmp / "older", distributed=coordinator(10),
                                   async_save=False, save_every_steps=1, **opts()) as mgr:
        for s in range(1, 5):
            mgr.save(s, small_state(ctx.rank, s))
        st = small_state(ctx.rank, -1)
        out["restored"] = step_of(mgr.restore(st, step=2))
        out["save3"] = error_of(lambda: mgr.save(3, small_state(ctx.rank, 3)))
        h = mgr.step(4, small_state(ctx.rank, 4))  # save_every_steps=1: saves
        out["step4"] = None if h is None else h.step
        out["steps"] = mgr.all_steps()
    dist.barrier()
    with pitstop.CheckpointManager(ctx.tmp / "delete", distributed=coordinator(10),
                                   async_save=False, **opts()) as mgr:
        for s in range(1, 5):
            mgr.save(s, small_state(ctx.rank, s))
        # every rank, as told: the leader deletes, every rank forgets the step
        out["delete_all"] = error_of(lambda: mgr.delete(3))
        out["delete_all_steps"] = mgr.all_steps()
        out["delete_all_resave"] = error_of(lambda: mgr.save(3, small_state(ctx.rank, 3)))
        out["steps"] = mgr.all_steps()
    return out


@scenario
def p_fail(ctx: Ctx) -> dict[str, Any]:
    """Failures on one rank: a full disk (ENOSPC while writing, rank 1), a failing commit
    (rank 0), a slow disk with on_busy="skip" (rank 1), rank 1's data file corrupted after
    the commit; then the job goes on."""
    import pitstop

    out: dict[str, Any] = {}
    d = ctx.tmp / "fail"
    mgr = pitstop.CheckpointManager(d, distributed=coordinator(10), save_every_steps=1,
                                    **opts())
    mgr.save(1, small_state(ctx.rank, 1)).wait()

    def enospc(step: int) -> None:
        if step == 2 and ctx.rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
    mgr.hooks["before_write"] = enospc
    out["enospc"] = timed(lambda: mgr.save(2, small_state(ctx.rank, 2)).wait())
    h = mgr.step(3, small_state(ctx.rank, 3))
    out["after_enospc"] = timed(lambda: h.wait() if h is not None else None)

    def boom(step: int) -> None:
        if step == 4:
            raise RuntimeError("commit hook boom")
    mgr.hooks["before_commit"] = boom
    out["commit"] = timed(lambda: mgr.save(4, small_state(ctx.rank, 4)).wait())
    del mgr.hooks["before_commit"]

    def slow(step: int) -> None:
        if step == 5 and ctx.rank == 1:
            time.sleep(0.6)
    mgr.hooks["before_write"] = slow
    h5 = mgr.step(5, small_state(ctx.rank, 5))
    h6 = mgr.step(6, small_state(ctx.rank, 6))  # rank 1 is still writing step 5
    out["busy"] = [h5 is not None, h6 is not None]
    mgr.wait()
    h7 = mgr.step(7, small_state(ctx.rank, 7))
    mgr.wait()
    out["saved7"] = h7 is not None and h7.committed
    # the skip of step 6 is counted on every rank, and h7 is the first save after it
    out["skipped"] = [mgr.skipped_saves, mgr.skipped_steps,
                      None if h7 is None else h7.stats.skipped_before]
    out["steps"] = mgr.all_steps()
    out["listing"] = sorted(os.listdir(d))
    dist.barrier()
    if ctx.rank == 0:  # one flipped byte in rank 1's own file of step 7
        step7 = d / "step_0000000007"
        p = step7 / sorted(f for f in os.listdir(step7) if f.startswith("data-r00001"))[0]
        raw = bytearray(p.read_bytes())
        raw[0] ^= 0xFF
        p.write_bytes(bytes(raw))
        (ctx.tmp / "corrupt-copy").mkdir()
        shutil.copytree(d, ctx.tmp / "corrupt-copy" / "ck",
                        ignore=shutil.ignore_patterns("lock"))
    dist.barrier()
    st = small_state(ctx.rank, -1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        out["corrupt"] = error_of(lambda: mgr.restore(st))
    out["corrupt_warned"] = [str(w.message) for w in said]
    out["corrupt_mine"] = st["mine"].tolist()
    out["corrupt_listing"] = sorted(os.listdir(d))
    # training goes on from step 5: step 6 and step 7 come again
    h = mgr.step(6, small_state(ctx.rank, 6))
    out["after_corrupt_step6"] = None if h is None else h.step
    out["after_corrupt_save7"] = error_of(lambda: mgr.save(7, small_state(ctx.rank, 7)).wait())
    out["close"] = error_of(mgr.close)
    out["final_steps"] = sorted(p for p in os.listdir(d) if p.startswith("step_"))
    return out


@scenario
def p_policy(ctx: Ctx) -> dict[str, Any]:
    """keep_best with per-rank losses; save_every_seconds with per-rank clocks;
    distributed=False on every rank in one directory; distributed=False on rank 0 only."""
    import pitstop

    out: dict[str, Any] = {}
    losses = {0: [5, 4, 6, 7, 3, 8, 9, 9], 1: [5, 6, 2, 7, 8, 1, 9, 9]}[ctx.rank]
    with pitstop.CheckpointManager(ctx.tmp / "best", distributed=coordinator(10), keep_best=1,
                                   best_metric="loss", async_save=False, **opts()) as mgr:
        saved = []
        for s, loss in enumerate(losses):
            if mgr.step(s, small_state(ctx.rank, s), metrics={"loss": float(loss)}):
                saved.append(s)
        out["best_saved"] = saved
        out["best_steps"] = mgr.all_steps()
    with pitstop.CheckpointManager(ctx.tmp / "seconds", distributed=coordinator(10),
                                   save_every_seconds=0.15, **opts()) as mgr:
        saved = []
        for s in range(10):
            time.sleep(0.05 if ctx.rank == 0 else 0.06)
            if mgr.step(s, small_state(ctx.rank, s)):
                saved.append(s)
        mgr.wait()
        out["seconds_saved"] = saved
        out["seconds_steps"] = mgr.all_steps()
    # distributed=False on every rank, one directory
    made = []
    out["nodist"] = error_of(lambda: made.append(pitstop.CheckpointManager(
        ctx.tmp / "nodist", distributed=False, **opts())))
    dist.barrier()
    if made:
        out["nodist_save"] = error_of(lambda: made[0].save(1, small_state(ctx.rank)).wait())
        made[0].close()
    dist.barrier()
    # the torch.save habit done right: rank 0 alone, distributed=False
    if ctx.rank == 0:
        model = make_model(0)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        train_step(model, opt, seed=1)
        with pitstop.CheckpointManager(ctx.tmp / "rank0", distributed=False, **opts()) as m0:
            m0.save(1, {"model": model, "opt": opt}).wait()
            out["rank0_world"] = m0.metadata(1).world
            sharded = distribute(torch.arange(8.0), *layouts(ctx.world)["S0"])
            out["rank0_dtensor"] = error_of(lambda: m0.save(2, {"t": sharded}).wait())
        out["rank0_record"] = model_record(model, opt)
    dist.barrier()
    model = make_model(5)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train_step(model, opt, seed=7)
    with pitstop.CheckpointManager(ctx.tmp / "rank0", read_only=True) as ro:
        out["rank0_restored"] = step_of(ro.restore({"model": model, "opt": opt}))
    out["rank0_restored_record"] = model_record(model, opt)
    return out


@scenario
def p_calls(ctx: Ctx) -> NoReturn:
    """restore() on rank 0 while the other ranks call step() at the same point."""
    import pitstop

    out: dict[str, Any] = {}
    with pitstop.CheckpointManager(ctx.tmp / "calls", distributed=coordinator(5),
                                   save_every_steps=1, **opts()) as mgr:
        mgr.save(1, small_state(ctx.rank, 1)).wait()
        if ctx.rank == 0:
            out["call"] = timed(lambda: mgr.restore(small_state(ctx.rank)))
        else:
            out["call"] = timed(lambda: mgr.step(5, small_state(ctx.rank)))
    exit_now(out)


@scenario
def p_stop(ctx: Ctx) -> NoReturn:
    """Rank 1 marks ``stop me`` in the middle of step 2's save (the test SIGSTOPs it there);
    rank 0 reports what its save and its next step() got."""
    import pitstop

    d = ctx.tmp / "stop"
    mgr = pitstop.CheckpointManager(d, distributed=coordinator(1.5), **opts())

    def mark(step: int) -> None:
        if step == 2 and ctx.rank == 1:
            ctx.mark("stop me")
            time.sleep(2)
    mgr.hooks["before_write"] = mark
    mgr.save(1, small_state(ctx.rank, 1)).wait()
    out: dict[str, Any] = {}
    out["save2"] = timed(lambda: mgr.save(2, small_state(ctx.rank, 2)).wait())
    out["listing"] = sorted(os.listdir(d))
    out["close"] = timed(mgr.close)
    exit_now(out)


# --------------------------------------------------------------------------- resharding
@scenario
def p_reshard_save(ctx: Ctx) -> dict[str, Any]:
    """Step 1 of :func:`small_state` plus :func:`originals` as Shard(0) DTensors, 2 ranks."""
    import pitstop

    st = small_state(ctx.rank, 1)
    st["t"] = {k: distribute(v, *layouts(ctx.world)["S0"]) for k, v in originals().items()}
    with pitstop.CheckpointManager(ctx.args["reshard"], distributed=coordinator(),
                                   **opts()) as mgr:
        mgr.save(1, st).wait()
    return {}


@scenario
def p_reshard_restore(ctx: Ctx) -> dict[str, Any]:
    """:func:`p_reshard_save`'s checkpoint restored on this world (any size)."""
    import pitstop

    st = small_state(ctx.rank, -1)
    st["t"] = {k: distribute(torch.full_like(v, -7), *layouts(ctx.world)["S0"])
               for k, v in originals().items()}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with pitstop.CheckpointManager(ctx.args["reshard"], distributed=coordinator(),
                                       **opts()) as mgr:
            step = mgr.restore(st)
    return {"step": None if step is None else int(step), "w": st["w"].tolist(),
            "mine": st["mine"].tolist(), "info": st["info"],
            "t": {k: enc(v) for k, v in st["t"].items()},
            "warnings": [str(w.message) for w in said]}


# --------------------------------------------------------------------------- training
def ddp_job(rank: int) -> dict[str, Any]:
    """A DDP job: model, AdamW, StepLR, the global RNGs (each rank its own stream), a
    per-rank data position."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import pitstop

    torch.manual_seed(100 + rank)
    model = DDP(make_model(0))
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    return {"model": model, "opt": opt, "sched": sched, "rng": pitstop.RNG(),
            "data": {"pos": 0, "rank": rank}}


def ddp_step(state: dict[str, Any], rank: int) -> float:
    """One step on this rank's next batch (drawn from its global RNG at its position)."""
    pos = state["data"]["pos"]
    x = torch.randn(4, 6) + 0.01 * pos
    y = torch.randn(4, 3)
    state["data"]["pos"] = pos + 1 + rank
    loss = torch.nn.functional.mse_loss(state["model"](x), y)
    loss.backward()
    state["opt"].step()
    state["opt"].zero_grad()
    state["sched"].step()
    return float(loss.detach())


def job_record(state: dict[str, Any]) -> dict[str, Any]:
    """Everything an exact resume must reproduce, the next random draw included."""
    return {"record": model_record(state["model"], state["opt"]),
            "lr": state["opt"].param_groups[0]["lr"],
            "sched": state["sched"].state_dict(), "data": dict(state["data"]),
            "draw": enc(torch.rand(3))}


@scenario
def train(ctx: Ctx) -> dict[str, Any]:
    """Train ``args["total"]`` steps of :func:`ddp_job`, ``step()`` every step (async,
    max_in_flight=2, keep_last=2, the memory tier in ``args["tier"]``), resuming from
    ``args["train"]``; mark ``step N`` after each. ``args["stall"]`` = {"rank", "hook",
    "step"}: that rank's hook stops at the first save from that step on (marked
    ``stalled``) for the test to kill it;
    the others then report what they got."""
    import pitstop

    a = ctx.args
    state = ddp_job(ctx.rank)
    mgr = pitstop.CheckpointManager(
        a["train"], distributed=coordinator(a.get("timeout", 30)), save_on_signals=None,
        memory_tier=a.get("tier", False), save_every_steps=3, keep_last=2, max_in_flight=2)
    stall = a.get("stall")
    if stall and stall["rank"] == ctx.rank:
        def stop(step: int) -> None:
            if step >= stall["step"]:  # (a save can be skipped: a rank was still busy)
                ctx.mark("stalled")
                time.sleep(120)
        mgr.hooks[stall["hook"]] = stop
    start = mgr.restore(state)
    first = 0 if start is None else int(start) + 1
    saved: list[int] = []
    t0 = time.monotonic()
    step, where = first, "training"
    try:
        for step in range(first, a["total"]):
            where = "training"
            loss = ddp_step(state, ctx.rank)
            where = "step()"
            if mgr.step(step, state, metrics={"loss": loss}) is not None:
                saved.append(step)
            ctx.mark(f"step {step}")
            time.sleep(a.get("sleep", 0.0))
        t0, where = time.monotonic(), "close()"
        ctx.mark("closing")
        mgr.close()
    except Exception as e:  # noqa: BLE001 - a failure the test provoked: reported
        if not stall:
            raise
        exit_now({"error": {"type": type(e).__name__, "message": str(e),
                            "is_checkpoint_error": isinstance(e, pitstop.CheckpointError)},
                  "in": where, "at": step, "waited_s": time.monotonic() - t0,
                  "saved": saved})
    out = job_record(state)
    out.update(start=None if start is None else int(start), saved=saved)
    return out


# --------------------------------------------------------------------------- FSDP2
def fsdp_model(world: int) -> Any:
    from torch.distributed.fsdp import fully_shard

    m = make_model(0)
    for layer in (m[0], m[2]):
        fully_shard(layer, mesh=mesh_of((world,)))
    fully_shard(m, mesh=mesh_of((world,)))
    return m


def full_record(model: Any, opt: Any) -> dict[str, Any]:
    """Every parameter and Adam state as the whole tensor (a collective: every rank)."""
    from torch.distributed.tensor import DTensor

    def whole(t: torch.Tensor) -> dict[str, Any]:
        return enc(t.full_tensor() if isinstance(t, DTensor) else t)

    params = {k: whole(v.detach()) for k, v in model.named_parameters()}
    names = {id(p): k for k, p in model.named_parameters()}
    moments = {names[id(p)]: {k: whole(v) for k, v in sorted(s.items())}
               for p, s in opt.state.items()}
    return {"params": params, "opt": moments}


@scenario
def fsdp_save(ctx: Ctx) -> dict[str, Any]:
    """FSDP2 + Adam: train ``k`` steps, save step k, train ``m`` more (uninterrupted)."""
    import pitstop

    a = ctx.args
    model = fsdp_model(ctx.world)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with pitstop.CheckpointManager(a["fsdp"], distributed=coordinator(), **opts()) as mgr:
        for s in range(a["k"]):
            train_step(model, opt, seed=s)
        mgr.save(a["k"], {"model": model, "opt": opt}).wait()
        at_k = full_record(model, opt)
        for s in range(a["k"], a["k"] + a["m"]):
            train_step(model, opt, seed=s)
    return {"at_k": at_k, "end": full_record(model, opt)}


@scenario
def fsdp_resume(ctx: Ctx) -> dict[str, Any]:
    """A fresh FSDP2 model + Adam (not stepped) on this world restores step k and trains
    ``m`` steps on the batches the uninterrupted run used."""
    import pitstop

    a = ctx.args
    model = fsdp_model(ctx.world)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with pitstop.CheckpointManager(a["fsdp"], distributed=coordinator(), **opts()) as mgr:
        step = mgr.restore({"model": model, "opt": opt})
    at_k = full_record(model, opt)
    for s in range(a["k"], a["k"] + a["m"]):
        train_step(model, opt, seed=s)
    return {"step": None if step is None else int(step), "at_k": at_k,
            "end": full_record(model, opt)}


@scenario
def p_three(ctx: Ctx) -> dict[str, Any]:
    """For 3 ranks: :func:`fsdp_resume` and :func:`p_reshard_restore` (their results printed
    as a first result line), then :func:`p_calls` (a second line, where a rank lives)."""
    out = {"fsdp_resume": fsdp_resume(ctx), "p_reshard_restore": p_reshard_restore(ctx)}
    say(RESULT + json.dumps(out))
    dist.barrier()
    return p_calls(ctx)  # (leaves the process)
