"""Ray Train 2.60 (Train V2) with pitstop's Checkpointing: one local Ray cluster for the
module and two runs of the same training (tests/integrations/ray/ray_loop.py):

* the reference: Ray's own checkpointing (torch.save + ray.train.report), uninterrupted, on
  local disk;
* pitstop's Checkpointing on the S3 test server, with one worker process SIGKILLed after a
  random step: Ray restarts the worker group (FailureConfig(max_failures=2)) and the run
  ends bitwise where the reference did, every step's loss equal.

The same pitstop run on local disk is docs/ray.md's quickstart (tests/test_docs.py)."""

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
from ray.train import Checkpoint, CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import pitstop
from pitstop.integrations.ray import Checkpointing

moto = s3_server.moto  # the session's S3 server (tests/s3_server.py)
TOTAL, SAVE_EVERY, KEEP = 12, 3, 2
# the module's fixture is two Ray fits of 2 workers each: alone on the 2-core machine, 113 s
# at Ray's 2 s RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (each step's report waits for a poll), 47-52 s
# at 0.1 s, 67 s at the 0.5 s tests/conftest.py sets (docs/ray.md: 41, 26.5, 24 s). At 2 s it took over 300 s, the suite's default limit, with two suites at
# once: the limit leaves room for a loaded machine
pytestmark = pytest.mark.timeout(900)
KEYS = {"key": "pitstop-test", "secret": "pitstop-test"}


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
def native(cluster, tmp_path_factory):
    """The reference: the same run through Ray's own checkpointing, uninterrupted."""
    out = tmp_path_factory.mktemp("native")
    result = fit(str(out / "storage"), "native", out / "out", func=ray_loop.native_func)
    assert result.error is None
    return out / "out", result


@pytest.fixture(scope="module")
def killed(cluster, moto, tmp_path_factory):
    """pitstop's run on the S3 server, one worker SIGKILLed after a random step."""
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
    out = tmp_path_factory.mktemp("killed") / "out"
    pids: list[int] = []

    def killer() -> None:
        pid_file = out / "pid"
        deadline = time.monotonic() + 240
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # waiting for the state: the worker wrote its pid
        if pid_file.exists():
            pids.append(int(pid_file.read_text()))
            os.kill(pids[0], signal.SIGKILL)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    result = fit(f"{bucket}/runs", "killed", out, filesystem=fs,
                 kill_step=kill_step, kill_rank=kill_rank)
    thread.join(5)
    assert pids, "the worker never reached the kill step"
    assert result.error is None
    url = f"s3://{bucket}/runs/killed/pitstop"
    return out, result, url, {"endpoint_url": moto.endpoint, **KEYS}


def test_worker_sigkilled_mid_run_resumes_bitwise(native, killed):
    (ref_out, _), (out, _, _, _) = native, killed
    # the restarted group resumed from a saved step, not from the start
    starts = {json.loads(line)["start"] for line in open(out / "losses-r0.jsonl")}
    assert len(starts) == 2 and 0 in starts and max(starts) > 0, starts
    for rank in (0, 1):
        assert losses(out, rank) == losses(ref_out, rank)
    got = torch.load(out / "final.pt", weights_only=True)
    want = torch.load(ref_out / "final.pt", weights_only=True)
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert want["optimizer"]["state"]
    for i, s in want["optimizer"]["state"].items():
        for k, v in s.items():
            assert torch.equal(got["optimizer"]["state"][i][k], v), (i, k)


def test_rays_checkpoint_is_the_pitstop_checkpoint_on_s3(killed):
    _, result, url, options = killed
    bucket_path = url.split("://")[1]
    # Ray's checkpoint of the last report is pitstop's checkpoint directory, nothing copied
    assert result.checkpoint.path == f"{bucket_path}/step_{TOTAL - 1:010d}"
    assert [c.path for c, _ in result.best_checkpoints] == [
        f"{bucket_path}/step_{s:010d}" for s in (9, 11)]  # num_to_keep=2 of 0, 3, 6, 9, 11
    with pitstop.CheckpointManager(url, read_only=True, storage_options=options) as mgr:
        steps = mgr.all_steps()
        assert {9, 11} <= set(steps) and 0 not in steps, steps  # Ray deleted what it evicted
        assert mgr.metadata(TOTAL - 1).world == 2


def fresh_model_and_opt():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2),
                                torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_rays_own_checkpointing_and_pitstops_agree(native, killed, tmp_path):
    """docs/migration.md's Ray rows: the same run through torch.save + ray.train.report and
    through Checkpointing: the same steps kept by num_to_keep, the same values in the last
    checkpoint (the losses: above); and the torch.save checkpoint continued under pitstop."""
    (_, nat), (_, ours, url, options) = native, killed
    assert [m["step"] for _, m in nat.best_checkpoints] == \
        [m["step"] for _, m in ours.best_checkpoints] == [9, 11]
    # the migration: Ray's torch.save checkpoint restored through Checkpointing ...
    model, opt = fresh_model_and_opt()
    with Checkpointing({"model": model, "optimizer": opt}, tmp_path / "continued") as ckpt:
        assert ckpt.restore(Checkpoint(nat.checkpoint.path)) == TOTAL - 1
    # ... holds what pitstop's own checkpoint of the same step holds
    want_model, want_opt = fresh_model_and_opt()
    with pitstop.CheckpointManager(url, read_only=True, storage_options=options) as mgr:
        mgr.restore({"model": want_model, "optimizer": want_opt}, step=TOTAL - 1,
                    strict=False)
    for k, v in want_model.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(opt.state_dict()["state"][0][k], want_opt.state_dict()["state"][0][k])
