"""The `pitstop` command on directories whose checkpoints are named ``ckpt-<N>``
(tf.train.CheckpointManager) or ``<N>`` (Orbax): it reads the naming the directory recorded,
and gc still removes only what that naming proves pitstop wrote."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import pitstop
from pitstop.cli import main
from pitstop.core.directory.names import DEFAULT, Naming, tmp_name

TF = Naming("ckpt-", 0)
ORBAX = Naming("", 0)


@pytest.fixture(params=[TF, ORBAX], ids=["ckpt-N", "N"])
def run_dir(request, tmp_path) -> tuple[Path, Naming]:
    """Checkpoints of steps 8, 9 and 10 under the naming (10 sorts first as text)."""
    naming: Naming = request.param
    d = tmp_path / "run"
    with pitstop.CheckpointManager(d, memory_tier=False, save_on_signals=None,
                                   step_prefix=naming.prefix,
                                   step_digits=naming.digits) as mgr:
        for step in (8, 9, 10):
            mgr.save(step, {"w": np.arange(16.0) * step}, metrics={"loss": 1.0 / step}).wait()
    return d, naming


def run(capsys, *argv: object) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def flip_byte(ck: Path) -> None:
    entry = json.loads((ck / "manifest.json").read_text())["arrays"]["w"]
    path = ck / entry["file"]
    data = bytearray(path.read_bytes())
    data[entry["offset"] + 3] ^= 0x01
    path.write_bytes(bytes(data))


def test_ls_lists_the_checkpoints_of_the_directorys_naming(run_dir, capsys):
    d, naming = run_dir
    shutil.copytree(d / naming.name(9), d / (naming.prefix + "09"))  # not canonical
    shutil.copytree(d / naming.name(8), d / f"{naming.name(8)}.corrupt-1700000000-ab12")
    rc, out, err = run(capsys, "ls", d)
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert "3 checkpoints" in lines[0]
    rows = [ln.lstrip("* ").split()[0] for ln in lines[3:7]]
    assert rows == ["8", "8", "9", "10"] and lines[6].startswith("*")
    assert f"corrupt: moved aside ({naming.name(8)}.corrupt-" in lines[4]
    assert "corrupt: moved aside after failing verification" in out
    assert f"not pitstop's: {naming.prefix}09" in out
    assert f"names a checkpoint {naming.prefix}<step>" in out


def test_inspect_and_verify_read_the_directorys_naming(run_dir, capsys):
    d, naming = run_dir
    rc, out, _ = run(capsys, "inspect", d)
    assert rc == 0 and out.startswith(f"step 10: {d / naming.name(10)}")
    rc, out, _ = run(capsys, "inspect", d, "--step", 8)
    assert rc == 0 and out.startswith(f"step 8: {d / naming.name(8)}")
    rc, out, _ = run(capsys, "verify", d, "--all")
    assert rc == 0 and [ln.split(":")[0] for ln in out.splitlines()] == \
        ["step 8", "step 9", "step 10"]
    flip_byte(d / naming.name(9))
    rc, out, err = run(capsys, "verify", d, "--all")
    assert rc == 1 and "step 9: CORRUPT" in out and naming.name(9) in out
    assert "step 10: ok" in out and "step 8: ok" in out
    rc, _, err = run(capsys, "verify", d, "--step", 7)
    assert rc == 2 and "no checkpoint of step 7" in err


def test_a_checkpoint_under_another_steps_name_fails_verify(run_dir, capsys):
    d, naming = run_dir
    os.rename(d / naming.name(8), d / "x")
    os.rename(d / naming.name(9), d / naming.name(8))
    os.rename(d / "x", d / naming.name(9))
    rc, out, _ = run(capsys, "verify", d, "--step", 9)
    assert rc == 1 and "named for step 9" in out


def test_gc_removes_only_what_the_naming_proves_pitstop_wrote(run_dir, capsys):
    d, naming = run_dir
    ours = [tmp_name(naming.name(11), "1a2b3c4d"),
            tmp_name(naming.name(7), "2a2b3c4d", deleting=True)]
    theirs = [tmp_name(DEFAULT.name(11), "3a2b3c4d"),  # the default naming's, not this one's
              tmp_name(naming.prefix + "011", "4a2b3c4d"),  # no canonical name inside
              f"{naming.name(9)}.abandoned-1700000001-cd34", naming.prefix + "09", "notes"]
    for e in ours + theirs:
        (d / e).mkdir()
    before = sorted(os.listdir(d))
    rc, out, _ = run(capsys, "gc", d, "--dry-run", "--memory-tier", d / ".pitstop")
    assert rc == 0 and sorted(os.listdir(d)) == before
    listed = [ln.split()[-1] for ln in out.splitlines()
              if ln.startswith("would remove ") and "leftover(s)" not in ln]
    assert sorted(listed) == sorted(ours)
    rc, out, _ = run(capsys, "gc", d, "--memory-tier", d / ".pitstop")
    assert rc == 0 and "removed 2 leftover(s)" in out and "(3 in " in out
    assert sorted(os.listdir(d)) == sorted(
        [".pitstop", *(naming.name(s) for s in (8, 9, 10)), *theirs])


def test_an_invalid_recorded_naming_is_a_clear_error(run_dir, capsys):
    d, _ = run_dir
    path = d / ".pitstop" / "directory.json"
    doc = json.loads(path.read_text())
    doc["naming"] = {"step_prefix": "a/b", "step_digits": 0}
    path.write_text(json.dumps(doc))
    for cmd in (("ls",), ("inspect",), ("verify", "--all"), ("gc", "--dry-run")):
        rc, out, err = run(capsys, cmd[0], d, *cmd[1:])
        assert rc == 2 and out == "", cmd
        assert err.startswith(f"pitstop: {path}: records no valid checkpoint naming"), err
        assert len(err.splitlines()) == 1


def test_one_checkpoint_given_as_dir_is_recognised_by_its_directorys_naming(run_dir, capsys):
    d, naming = run_dir
    rc, out, err = run(capsys, "verify", d / naming.name(9))
    assert rc == 0 and "step 9: ok" in out, err
    rc, out, err = run(capsys, "inspect", d / naming.name(9))
    assert rc == 0 and out.startswith("step 9:"), err
    rc, _, err = run(capsys, "inspect", d / naming.name(9), "--step", "7")
    assert rc == 2 and f"pitstop inspect {d} --step 7" in err, err
    rc, _, err = run(capsys, "verify", d / naming.name(9), "--all")
    assert rc == 2 and f"pitstop verify {d} --all" in err, err


