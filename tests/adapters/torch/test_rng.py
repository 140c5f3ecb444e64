"""Random streams continue after a restore exactly as in the uninterrupted run."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import pitstop


def draws(gen_np: np.random.Generator, rs: np.random.RandomState, rnd: random.Random,
          tg: torch.Generator):
    return (random.random(), random.getrandbits(64), np.random.rand(3).tolist(),
            np.random.normal(), gen_np.integers(0, 2**62, 4).tolist(), gen_np.standard_normal(),
            rs.rand(), rnd.random(), torch.rand(4).tolist(), torch.randn(2).tolist(),
            torch.randint(0, 10**9, (3,)).tolist(), torch.rand(2, generator=tg).tolist())


def test_rng_continuity(manager):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    objs = [np.random.default_rng(4), np.random.RandomState(5), random.Random(6),
            torch.Generator().manual_seed(7)]
    draws(*objs)  # advance everything a bit, including numpy's cached gaussian
    state = {"rng": pitstop.RNG(), "np_gen": objs[0], "rs": objs[1], "rnd": objs[2],
             "tg": objs[3]}
    mgr = manager()
    mgr.save(1, state)
    expected = [draws(*objs) for _ in range(3)]

    # scramble everything, restore into fresh objects and the same globals
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    fresh = [np.random.default_rng(0), np.random.RandomState(0), random.Random(0),
             torch.Generator()]
    state2 = {"rng": pitstop.RNG(), "np_gen": fresh[0], "rs": fresh[1], "rnd": fresh[2],
              "tg": fresh[3]}
    assert mgr.restore(state2) == 1
    assert [draws(*fresh) for _ in range(3)] == expected


def test_rng_state_is_json_values(manager):
    mgr = manager()
    mgr.save(1, {"rng": pitstop.RNG(), "g": np.random.Generator(np.random.MT19937(1))})
    m = mgr.metadata(1)
    assert not m.arrays  # nothing binary: all of it is in the manifest's values
    assert {"python", "numpy", "torch"} <= set(m.values["rng"])


def test_rng_only_selects_providers():
    assert set(pitstop.RNG(only=["python", "torch"]).state_dict()) == {"python", "torch"}


def test_rng_imports_no_framework_and_skips_absent_ones(manager, tmp_path):
    """Without torch imported, RNG captures Python and numpy only; restoring a checkpoint
    that holds torch's state there warns and restores the rest."""
    random.seed(11)
    np.random.seed(12)
    mgr = manager()
    mgr.save(1, {"rng": pitstop.RNG()})
    mgr.close()
    expected = [random.random(), float(np.random.rand())]
    code = textwrap.dedent(f"""
        import logging, random, sys
        import numpy as np
        import pitstop
        logging.basicConfig(level=logging.WARNING)
        random.seed(0); np.random.seed(0)
        assert set(pitstop.RNG().state_dict()) == {{"python", "numpy"}}
        with pitstop.CheckpointManager({str(tmp_path / "ckpt")!r}, save_on_signals=None,
                                       memory_tier=False) as mgr:
            assert mgr.restore({{"rng": pitstop.RNG()}}) == 1
        assert "torch" not in sys.modules, "pitstop imported torch"
        print([random.random(), float(np.random.rand())])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr(expected)
    assert "torch is not imported" in out.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rng_continuity(manager):
    torch.cuda.manual_seed_all(5)
    torch.rand(3, device="cuda")
    mgr = manager()
    mgr.save(1, {"rng": pitstop.RNG()})
    expected = torch.rand(8, device="cuda").cpu()
    torch.cuda.manual_seed_all(0)
    mgr.restore({"rng": pitstop.RNG()})
    assert torch.equal(torch.rand(8, device="cuda").cpu(), expected)
