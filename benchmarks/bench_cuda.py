"""pitstop with CUDA tensors, beside torch.save and DCP's async_save: a prepared device check.

Untested on hardware: written so that a session lent a GPU can run it at once (torch and
pitstop only, no network, under 5 minutes on one H200). For each size (~1 GiB and ~4 GiB of
fp32 weights + Adam m + v on the GPU) and each peer, in this one process:

* stall (the save call) and save -> durable;
* training time lost per save: a loop of GPU matmuls + Adam steps with one save in it, minus
  the same loop without (CUDA-synchronized at the end);
* restore into the live GPU objects (pitstop: ``restore``; torch.save: ``torch.load`` +
  ``load_state_dict``; DCP: ``dcp.load``), its bytes checked;
* pitstop with ``pitstop.RNG()`` in the state: the CUDA generator's state is restored bitwise.

What pitstop has for CUDA (read from the code, measured here as it is): staging buffers are
page-locked with ``cudaHostRegister`` by a staging hook (``pitstop/adapters/torch/_leaf.py``
``pin_staging``, installed through ``pin_hooks`` of ``pitstop/core/save/snapshot.py``), and the
device-to-host copy is fenced with the current stream's ``synchronize`` (no side stream of its
own). Prints one markdown table; writes JSON to ``$OUT/bench_cuda.json`` when ``$OUT`` is set.

    python benchmarks/bench_cuda.py            # 1G and 4G
    python benchmarks/bench_cuda.py --quick    # 256M, fewer steps
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

GiB = 1 << 30
PARAMS = 21


def build(nbytes: int, torch: Any) -> tuple[Any, Any, Any]:
    """A GPU model (21 square-ish parameters) + Adam with its state, and a matmul workload."""
    per = max(1024, nbytes // 4 // 3 // PARAMS)
    params = [torch.nn.Parameter(torch.randn(per, device="cuda") * 0.02) for _ in range(PARAMS)]
    model = torch.nn.Module()
    model.params = torch.nn.ParameterList(params)
    opt = torch.optim.Adam(params, lr=1e-4)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    return model, opt, x


def train_step(opt: Any, x: Any) -> None:
    """Some GPU compute (matmuls), then the optimizer's step over the checkpointed state."""
    y = x
    for _ in range(4):
        y = y @ x
    opt.step()


def fingerprint(model: Any, opt: Any) -> float:
    s = 0.0
    for p in model.params:
        s += float(p.detach()[:64].double().sum()) + float(p.detach()[-64:].double().sum())
    for st in opt.state.values():
        s += float(st["exp_avg"][:64].double().sum()) + float(st["exp_avg_sq"][-64:].double().sum())
    return s


