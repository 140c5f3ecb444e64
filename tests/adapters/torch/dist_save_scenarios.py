"""Multi-rank save scenarios for dist_worker.py (registered into its ``SCENARIOS``).

Each runs on every rank of a real gloo world; see dist_worker.py for how a scenario is
written and dist_helpers.py for how a test starts a world.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from dist_worker import (  # type: ignore[import-not-found]
    RESULT,
    Ctx,
    distribute,
    enc,
    error_of,
    layouts,
    make_model,
    model_record,
    originals,
    say,
    scenario,
    train_step,
)


def coordinator(timeout_s: float = 30.0) -> Any:
    from pitstop.adapters.torch.distributed import ProcessGroupCoordinator

    return ProcessGroupCoordinator(timeout_s=timeout_s)


def ddp_state(rank: int) -> dict[str, Any]:
    """A DDP job's state: the same model and Adam on every rank, a per-rank tensor (a rank's
    own sampler buffer, say) and a per-rank value, and two sharded DTensor entries."""
    model = make_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train_step(model, opt, seed=1)
    return {"model": model, "opt": opt, "mine": torch.full((4,), float(rank)),
            "info": {"rank": rank}}


def sharded(world: int) -> dict[str, Any]:
    shard = layouts(world)["S0"]
    return {k: distribute(v, *shard) for k, v in originals().items()}


@scenario
def world_save(ctx: Ctx) -> dict[str, Any]:
    """Save steps 1 and 2 of a DDP state plus Shard(0) DTensors into ``args["dir"]``; what
    each rank wrote and what the manifest says."""
    import pitstop

    state = ddp_state(ctx.rank)
    state["t"] = sharded(ctx.world)
    with pitstop.CheckpointManager(ctx.args["dir"], distributed=coordinator(),
                                   save_on_signals=None, memory_tier=False) as mgr:
        mgr.save(1, state).wait()
        train_step(state["model"], state["opt"], seed=2)
        state["mine"].add_(10)
        h = mgr.save(2, state)
        h.wait()
        # the peer: DCP saves the same tensors of the same world (for world_restore to
        # compare its resharded load with pitstop's)
        import torch.distributed.checkpoint as dcp
        dcp.save({"t": state["t"], "mine": state["mine"]}, checkpoint_id=ctx.args["dir"] + "-dcp")
        out = {"committed": h.committed, "steps": mgr.all_steps(),
               "record": model_record(state["model"], state["opt"]),
               "mine": enc(state["mine"]),
               "t": {k: enc(v) for k, v in state["t"].items()}}
    return out


@scenario
def world_restore(ctx: Ctx) -> dict[str, Any]:
    """Restore ``args["dir"]`` into a fresh DDP state and Shard(0) DTensors on this world
    (any size); each rank's restored bytes, step and warnings."""
    import warnings

    import pitstop

    state = ddp_state(ctx.rank)
    train_step(state["model"], state["opt"], seed=7)  # other values, same structure
    state["mine"].fill_(-1)
    state["info"] = {"rank": -1}
    state["t"] = {k: distribute(torch.full_like(v, -7), *layouts(ctx.world)["S0"])
                  for k, v in originals().items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pitstop.CheckpointManager(ctx.args["dir"], distributed=coordinator(),
                                       save_on_signals=None, memory_tier=False) as mgr:
            step = mgr.restore(state, step=ctx.args.get("step"))
            # and the job goes on saving on this world size
            if ctx.args.get("save_again"):
                mgr.save(ctx.args["save_again"], state).wait()
    # DCP, from the same world's save, resharded into the same targets: the same bytes
    dcp_agrees = None
    if os.path.isdir(ctx.args["dir"] + "-dcp") and step == 2:
        import torch.distributed.checkpoint as dcp
        theirs = {"t": {k: distribute(torch.full_like(v, -7), *layouts(ctx.world)["S0"])
                        for k, v in originals().items()}}
        dcp.load(theirs, checkpoint_id=ctx.args["dir"] + "-dcp")
        dcp_agrees = {k: enc(v) == enc(state["t"][k]) for k, v in theirs["t"].items()}
    return {"step": step, "dcp_agrees": dcp_agrees, "record": model_record(state["model"], state["opt"]),
            "mine": enc(state["mine"]), "info": state["info"],
            "t": {k: enc(v) for k, v in state["t"].items()},
            "warnings": [str(w.message) for w in caught]}


@scenario
def kill_mid_save(ctx: Ctx) -> dict[str, Any]:
    """First :func:`mismatched` in ``args["misuse"]``; then step 1 commits, and during step 2
    the last rank stops before writing (the test kills it there). The others report what
    they got (and what :func:`mismatched` found)."""
    import pitstop

    first = mismatched(Ctx(ctx.rank, ctx.world, ctx.tmp, {"dir": ctx.args["misuse"]}))
    state = ddp_state(ctx.rank)
    mgr = pitstop.CheckpointManager(ctx.args["dir"], distributed=coordinator(),
                                    save_on_signals=None, memory_tier=False)
    victim = ctx.rank == ctx.world - 1

    def stall(step: int) -> None:
        if step == 2 and victim:
            ctx.mark("writing 2")
            time.sleep(120)

    mgr.hooks["before_write"] = stall
    mgr.save(1, state).wait()
    t0 = time.monotonic()
    err = error_of(lambda: mgr.save(2, state).wait())
    waited = time.monotonic() - t0
    out = {"error": err, "latest": mgr.latest_step(), "waited_s": waited,
           "listing": sorted(os.listdir(ctx.args["dir"])), "misuse": first}
    # the group lost a rank: report and leave without the harness's final barrier
    say(RESULT + json.dumps(out))
    os._exit(0)


def mismatched(ctx: Ctx) -> dict[str, Any]:
    """Misuse: ranks saving different steps; one rank's snapshot failing; a step that exists
    on the ranks. Each must fail on every rank, fast, and leave nothing committed."""
    import pitstop

    out: dict[str, Any] = {}
    if ctx.rank == 0:  # a manager made on rank 0 only (as torch.save is called): an error
        t0 = time.monotonic()
        out["lonely"] = error_of(lambda: coordinator(timeout_s=3))
        out["lonely_s"] = time.monotonic() - t0
    torch.distributed.barrier()  # rank 1 makes no manager until then
    with pitstop.CheckpointManager(ctx.args["dir"], distributed=coordinator(),
                                   save_on_signals=None, memory_tier=False) as mgr:
        state = {"w": torch.arange(12.0)}
        t0 = time.monotonic()
        out["steps"] = error_of(lambda: mgr.save(3 + ctx.rank, state).wait())
        out["bad_state"] = error_of(lambda: mgr.save(
            5, {"w": torch.arange(12.0), "x": object() if ctx.rank == 1 else 1}).wait())
        out["waited_s"] = time.monotonic() - t0
        mgr.save(6, state).wait()  # the ranks are in step again
        out["exists"] = error_of(lambda: mgr.save(6, state))
        out["steps_after"] = mgr.all_steps()
    return out


@scenario
def signal_loop(ctx: Ctx) -> dict[str, Any]:
    """A training loop with step(); the test sends SIGTERM to one rank only. Every rank
    must save the same step and exit as the signal asks."""
    import pitstop

    state = ddp_state(ctx.rank)
    mgr = pitstop.CheckpointManager(ctx.args["dir"], distributed=coordinator(),
                                    save_every_steps=1000, memory_tier=False)
    for step in range(100000):
        train_step(state["model"], state["opt"], seed=step)
        state["mine"].fill_(step)
        mgr.step(step, state)
        if step == 3:
            ctx.mark("training")
        time.sleep(0.01)
    return {"finished": True}  # never: the signal ends every rank


@scenario
def tier_crash(ctx: Ctx) -> dict[str, Any]:
    """Step 1 commits; step 2's snapshot is taken on every rank (memory tier), then every
    rank stops before writing (the test SIGKILLs them all)."""
    import pitstop

    state = ddp_state(ctx.rank)
    mgr = pitstop.CheckpointManager(ctx.args["dir"], distributed=coordinator(),
                                    save_on_signals=None, memory_tier=ctx.args["tier"])

    def stall(step: int) -> None:
        if step == 2:
            ctx.mark("snapshot 2")
            time.sleep(120)

    mgr.hooks["before_write"] = stall
    mgr.save(1, state).wait()
    train_step(state["model"], state["opt"], seed=2)
    state["mine"].add_(100)
    mgr.save(2, state)  # returns once the snapshot is in the tier
    time.sleep(120)
    return {}


@scenario
def tier_resume(ctx: Ctx) -> dict[str, Any]:
    """After :func:`tier_crash`: each rank finds step 2 in its memory tier, restores from
    it and persists it with the others."""
    import pitstop

    state = ddp_state(ctx.rank)
    train_step(state["model"], state["opt"], seed=9)
    state["mine"].fill_(-1)
    with pitstop.CheckpointManager(ctx.args["dir"], distributed=coordinator(),
                                   save_on_signals=None, memory_tier=ctx.args["tier"]) as mgr:
        step = mgr.restore(state)
        mgr.wait()
        steps = mgr.all_steps()
    return {"step": step, "steps": steps, "mine": enc(state["mine"]),
            "record": model_record(state["model"], state["opt"])}


def expected_ddp(rank: int, steps: int) -> dict[str, Any]:
    """What :func:`ddp_state` holds after ``steps`` more optimizer steps (for the tests)."""
    state = ddp_state(rank)
    for s in range(2, 2 + steps):
        train_step(state["model"], state["opt"], seed=s)
    return model_record(state["model"], state["opt"])



@scenario
def world_lazy(ctx: Ctx) -> dict[str, Any]:
    """snapshot="lazy" on every rank: step 1 saved while the optimizer steps at once (the
    step waits for the copy); step 2 with an in-place write on rank 1 during its copy (a
    write outside the contract): no rank commits it."""
    import threading

    import pitstop

    torch.manual_seed(0)
    model = torch.nn.Linear(128, 128)  # a 64 KiB weight: copied lazily
    opt = torch.optim.Adam(model.parameters(), lr=0.1)

    def step() -> None:
        model(torch.ones(4, 128)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    state = {"model": model, "opt": opt}
    out: dict[str, Any] = {}
    with pitstop.CheckpointManager(ctx.args["dir"], distributed=coordinator(),
                                   save_on_signals=None, memory_tier=False,
                                   snapshot="lazy") as mgr:
        out["before"] = enc(model.weight.detach())
        h = mgr.save(1, state)
        out["lazy_bytes"] = h.stats.lazy_bytes
        step()  # fenced: waits for the copy
        h.wait()
        go = threading.Event()
        if ctx.rank == 1:
            mgr.hooks["before_lazy_copy"] = lambda s: go.wait(30)
        h2 = mgr.save(2, state)
        if ctx.rank == 1:
            with torch.no_grad():
                model.weight.mul_(2)
            go.set()
        out["second"] = error_of(h2.wait)
        out["steps"] = mgr.all_steps()
    return out
