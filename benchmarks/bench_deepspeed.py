"""DeepSpeed's ``engine.save_checkpoint`` against pitstop's save of ``engine_state(engine)``,
on the same engine (one gloo rank, DeepSpeed's CPU accelerator, ZeRO stage ``--stage``).

The model is ``--layers`` Linear(``--width``, ``--width``) layers with AdamW; its state is
weights + fp32 master partition + two moments. Measured, median of ``--repeat`` saves:

* DeepSpeed: ``save_checkpoint`` (the training thread waits for all of it; no fsync);
* pitstop: the stall of ``mgr.save`` (the snapshot), and save to durable commit (every byte
  hashed, fsynced).

Run: ``python benchmarks/bench_deepspeed.py --width 2048 --layers 4 --repeat 3``.
Never part of the test run.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    import torch

    import pitstop
    from pitstop.integrations.deepspeed import engine_state

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width)
                                  for _ in range(args.layers)])
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters()),
        config={"train_micro_batch_size_per_gpu": 2,
                "zero_optimization": {"stage": args.stage}})
    loss = engine(torch.randn(2, args.width)).sum()
    engine.backward(loss)
    engine.step()
    mib = sum(p.numel() * 4 for p in model.parameters()) * (4 if args.stage else 3) / 2**20
    root = tempfile.mkdtemp(prefix="bench-ds-")
    theirs, stall, commit = [], [], []
    state = {"engine": engine_state(engine)}
    with pitstop.CheckpointManager(os.path.join(root, "pitstop"), memory_tier=False) as mgr:
        for i in range(args.repeat):
            t = time.perf_counter()
            engine.save_checkpoint(os.path.join(root, "ds"), tag=f"t{i}")
            theirs.append(time.perf_counter() - t)
            t = time.perf_counter()
            handle = mgr.save(i, state)
            stall.append(time.perf_counter() - t)
            handle.wait()
            commit.append(time.perf_counter() - t)
    print(f"state {mib:.0f} MiB, ZeRO stage {args.stage}, median of {args.repeat}:")
    print(f"  deepspeed_save_checkpoint  {statistics.median(theirs):.3f} s (blocks training)")
    print(f"  pitstop_stall              {statistics.median(stall):.3f} s "
          f"(first save {stall[0]:.3f} s)")
    print(f"  pitstop_save_to_commit     {statistics.median(commit):.3f} s")


if __name__ == "__main__":
    main()
