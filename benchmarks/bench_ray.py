"""The training-thread stall of a checkpointed report in Ray Train: pitstop's
``Checkpointing.report(checkpoint=True)`` against Ray's usual ``torch.save`` into a temporary
folder plus ``ray.train.report(checkpoint=Checkpoint.from_directory(folder))`` (its default
synchronous upload into the run's storage), on the same state, in one Ray Train worker.

The state is an fp32 model of ``--mib`` MiB with AdamW's two moments (3 x the bytes). Each
figure is the median of ``--repeat`` reports; pitstop's save is waited for between reports
(so none is skipped), outside the stall measured.

Run: ``python benchmarks/bench_ray.py --mib 64 --repeat 3``. Never part of the test run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def train_func(config: dict) -> None:
    import ray.train
    import torch
    from ray.train import Checkpoint

    from pitstop.integrations.ray import Checkpointing

    n = config["mib"] << 18  # fp32 elements
    model = torch.nn.Linear(n // 1024, 1024, bias=False)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, n // 1024)).sum().backward()
    opt.step()
    pitstop_s, ray_s = [], []
    with Checkpointing({"model": model, "optimizer": opt}) as ckpt:
        for i in range(config["repeat"]):
            t0 = time.perf_counter()
            ckpt.report({"i": i}, step=i, checkpoint=True)
            pitstop_s.append(time.perf_counter() - t0)
            ckpt.manager.wait()
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory() as d:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                           os.path.join(d, "model.pt"))
                ray.train.report({"i": i}, checkpoint=Checkpoint.from_directory(d))
            ray_s.append(time.perf_counter() - t0)
    with open(config["out"], "w") as f:
        json.dump({"pitstop": pitstop_s, "ray": ray_s}, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="model MiB (state: 3x)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "figures.json")
        TorchTrainer(train_func, train_loop_config={"mib": args.mib, "repeat": args.repeat,
                                                    "out": out},
                     scaling_config=ScalingConfig(num_workers=1),
                     run_config=RunConfig(storage_path=os.path.join(tmp, "storage"),
                                          name="bench")).fit()
        with open(out) as f:
            got = json.load(f)
    ray.shutdown()
    print(f"state_mib {3 * args.mib}  "
          f"pitstop_report_stall_s {statistics.median(got['pitstop']):.3f}  "
          f"torch_save_report_s {statistics.median(got['ray']):.3f}")


if __name__ == "__main__":
    main()
