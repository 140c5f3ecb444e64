"""One rank of a torch.distributed test world (started by dist_helpers.py; not a test file).

    python dist_worker.py <scenario> <rank> <world> <port> <tmpdir> [json args]

joins the gloo process group on 127.0.0.1 (``port`` 0: through the rendezvous file named
by ``$PITSTOP_TEST_RENDEZVOUS``, whose port rank 0's TCPStore got from the kernel), runs the
scenario and prints ``PITSTOP_RESULT <json>`` as its last line of stdout. ``a+b`` runs
scenarios ``a`` then ``b`` in the same processes; the result is then ``{"a": ..., "b": ...}``.

A scenario is a function registered with ``@scenario``: ``def name(ctx: Ctx) -> dict``, run
on every rank (``ctx.rank``, ``ctx.world``, ``ctx.tmp`` the shared directory, ``ctx.args``
the JSON args), returning a JSON-able dict (tensors through :func:`enc`). It may call
collectives (the process group is up) and ``ctx.mark(text)`` to tell a waiting test where it
is (``dist_helpers.wait_for_mark``). An exception fails the rank (traceback on stderr,
exit status 1), which fails the world. SIGUSR1 dumps every thread's stack on stderr.

Another script can add scenarios: import this module, register functions with
``dist_worker.scenario`` and call ``dist_worker.main(sys.argv[1:])``; tests pass that
script as ``worker=`` to dist_helpers (tests/adapters/torch/dist_save_worker.py does).

The data helpers (:func:`originals`, :func:`make_model`, :func:`train_step`, :func:`enc`,
:func:`dec`) are imported by the tests too, so expectations are computed independently of
the ranks.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

RESULT = "PITSTOP_RESULT "
MARK = "PITSTOP_MARK "

SCENARIOS: dict[str, Callable[[Ctx], dict[str, Any]]] = {}


def scenario(fn: Callable[[Ctx], dict[str, Any]]) -> Callable[[Ctx], dict[str, Any]]:
    """Register ``fn`` as the scenario of its name."""
    SCENARIOS[fn.__name__] = fn
    return fn


@dataclass
class Ctx:
    rank: int
    world: int
    tmp: Path
    args: dict[str, Any]

    def mark(self, text: str) -> None:
        """Print a progress mark a test can wait for (``dist_helpers.wait_for_mark``)."""
        say(MARK + text)


def say(line: str) -> None:
    """One line in one write (marks, ``RESULT`` lines): print writes the text and its newline
    apart, and a mark from another thread (a save's hook) then lands between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------- data
def originals() -> dict[str, torch.Tensor]:
    """The tensors every checkpoint of these tests holds (deterministic): even and uneven
    splits on 2 and 4 ranks, a 1-D one, several dtypes (bfloat16 bit-exact)."""
    g = torch.Generator().manual_seed(1234)
    return {
        "a": torch.randn(8, 6, generator=g),                                  # even on 2, 4
        "b": torch.randn(5, 3, generator=g, dtype=torch.float64),             # 3+2, 2+2+1+0
        "c": torch.randint(-1000, 1000, (3, 7), generator=g),                 # 1+1+1+0 on 4
        "d": torch.randn(6, 10, generator=g).to(torch.bfloat16),              # 10 cols: 3,3,3,1
        "e": torch.randn(7, generator=g),                                     # 1-D: 4+3
    }


def make_model(seed: int = 0) -> nn.Sequential:
    """A small MLP whose shapes shard unevenly on 2 ranks (Linear(10, 3): 2 + 1 rows)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    """One optimizer step on a batch made from ``seed`` (the same batch on every rank)."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()


def plain(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor, the tensor itself otherwise (detached)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        with torch.no_grad():
            t = t.to_local()
    return t.detach()


def enc(t: torch.Tensor) -> dict[str, Any]:
    """A tensor's (or a DTensor's local tensor's) exact bytes as JSON."""
    t = plain(t).contiguous()
    raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "hex": raw.numpy().tobytes().hex()}


def dec(d: dict[str, Any]) -> torch.Tensor:
    """Inverse of :func:`enc`."""
    dtype = getattr(torch, d["dtype"])
    raw = bytes.fromhex(d["hex"])
    if not raw:
        return torch.empty(d["shape"], dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(d["shape"])


def model_record(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every parameter (local part) and Adam state tensor (local part), encoded."""
    from pitstop.adapters.torch import unwrap_module

    params = {k: enc(v) for k, v in unwrap_module(model).state_dict(keep_vars=True).items()}
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    state = {}
    for p, s in opt.state.items():
        state[str(index[id(p)])] = {k: enc(v) for k, v in s.items()
                                    if isinstance(v, torch.Tensor)}
        state[str(index[id(p)])]["kinds"] = {k: type(v).__name__ for k, v in s.items()}
    return {"params": params, "opt": state}


def save_opts() -> dict[str, Any]:
    """A manager that is self-contained in a test: synchronous, no signal handlers, no
    memory tier."""
    return {"async_save": False, "save_on_signals": None, "memory_tier": False}


def error_of(fn: Callable[[], Any]) -> dict[str, Any]:
    """``{"type", "message"}`` of what ``fn()`` raised (``{"type": None}`` when nothing)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported to the test, which judges it
        return {"type": type(e).__name__, "message": str(e),
                "is_checkpoint_error": _is_checkpoint_error(e)}
    return {"type": None, "message": ""}


def _is_checkpoint_error(e: Exception) -> bool:
    import pitstop

    return isinstance(e, pitstop.CheckpointError)


def fill_(t: torch.Tensor, value: float) -> None:
    """Overwrite a tensor (a DTensor's local part) in place."""
    with torch.no_grad():
        plain(t).fill_(value)


# --------------------------------------------------------------------------- layouts
def layouts(world: int) -> dict[str, tuple[tuple[int, ...], list[Any]]]:
    """name -> (mesh shape, placements) of the DTensor targets a restore is tried into."""
    from torch.distributed.tensor import Replicate, Shard

    out: dict[str, tuple[tuple[int, ...], list[Any]]] = {
        "S0": ((world,), [Shard(0)]), "S1": ((world,), [Shard(1)]),
        "R": ((world,), [Replicate()])}
    if world == 4:
        from torch.distributed.tensor.placement_types import _StridedShard

        out["S0xS1"] = ((2, 2), [Shard(0), Shard(1)])
        # FSDP2 + TP on one dimension: rows split by "tp" first, then by "dp"
        out["SSxS0"] = ((2, 2), [_StridedShard(0, split_factor=2), Shard(0)])
        out["RxS1"] = ((2, 2), [Replicate(), Shard(1)])
    return out


def applies(placements: list[Any], t: torch.Tensor) -> bool:
    """Whether every placement's dimension exists in ``t``."""
    return all(not hasattr(p, "dim") or p.dim < t.dim() for p in placements)


_meshes: dict[tuple[int, ...], Any] = {}


def mesh_of(shape: tuple[int, ...]) -> Any:
    """One DeviceMesh per shape for the whole process (a mesh makes process groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    if shape not in _meshes:
        names = ("dp", "tp")[:len(shape)] if len(shape) > 1 else None
        _meshes[shape] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _meshes[shape]


def distribute(t: torch.Tensor, shape: tuple[int, ...], placements: list[Any]) -> Any:
    """``t`` (the same on every rank) as a DTensor; each rank keeps its part (no collective)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(t, mesh_of(shape), placements, src_data_rank=None)


# --------------------------------------------------------------------------- scenarios
@scenario
def save1(ctx: Ctx) -> dict[str, Any]:
    """World 1. Writes ``args["plain"]`` (plain tensors + a model + Adam after one step) and
    ``args["fsdp1"]`` (the same through FSDP2 on a 1-device mesh, DTensors everywhere),
    round-trips the DTensor state in place, and tries to save a Partial DTensor."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial

    import pitstop

    out: dict[str, Any] = {}
    # plain
    model = make_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train_step(model, opt, seed=1)
    state: dict[str, Any] = {"t": {k: v.clone() for k, v in originals().items()},
                             "model": model, "opt": opt}
    with pitstop.CheckpointManager(ctx.args["plain"], **save_opts()) as mgr:
        mgr.save(1, state)
    out["plain"] = model_record(model, opt)
    train_step(model, opt, seed=2)
    out["continued"] = model_record(model, opt)

    # FSDP2 on one device: every parameter and Adam moment a DTensor
    model = make_model(0)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh_of((1,)))
    fully_shard(model, mesh=mesh_of((1,)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train_step(model, opt, seed=1)
    params = dict(model.named_parameters())
    moments = {k: dict(s) for k, s in opt.state.items()}
    out["fsdp1_kinds"] = sorted({type(v).__name__ for v in params.values()})
    state = {"t": {k: distribute(v.clone(), (1,), layouts(1)["S0"][1])
                   for k, v in originals().items()},
             "model": model, "opt": opt}
    with pitstop.CheckpointManager(ctx.args["fsdp1"], **save_opts()) as mgr:
        mgr.save(1, state)
        out["fsdp1"] = model_record(model, opt)
        manifest = mgr.metadata(1)
        out["fsdp1_manifest"] = {k: [s.index for s in e.shards] if e.shards else None
                                 for k, e in manifest.arrays.items()}
        # round trip in place: overwrite everything, restore, same objects, same bytes
        for t in [*state["t"].values(), *params.values()]:
            fill_(t, -3)
        for s in opt.state.values():
            for v in s.values():
                fill_(v, -3)  # the step counter too
        out["roundtrip_step"] = mgr.restore(state)
    out["roundtrip_t"] = {k: enc(v) for k, v in state["t"].items()}
    out["roundtrip"] = model_record(model, opt)
    out["roundtrip_same_objects"] = (
        all(p is params[k] for k, p in model.named_parameters())
        and all(isinstance(p, nn.Parameter) and isinstance(p, DTensor)
                for p in model.parameters())
        and all(opt.state[p][k] is v for p, s in moments.items() for k, v in s.items()))
    train_step(model, opt, seed=2)  # FSDP2 still trains on the restored parameters
    out["roundtrip_trains"] = all(bool(torch.isfinite(plain(p)).all())
                                  for p in model.parameters())

    # Partial placements are sums still to be reduced: refused, with the fix
    partial = DTensor.from_local(torch.ones(4, 3), mesh_of((1,)), [Partial()], run_check=False)
    with pitstop.CheckpointManager(ctx.tmp / "partial", **save_opts()) as mgr:
        out["partial_save"] = error_of(lambda: mgr.save(1, {"grad_sum": partial}))
        out["partial_committed"] = mgr.all_steps()
    return out


@scenario
def save_sharded(ctx: Ctx) -> dict[str, Any]:
    """World N: every rank saves :func:`originals` as DTensors sharded ``Shard(0)`` over all
    ranks (``"t"``) and replicated (``"r"``) into ``args["dir"]`` at step 1 (on several
    ranks: one multi-rank save, each shard written by its rank, each replica once)."""
    import pitstop

    shard, rep = layouts(ctx.world)["S0"], layouts(ctx.world)["R"]
    state = {"t": {k: distribute(v, *shard) for k, v in originals().items()},
             "r": {k: distribute(v, *rep) for k, v in originals().items()}}
    with pitstop.CheckpointManager(ctx.args["dir"], **save_opts()) as mgr:
        mgr.save(1, state)
        steps = mgr.all_steps()
    return {"steps": steps}


@scenario
def reshard(ctx: Ctx) -> dict[str, Any]:
    """Restore each checkpoint of ``args["sources"]`` (name -> directory, each holding
    :func:`originals` under ``"t"``; other entries are left alone) into DTensors of every
    layout of :func:`layouts` (plain tensors where a layout does not apply: a 1-D tensor
    for ``Shard(1)``), and into plain tensors of the global shape; every rank's local
    bytes, and what each restore reported."""
    import pitstop

    out: dict[str, Any] = {"coords": {}, "truth": {}, "restored": {}, "plain_target": {},
                           "reports": {}, "same_objects": True}
    orig = originals()
    for name, (shape, placements) in layouts(ctx.world).items():
        out["coords"][name] = list(mesh_of(shape).get_coordinate())
        # torch's own distribution of the originals: what each rank must hold after a restore
        out["truth"][name] = {k: enc(distribute(v, shape, placements)) for k, v in orig.items()
                              if applies(placements, v)}

    def restore(mgr: Any, targets: dict[str, Any], what: str) -> None:
        step = mgr.restore({"t": targets}, strict=False)  # the sources hold more than "t"
        out["reports"][what] = {"step": int(step), "missing": step.missing_keys,
                                "mismatched": step.mismatched_keys}

    for src, directory in ctx.args["sources"].items():
        with pitstop.CheckpointManager(directory, read_only=True) as mgr:
            got: dict[str, Any] = {}
            for name, (shape, placements) in layouts(ctx.world).items():
                targets = {k: distribute(torch.full_like(v, -7), shape, placements)
                           if applies(placements, v) else torch.full_like(v, -7)
                           for k, v in orig.items()}
                before = {k: (v, plain(v).data_ptr()) for k, v in targets.items()}
                restore(mgr, targets, f"{src}/{name}")
                out["same_objects"] &= all(
                    targets[k] is t and plain(targets[k]).data_ptr() == ptr
                    for k, (t, ptr) in before.items())
                got[name] = {k: enc(v) for k, v in targets.items()}
            out["restored"][src] = got
            targets = {k: torch.full_like(v, -7) for k, v in orig.items()}
            restore(mgr, targets, f"{src}/plain")
            out["plain_target"][src] = {k: enc(v) for k, v in targets.items()}
    return out


@scenario
def misuse(ctx: Ctx) -> dict[str, Any]:
    """World 2: what a restore refuses, and that it changes nothing when it does: a Partial
    target, a target of another global shape, a strided shard that is not one block."""
    from torch.distributed.tensor import DTensor, Partial, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    import pitstop

    out: dict[str, Any] = {}
    orig = originals()
    mesh = mesh_of((ctx.world,))

    def state_with(a: Any) -> dict[str, Any]:
        """Everything the source (a ``save_sharded`` checkpoint) holds, ``t/a`` being ``a``."""
        t = {k: torch.full_like(v, -7) for k, v in orig.items()}
        t["a"] = a
        return {"t": t, "r": {k: torch.full_like(v, -7) for k, v in orig.items()}}

    with pitstop.CheckpointManager(ctx.args["source"], read_only=True) as mgr:
        partial = DTensor.from_local(torch.zeros(8, 6), mesh, [Partial()], run_check=False)
        out["partial"] = error_of(lambda: mgr.restore(state_with(partial)))

        smaller = distribute(torch.full((6, 6), -7.0), (ctx.world,), [Shard(0)])
        st = state_with(smaller)
        out["shape"] = error_of(lambda: mgr.restore(st))
        out["shape_untouched"] = bool((plain(smaller) == -7).all()) and all(
            bool((v == -7).all()) for k, v in st["t"].items() if k != "a")

        # rows 0, 1, 4, 5 of 8 on rank 0: not one block
        strided = DTensor.from_local(torch.full((4, 6), -7.0), mesh,
                                     [_StridedShard(0, split_factor=2)], run_check=False)
        out["strided"] = error_of(lambda: mgr.restore(state_with(strided)))
        out["strided_untouched"] = bool((plain(strided) == -7).all())
    return out


@scenario
def fsdp(ctx: Ctx) -> dict[str, Any]:
    """World 2: restore the world-1 checkpoints into DDP and FSDP2 models with Adam, then
    train one more step on the batch the world-1 job used after its save."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import pitstop

    out: dict[str, Any] = {}
    orig = originals()

    def targets() -> dict[str, Any]:
        return {k: torch.full_like(v, -7) for k, v in orig.items()}

    # DDP: plain parameters, identical on every rank; Adam already stepped (state in place)
    ddp = DDP(make_model(99))
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    train_step(ddp, opt, seed=5)
    with pitstop.CheckpointManager(ctx.args["plain"], read_only=True) as mgr:
        out["ddp_step"] = mgr.restore({"t": targets(), "model": ddp, "opt": opt})
    out["ddp"] = model_record(ddp, opt)
    train_step(ddp, opt, seed=2)
    out["ddp_continued"] = model_record(ddp, opt)

    def sharded_model() -> nn.Module:
        m = make_model(99)
        for layer in (m[0], m[2]):
            fully_shard(layer, mesh=mesh_of((ctx.world,)))
        fully_shard(m, mesh=mesh_of((ctx.world,)))
        return m

    # FSDP2, optimizer not stepped yet (the usual resume): moments come from the checkpoint
    for src in ("plain", "fsdp1"):
        model = sharded_model()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        params = dict(model.named_parameters())
        with pitstop.CheckpointManager(ctx.args[src], read_only=True) as mgr:
            out[f"fresh_{src}_step"] = mgr.restore({"t": targets(), "model": model,
                                                    "opt": opt})
        out[f"fresh_{src}"] = model_record(model, opt)
        out[f"fresh_{src}_same_params"] = all(p is params[k]
                                              for k, p in model.named_parameters())
        train_step(model, opt, seed=2)
        out[f"fresh_{src}_continued"] = model_record(model, opt)

    # FSDP2 after a step of its own: moments restored in place into its DTensors
    model = sharded_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train_step(model, opt, seed=5)
    moments = {p: dict(s) for p, s in opt.state.items()}
    with pitstop.CheckpointManager(ctx.args["fsdp1"], read_only=True) as mgr:
        out["stepped_step"] = mgr.restore({"t": targets(), "model": model, "opt": opt})
    out["stepped"] = model_record(model, opt)
    out["stepped_same_moments"] = all(opt.state[p][k] is v for p, s in moments.items()
                                      for k, v in s.items())
    return out


@scenario
def hold(ctx: Ctx) -> dict[str, Any]:
    """For the harness's own tests: rank ``args["fail"]`` raises at once; rank
    ``args["sleeper"]`` marks ``ready`` and sleeps (until a test kills it); every other rank
    marks ``ready`` and waits for all in a barrier."""
    import torch.distributed as dist

    if ctx.rank == ctx.args.get("fail"):
        raise RuntimeError(f"boom from rank {ctx.rank}")
    ctx.mark("ready")
    if ctx.rank == ctx.args.get("sleeper"):
        time.sleep(120)
    dist.barrier()
    return {"rank": ctx.rank}


# --------------------------------------------------------------------------- main
def _join(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    timeout = float(os.environ.get("PITSTOP_TEST_PEER_TIMEOUT", "60"))
    if port:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
        return
    rendezvous = Path(os.environ["PITSTOP_TEST_RENDEZVOUS"])
    if rank == 0:
        # (wait_for_workers=False: the constructor would wait for the peers, which learn
        # the port only from the file written below)
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True,
                              timeout=timedelta(seconds=timeout), wait_for_workers=False)
        tmp = rendezvous.with_suffix(".tmp")
        tmp.write_text(str(store.port))
        os.replace(tmp, rendezvous)  # whole or absent: a peer never reads half a number
    else:
        deadline = time.monotonic() + timeout
        while not rendezvous.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 did not publish its store port in {rendezvous} "
                                   f"within {timeout:.0f} s")
            time.sleep(0.02)
        store = dist.TCPStore("127.0.0.1", int(rendezvous.read_text()), world,
                              is_master=False, timeout=timedelta(seconds=timeout))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))


