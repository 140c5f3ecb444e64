"""One rank of the two-rank ZeRO-2 job of test_two_ranks.py (``RANK`` etc. in the
environment, as the deepspeed launcher sets them): save step 3 through pitstop, train on to
step 8, then restore step 3 into a fresh engine, train again, and check both runs agree
bitwise; prints ``rank R ok PARTITION_SIZE``."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import deepspeed  # noqa: E402
import ds_helpers as h  # noqa: E402

import pitstop  # noqa: E402
from pitstop.adapters.torch import ResumableLoader  # noqa: E402
from pitstop.integrations.deepspeed import engine_state  # noqa: E402


class _Restored:
    def restore(self, state):
        steps = state["engine"]["progress"]._engine.global_steps
        return None if steps == 0 else steps - 1

    def step(self, step, state, metrics=None):
        return None


def _job(seed: int, rank: int):
    engine, loader = h.build(2, seed=seed)
    loader = ResumableLoader(loader.dataset, batch_size=h.MICRO, shuffle=True, seed=rank)
    return engine, {"engine": engine_state(engine), "loader": loader, "rng": pitstop.RNG()}


def main() -> None:
    directory, rank = sys.argv[1], int(os.environ["RANK"])
    h.skip_shm_kernel()
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    engine, state = _job(0, rank)
    with pitstop.CheckpointManager(directory, on_busy="wait") as mgr:
        h.train(engine, state["loader"], _Restored(), state, 4)
        mgr.save(3, state).wait()
        ref = h.train(engine, state["loader"], _Restored(), state, 8)
    want = h.snapshot(engine)
    engine2, state2 = _job(9, rank)  # other weights: the restore must put this rank's back
    with pitstop.CheckpointManager(directory) as mgr:
        assert mgr.restore(state2) == 3
        assert mgr.metadata(3).world == 2
        got = h.train(engine2, state2["loader"], _Restored(), state2, 8)
    assert got == ref, (got, ref)
    h.assert_same(want, h.snapshot(engine2))
    size = engine2.optimizer.single_partition_of_fp32_groups[0].numel()
    os.write(1, f"rank {rank} ok {size}\n".encode())


if __name__ == "__main__":
    main()
