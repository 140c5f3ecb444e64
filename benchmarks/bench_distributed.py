"""Multi-rank saves on torch.distributed (gloo, 127.0.0.1), against the physical floor and DCP.

For N ranks (processes on this machine) holding a DDP-style state (``--replicated`` MiB
of fp32, the same on every rank) and an FSDP-style one (``--sharded`` MiB in total, a
``Shard(0)`` DTensor split over the ranks), this measures on every rank:

* pitstop: the stall of ``save`` (the snapshot), save-to-commit (the two-phase commit of all
  ranks, every byte hashed and fsynced), and ``restore`` into the live tensors;
* DCP: ``torch.distributed.checkpoint.save`` and ``load`` of the same state;
* the floor: the bytes each rank writes (pitstop writes replicated state once, split
  between ranks) written to one file with fsync, all ranks at once.

Run: ``python benchmarks/bench_distributed.py --ranks 2,4 --replicated 256 --sharded 256``.
Never part of the test run. Figures are the slowest rank's, median of ``--repeat`` saves.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import pitstop

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (world,))
    n_rep = args.replicated * 2**20 // 4 // 8
    rep = {f"w{i}": torch.randn(n_rep) for i in range(8)}
    n_sh = args.sharded * 2**20 // 4 // 1024
    sharded = distribute_tensor(torch.randn(n_sh, 1024), mesh, [Shard(0)], src_data_rank=None)
    state = {"model": rep, "fsdp": sharded}
    out: dict[str, list[float]] = {"stall": [], "commit": [], "restore": [], "dcp_save": [],
                                   "dcp_load": [], "floor": []}
    root = args.dir
    mgr = pitstop.CheckpointManager(os.path.join(root, "pitstop"), keep_last=1,
                                    save_on_signals=None, memory_tier=False)
    rep_bytes = sum(t.numel() * 4 for t in rep.values())
    mine = rep_bytes // world + sharded.to_local().numel() * 4
    for i in range(args.repeat):
        dist.barrier()
        t0 = time.perf_counter()
        h = mgr.save(i, state)
        t1 = time.perf_counter()
        h.wait()
        t2 = time.perf_counter()
        out["stall"].append(t1 - t0)
        out["commit"].append(t2 - t0)
        dist.barrier()
        t0 = time.perf_counter()
        mgr.restore(state)
        out["restore"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        path = os.path.join(root, f"dcp-{i}")
        dcp.save(state, checkpoint_id=path)
        out["dcp_save"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        dcp.load(state, checkpoint_id=path)
        out["dcp_load"].append(time.perf_counter() - t0)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        # the floor: this rank's share of the bytes, one file, fsync, all ranks together
        buf = memoryview(bytearray(os.urandom(1 << 20)) * (mine // (1 << 20) or 1))
        dist.barrier()
        t0 = time.perf_counter()
        fd = os.open(os.path.join(root, f"floor-{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.write(fd, buf)
        os.fsync(fd)
        os.close(fd)
        dist.barrier()
        out["floor"].append(time.perf_counter() - t0)
        del buf
    mgr.close()
    print("RESULT " + json.dumps({k: statistics.median(v) for k, v in out.items()}), flush=True)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--replicated", type=int, default=256, help="MiB, the same on every rank")
    p.add_argument("--sharded", type=int, default=256, help="MiB in total, split over ranks")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.world, args.port, args)
        return
    print(f"state: {args.replicated} MiB replicated (DDP) + {args.sharded} MiB sharded (FSDP)")
    print(f"{'ranks':>5} {'stall s':>8} {'commit s':>9} {'floor s':>8} {'commit/floor':>12} "
          f"{'restore s':>9} {'DCP save s':>10} {'DCP load s':>10}")
    for world in (int(x) for x in args.ranks.split(",")):
        d = tempfile.mkdtemp(prefix="pitstop-bench-dist-", dir=os.getcwd())
        port = free_port()
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
        procs = [subprocess.Popen(
            [sys.executable, __file__, "--rank", str(r), "--world", str(world), "--port",
             str(port), "--dir", d, "--replicated", str(args.replicated), "--sharded",
             str(args.sharded), "--repeat", str(args.repeat)],
            stdout=subprocess.PIPE, text=True, env=env) for r in range(world)]
        results = []
        for proc in procs:
            text, _ = proc.communicate(timeout=1800)
            line = [x for x in text.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                raise SystemExit(f"a rank failed (status {proc.returncode}):\n{text}")
            results.append(json.loads(line[-1][7:]))
        shutil.rmtree(d, ignore_errors=True)
        worst = {k: max(r[k] for r in results) for k in results[0]}
        print(f"{world:>5} {worst['stall']:>8.3f} {worst['commit']:>9.3f} {worst['floor']:>8.3f} "
              f"{worst['commit'] / worst['floor']:>12.2f} {worst['restore']:>9.3f} "
              f"{worst['dcp_save']:>10.3f} {worst['dcp_load']:>10.3f}")


if __name__ == "__main__":
    main()