def main(argv: list[str]) -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if len(argv) not in (5, 6):
        print(__doc__, file=sys.stderr)
        return 2
    names, rank, world, port, tmp = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    args = json.loads(argv[5]) if len(argv) == 6 else {}
    unknown = [n for n in names.split("+") if n not in SCENARIOS]
    if unknown:
        print(f"unknown scenario(s) {unknown}; known: {sorted(SCENARIOS)}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    _join(rank, world, port)
    try:
        results = {}
        for name in names.split("+"):
            results[name] = SCENARIOS[name](Ctx(rank, world, Path(tmp), args))
        dist.barrier()  # no rank tears the group down while a peer still uses it
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # at once: a peer blocked in a collective is killed by the harness
    dist.destroy_process_group()
    result = results[names] if "+" not in names else results
    say(RESULT + json.dumps(result))
    sys.stderr.flush()
    # Leave without the interpreter's finalization: in about 1 run of 20 a rank that had
    # printed its result aborted in it ("terminate called without an active exception",
    # SIGABRT, while garbage-collecting after destroy_process_group()), a teardown race of
    # gloo's threads (pytorch/pytorch PR 179291) that this test is not about. Still open:
    # whether pitstop leaves anything behind that makes it more likely (see the session
    # notes of issue 16).
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
