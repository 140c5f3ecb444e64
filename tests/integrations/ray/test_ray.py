"""Ray Train 2.60 (Train V2) with pitstop's Checkpointing: one local Ray cluster for the
module, an uninterrupted run on local disk, and the same run on the S3 test server with one
worker process SIGKILLed at a random step; Ray restarts the worker group
(FailureConfig(max_failures=2)) and the run ends bitwise where the uninterrupted one did."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import uuid

import pytest
import ray
import ray.cloudpickle
import ray_loop
import s3_server
import torch
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import pitstop

moto = s3_server.moto  # the session's S3 server (tests/s3_server.py)
TOTAL, SAVE_EVERY, KEEP = 12, 3, 2


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.cloudpickle.register_pickle_by_value(ray_loop)  # the workers need not import it
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    yield
    ray.shutdown()


def fit(storage_path: str, name: str, out, *, filesystem=None, func=ray_loop.train_func,
        **extra):
    os.makedirs(out, exist_ok=True)
    config = {"out": str(out), "total_steps": TOTAL, "save_every": SAVE_EVERY, **extra}
    trainer = TorchTrainer(
        func, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(storage_path=storage_path, name=name, storage_filesystem=filesystem,
                             failure_config=FailureConfig(max_failures=2),
                             checkpoint_config=CheckpointConfig(num_to_keep=KEEP)))
    return trainer.fit()


def losses(out, rank: int) -> dict[int, str]:
    """step -> the loss of that step (hex), every attempt's line checked against the others."""
    seen: dict[int, str] = {}
    with open(os.path.join(out, f"losses-r{rank}.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            assert seen.setdefault(row["step"], row["loss"]) == row["loss"], row
    return seen


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    result = fit(str(out / "storage"), "ref", out / "out")
    return out, result


def test_uninterrupted_run_reports_pitstop_checkpoints_and_keeps_num_to_keep(reference):
    out, result = reference
    assert result.error is None
    ckpt = result.checkpoint
    # Ray's checkpoint of the last report is pitstop's checkpoint directory, nothing copied
    assert ckpt.path == str(out / "storage" / "ref" / "pitstop" / f"step_{TOTAL - 1:010d}")
    with pitstop.CheckpointManager(os.path.dirname(ckpt.path), read_only=True) as mgr:
        assert mgr.all_steps() == [9, 11]  # num_to_keep=2 of 0, 3, 6, 9, 11
        assert mgr.metadata(TOTAL - 1).world == 2
    assert [c.path for c, _ in result.best_checkpoints] == [
        str(out / "storage" / "ref" / "pitstop" / f"step_{s:010d}") for s in (9, 11)]
    assert sorted(losses(out / "out", 0)) == list(range(TOTAL))


def test_worker_sigkilled_mid_run_on_s3_resumes_bitwise(reference, moto, tmp_path):
    import pyarrow.fs

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    kill_step, kill_rank = rng.randrange(4, TOTAL - 2), rng.randrange(2)
    print(f"seed {seed}: SIGKILL of rank {kill_rank} after step {kill_step}")
    bucket = f"ray-{uuid.uuid4().hex[:10]}"
    s3_server.s3_client(moto.endpoint).create_bucket(Bucket=bucket)
    fs = pyarrow.fs.S3FileSystem(endpoint_override=moto.endpoint.split("://")[1],
                                 scheme="http", region="us-east-1",
                                 access_key="pitstop-test", secret_key="pitstop-test")
    out = tmp_path / "out"
    killed: list[int] = []

    def killer() -> None:
        pid_file = out / "pid"
        deadline = time.monotonic() + 240
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # waiting for the state: the worker wrote its pid
        if pid_file.exists():
            killed.append(int(pid_file.read_text()))
            os.kill(killed[0], signal.SIGKILL)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    result = fit(f"{bucket}/runs", "killed", out, filesystem=fs,
                 kill_step=kill_step, kill_rank=kill_rank)
    thread.join(5)
    assert killed, "the worker never reached the kill step"
    assert result.error is None

    # the restarted group resumed from a saved step, not from the start
    starts = {json.loads(line)["start"] for line in open(out / "losses-r0.jsonl")}
    assert len(starts) == 2 and 0 in starts and max(starts) > 0, starts
    ref_out = reference[0] / "out"
    for rank in (0, 1):
        assert losses(out, rank) == losses(ref_out, rank)
    got = torch.load(out / "final.pt", weights_only=True)
    want = torch.load(ref_out / "final.pt", weights_only=True)
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    for i, s in want["optimizer"]["state"].items():
        for k, v in s.items():
            assert torch.equal(got["optimizer"]["state"][i][k], v), (i, k)

    # Ray's checkpoint is the pitstop checkpoint on the S3 server
    assert result.checkpoint.path == f"{bucket}/runs/killed/pitstop/step_{TOTAL - 1:010d}"
    with pitstop.CheckpointManager(
            f"s3://{bucket}/runs/killed/pitstop", read_only=True,
            storage_options={"endpoint_url": moto.endpoint, "key": "pitstop-test",
                             "secret": "pitstop-test"}) as mgr:
        assert TOTAL - 1 in mgr.all_steps() and mgr.metadata(TOTAL - 1).world == 2


@pytest.fixture(scope="module")
def native(cluster, tmp_path_factory):
    """The same run through Ray's own checkpointing (torch.save + report)."""
    out = tmp_path_factory.mktemp("native")
    result = fit(str(out / "storage"), "native", out / "out", func=ray_loop.native_func)
    return out, result


def fresh_model_and_opt():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2),
                                torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_rays_own_checkpointing_and_pitstops_agree(reference, native, tmp_path):
    """docs/migration.md's Ray rows: the same run through torch.save + ray.train.report and
    through Checkpointing: the same losses, the same steps kept by num_to_keep, the same
    values in the last checkpoint; and the torch.save checkpoint continued under pitstop."""
    from ray.train import Checkpoint

    (ref_out, ref), (nat_out, nat) = reference, native
    assert nat.error is None
    for rank in (0, 1):
        assert losses(nat_out / "out", rank) == losses(ref_out / "out", rank)
    assert [m["step"] for _, m in nat.best_checkpoints] == \
        [m["step"] for _, m in ref.best_checkpoints] == [9, 11]

    # the migration: Ray's torch.save checkpoint restored through Checkpointing ...
    from pitstop.integrations.ray import Checkpointing

    model, opt = fresh_model_and_opt()
    with Checkpointing({"model": model, "optimizer": opt}, tmp_path / "continued") as ckpt:
        assert ckpt.restore(Checkpoint(nat.checkpoint.path)) == TOTAL - 1
    # ... holds what pitstop's own checkpoint of the same step holds
    want_model, want_opt = fresh_model_and_opt()
    with pitstop.CheckpointManager(os.path.dirname(ref.checkpoint.path), read_only=True) as mgr:
        mgr.restore({"model": want_model, "optimizer": want_opt}, step=TOTAL - 1,
                    strict=False)
    for k, v in want_model.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(opt.state_dict()["state"][0][k], want_opt.state_dict()["state"][0][k])
