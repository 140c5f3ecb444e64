"""Orbax interop with encryption at rest (in the JAX folder: Orbax imports JAX, which the main
test process never loads)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import pitstop

KEY = bytes(range(32))


def mgr(d, **kw) -> pitstop.CheckpointManager:
    return pitstop.CheckpointManager(d, encryption=pitstop.Encryption(lambda: KEY),
                                     save_on_signals=None, memory_tier=False, **kw)


def step_dir(d, s: int) -> Path:
    return Path(d) / f"step_{s:010d}"


def saved(d, steps=(1,)) -> None:
    with mgr(d) as m:
        for s in steps:
            m.save(s, {"w": np.arange(3.0) * s, "step": s}).wait()


def test_import_orbax_with_encryption_into_an_encrypted_directory(tmp_path):
    """Before the fix: import_orbax(..., encryption=key) was refused with "is encrypted; set
    PITSTOP_ENCRYPTION_KEY" since its check for existing steps opened the directory without
    the key it was given."""
    ocp = pytest.importorskip("orbax.checkpoint")
    from pitstop.adapters.jax import import_orbax
    d, o = tmp_path / "secret", tmp_path / "orbax"
    saved(d, steps=(1,))
    om = ocp.CheckpointManager(o)
    om.save(7, args=ocp.args.StandardSave({"w": np.arange(3.0)}))
    om.wait_until_finished()
    om.close()
    assert import_orbax(o, d, encryption=pitstop.Encryption(lambda: KEY)) == [7]
    with mgr(d, read_only=True) as m:
        assert m.all_steps() == [1, 7] and m.load(7)["w"].tolist() == [0, 1, 2]
        assert m.metadata(7).step == 7
    assert "encryption" in json.loads((step_dir(d, 7) / "manifest.json").read_bytes())