class Peer:
    """save(step) -> waiter for durable; restore() into the live objects."""

    def __init__(self, name: str, wd: str, model: Any, opt: Any, torch: Any) -> None:
        self.name, self.wd, self.model, self.opt, self.torch = name, wd, model, opt, torch
        os.makedirs(wd, exist_ok=True)
        self.mgr: Any = None
        self.last = ""
        if name == "pitstop":
            import pitstop

            self.mgr = pitstop.CheckpointManager(wd, keep_last=1, memory_tier=False,
                                                 save_on_signals=())
            self.rng = pitstop.RNG()

    def sd(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def save(self, step: int) -> Any:
        torch = self.torch
        if self.name == "pitstop":
            h = self.mgr.save(step, {"model": self.model, "optim": self.opt, "rng": self.rng})
            return h.result
        path = self.last = os.path.join(self.wd, f"{step:08d}")
        if self.name == "torch.save":
            torch.save(self.sd(), path + ".pt")
            return lambda: None
        import torch.distributed.checkpoint as dcp

        f = dcp.async_save(self.sd(), checkpoint_id=path)
        return f.result

    def restore(self) -> None:
        torch = self.torch
        if self.name == "pitstop":
            self.mgr.restore({"model": self.model, "optim": self.opt, "rng": self.rng})
        elif self.name == "torch.save":
            sd = torch.load(self.last + ".pt", weights_only=True, map_location="cuda")
            self.model.load_state_dict(sd["model"])
            self.opt.load_state_dict(sd["optim"])
        else:
            import torch.distributed.checkpoint as dcp

            sd = self.sd()
            dcp.load(sd, checkpoint_id=self.last)
            self.model.load_state_dict(sd["model"])
            self.opt.load_state_dict(sd["optim"])
        torch.cuda.synchronize()

    def close(self) -> None:
        if self.mgr is not None:
            self.mgr.close()


def measure(name: str, nbytes: int, wd: str, steps: int, torch: Any) -> dict[str, Any]:
    model, opt, x = build(nbytes, torch)
    peer = Peer(name, wd, model, opt, torch)
    out: dict[str, Any] = {"peer": name, "bytes": sum(
        p.numel() * 4 for p in model.params) * 3}
    for _ in range(3):
        train_step(opt, x)
    torch.cuda.synchronize()
    stalls, durables = [], []
    for step in range(3):  # the first is the job's first save: reported apart
        train_step(opt, x)
        torch.cuda.synchronize()
        t = time.perf_counter()
        wait = peer.save(step)
        stalls.append(time.perf_counter() - t)
        wait()
        durables.append(time.perf_counter() - t)
    out.update(first_stall_s=stalls[0], stall_s=statistics.median(stalls[1:]),
               durable_s=statistics.median(durables[1:]))

    def loop(with_save: bool, step0: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        wait = None
        for i in range(steps):
            train_step(opt, x)
            if with_save and i == 1:
                wait = peer.save(step0 + i)
        torch.cuda.synchronize()
        if wait is not None:
            wait()
        return time.perf_counter() - t

    base, saved = [], []
    for r in range(2):
        base.append(loop(False, 0))
        saved.append(loop(True, 100 + r * steps))
    base.append(loop(False, 0))
    out["loop_s"] = statistics.median(base)
    out["lost_s"] = statistics.median(saved) - out["loop_s"]
    # restore: change the state, bring the saved one back, check it
    train_step(opt, x)
    torch.cuda.synchronize()
    fp = fingerprint(model, opt)
    if name == "pitstop":
        torch.randn(1, device="cuda")  # the generator state the checkpoint must bring back
        rng_before = torch.cuda.get_rng_state().clone()
    wait = peer.save(10_000)
    wait()
    for p in model.params:
        p.data.mul_(0.5)
    if name == "pitstop":
        torch.randn(1000, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    peer.restore()
    out["restore_s"] = time.perf_counter() - t
    out["restored_ok"] = abs(fingerprint(model, opt) - fp) <= 1e-6 * max(1.0, abs(fp))
    if name == "pitstop":
        out["cuda_rng_bitwise"] = bool(torch.equal(torch.cuda.get_rng_state(), rng_before))
    peer.close()
    torch.cuda.empty_cache()
    return out


def memcpy_floor(nbytes: int, torch: Any) -> float:
    """Device -> pinned host copy of the same bytes (the floor of a GPU snapshot)."""
    src = torch.empty(nbytes // 4, device="cuda")
    dst = torch.empty(nbytes // 4, pin_memory=True)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    s = time.perf_counter() - t
    del src, dst
    torch.cuda.empty_cache()
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="256M only, short loops")
    ap.add_argument("--sizes", default=None, help="e.g. 1G,4G (default; --quick: 256M)")
    ap.add_argument("--peers", default="torch.save,dcp.async_save,pitstop")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("no CUDA device: torch is not installed; nothing measured")
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: torch.cuda.is_available() is False; nothing measured")
        return 0
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if "dcp.async_save" in args.peers:
        import torch.distributed as dist

        if not dist.is_initialized():  # DCP's async_save wants a process group (of one)
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29533")
            dist.init_process_group("gloo", rank=0, world_size=1)
    units = {"M": 1 << 20, "G": GiB}
    sizes = (args.sizes or ("256M" if args.quick else "1G,4G")).split(",")
    steps = 20 if args.quick else 60
    wd = args.workdir or tempfile.mkdtemp(prefix="pitstop-cuda-")
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                               "sizes": []}
    t0 = time.perf_counter()
    for s in sizes:
        nbytes = int(float(s[:-1]) * units[s[-1].upper()])
        rows = []
        floor = memcpy_floor(nbytes, torch)
        for name in [p.strip() for p in args.peers.split(",") if p.strip()]:
            d = os.path.join(wd, f"{s}-{name}")
            try:
                rows.append(measure(name, nbytes, d, steps, torch))
            except Exception as e:  # one peer's failure is a row, not the end of the run
                rows.append({"peer": name, "failed": f"{type(e).__name__}: {e}"[:160]})
            shutil.rmtree(d, ignore_errors=True)
            print(f"[{time.perf_counter() - t0:5.0f} s] {s} {name}: {rows[-1]}", file=sys.stderr,
                  flush=True)
        results["sizes"].append({"size": s, "d2h_pinned_s": floor, "rows": rows})
    if args.workdir is None:
        shutil.rmtree(wd, ignore_errors=True)
    print(f"Device: {results['device']}, torch {results['torch']} "
          f"({time.perf_counter() - t0:.0f} s). Ratios to a device->pinned-host copy of the "
          "same bytes.\n")
    print("| size | peer | first stall | stall | stall / d2h | lost / save | lost / d2h | "
          "save → durable | restore | restored | CUDA RNG bitwise |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for size in results["sizes"]:
        f = size["d2h_pinned_s"]
        for r in size["rows"]:
            if "failed" in r:
                print(f"| {size['size']} | {r['peer']} | failed: {r['failed']} |" + " |" * 9)
                continue
            print(f"| {size['size']} | {r['peer']} | {r['first_stall_s']:.3f} s | "
                  f"{r['stall_s']:.3f} s | {r['stall_s'] / f:.2f} | {r['lost_s']:.3f} s | "
                  f"{r['lost_s'] / f:.2f} | {r['durable_s']:.3f} s | {r['restore_s']:.3f} s | "
                  f"{r['restored_ok']} | {r.get('cuda_rng_bitwise', '—')} |")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_cuda.json"), "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
