"""`pitstop export --to orbax` and `pitstop import` of an Orbax directory, with Orbax's own
writer and reader (this folder runs in a process of its own)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import pitstop
from pitstop.cli import main

ocp = pytest.importorskip("orbax.checkpoint")


def test_orbax_export_then_import_is_identical(tmp_path, capsys):
    state = {"params": {"w": np.arange(6, dtype=np.float32).reshape(2, 3),
                        "b": np.ones(3, ml_dtypes.bfloat16)}, "count": np.array(5, np.int32)}
    with pitstop.CheckpointManager(tmp_path / "run", memory_tier=False, async_save=False,
                                   save_on_signals=None) as mgr:
        mgr.save(3, state).wait()
    rc = main(["export", str(tmp_path / "run"), "--to", "orbax", "-o", str(tmp_path / "orb")])
    out, err = capsys.readouterr()
    assert (rc, err) == (0, ""), err
    assert out.startswith("exported 3 arrays") and "(orbax)" in out
    restored = ocp.StandardCheckpointer().restore(tmp_path / "orb" / "3" / "default")
    np.testing.assert_array_equal(restored["params"]["w"], state["params"]["w"])
    rc = main(["import", str(tmp_path / "orb"), str(tmp_path / "back")])  # format guessed
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out == f"imported 3 arrays (34 B) from {tmp_path / 'orb'} as step 3 of " \
        f"{tmp_path / 'back'}\n"
    assert main(["diff", str(tmp_path / "run"), str(tmp_path / "back")]) == 0
    capsys.readouterr()
    # the step is there now: refused, one line
    assert main(["import", str(tmp_path / "orb"), str(tmp_path / "back")]) == 2
    err = capsys.readouterr().err
    assert "already has a checkpoint of step 3" in err and err.count("\n") == 1


def test_diff_assembles_sharded_arrays(tmp_path, capsys):
    """A sharded jax.Array against the same values saved whole: compared as restore reads
    them (shards assembled), so only the changed element is reported."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 host devices (XLA_FLAGS, tests/adapters/jax/conftest.py)")
    host = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    sharded = jax.device_put(host, NamedSharding(mesh, P("x")))
    opts = dict(memory_tier=False, async_save=False, save_on_signals=None)
    with pitstop.CheckpointManager(tmp_path / "s", **opts) as mgr:
        mgr.save(1, {"w": sharded}).wait()
    manifest = (tmp_path / "s" / "step_0000000001" / "manifest.json").read_text()
    assert '"shards"' in manifest
    whole = host.copy()
    whole[9, 3] += 0.5
    with pitstop.CheckpointManager(tmp_path / "w", **opts) as mgr:
        mgr.save(1, {"w": whole}).wait()
    assert main(["diff", str(tmp_path / "s"), str(tmp_path / "w")]) == 1
    out = capsys.readouterr().out
    assert "differs: w (float32 [16, 8]): 1 of 128 elements" in out
    assert "max abs 0.5, max rel " + f"{0.5 / host[9, 3]:.6g}" in out


def test_orbax_steps_named_otherwise_say_what_the_command_can_do(tmp_path, capsys):
    """An Orbax manager with step_prefix="ckpt" (steps ckpt_0007 ...): `pitstop import`
    told the user to "pass its options as orbax_options=", which no option of the command
    takes; importing the step's own directory with --step works."""
    import os
    mgr = ocp.CheckpointManager(os.fspath(tmp_path / "orb"), options=ocp.CheckpointManagerOptions(
        step_prefix="ckpt", step_format_fixed_length=4))
    mgr.save(7, args=ocp.args.StandardSave({"w": np.ones(2)}))
    mgr.wait_until_finished()
    mgr.close()
    rc = main(["import", str(tmp_path / "orb"), str(tmp_path / "back")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "orbax_options" not in err, err
    assert f"ckpt_0007 {tmp_path / 'back'} --step N" in err, err
    rc = main(["import", str(tmp_path / "orb" / "ckpt_0007"), str(tmp_path / "back"),
               "--step", "7"])
    assert rc == 0, capsys.readouterr().err


def test_orbax_import_into_an_encrypted_directory(tmp_path, capsys, monkeypatch):
    """`pitstop import orbax_run runs/enc` into an encrypted run directory, its key set:
    "is encrypted; set PITSTOP_ENCRYPTION_KEY to its key" (the npz, torch and TF imports
    found the directory's key; the Orbax import wrote without one)."""
    import os

    import pitstop.cli.common as cli
    monkeypatch.setenv("PITSTOP_ENCRYPTION_KEY", "ab" * 32)
    monkeypatch.setattr(cli, "_KEY", [])
    with pitstop.CheckpointManager(tmp_path / "enc", memory_tier=False, async_save=False,
                                   save_on_signals=None, encryption=pitstop.Encryption()) as mgr:
        mgr.save(1, {"w": np.ones(2)}).wait()
    orb = ocp.CheckpointManager(os.fspath(tmp_path / "orb"))
    orb.save(4, args=ocp.args.StandardSave({"w": np.zeros(2)}))
    orb.wait_until_finished()
    orb.close()
    rc = main(["import", str(tmp_path / "orb"), str(tmp_path / "enc")])
    out, err = capsys.readouterr()
    assert (rc, err) == (0, ""), err
    assert b"encryption" in (tmp_path / "enc" / "step_0000000004" / "manifest.json").read_bytes()
