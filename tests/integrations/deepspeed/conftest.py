"""DeepSpeed integration tests: deepspeed (on its CPU accelerator, one gloo rank) or a skip.
The folder is put on sys.path for ds_helpers, which the killed child imports too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed")

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="package")
def ds_dist():
    """One gloo rank for the in-process engines, torn down after the folder, with the
    environment put back: its RANK / WORLD_SIZE / MASTER_PORT would make the jobs later
    tests start (the HF Trainer's, through accelerate) join this process's group."""
    import os

    import ds_helpers
    import torch.distributed as dist

    fresh = not dist.is_initialized()
    before = dict(os.environ)
    ds_helpers.init_distributed()
    yield
    if fresh and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(before)
