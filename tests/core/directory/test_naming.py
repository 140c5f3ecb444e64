"""Checkpoint names are a property of the run directory: ``step_<10 digits>`` by default,
``ckpt-<N>`` as tf.train.CheckpointManager names them, ``<N>`` as Orbax does. Everything that
names, lists, moves aside, cleans up, recovers, retains or reads checkpoints follows the
naming the directory recorded when it was created."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pitstop
from pitstop.core.directory.names import DEFAULT, Naming, aside_name, tmp_name

PY = sys.executable
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SHM = "/dev/shm"
TF = Naming("ckpt-", 0)  # tf.train.CheckpointManager: <directory>/ckpt-<N>
ORBAX = Naming("", 0)  # Orbax: <directory>/<N>
NAMINGS = [pytest.param(TF, id="ckpt-N"), pytest.param(ORBAX, id="N")]


def state_of(step: int) -> dict:
    return {"w": np.arange(64, dtype=np.float32) * step, "meta": {"epoch": step}}


def blank() -> dict:
    return {"w": np.zeros(64, np.float32), "meta": {"epoch": -1}}


def open_mgr(directory, naming: Naming | None = None, **kw) -> pitstop.CheckpointManager:
    kw.setdefault("save_on_signals", None)
    kw.setdefault("memory_tier", False)
    if naming is not None:
        kw.update(step_prefix=naming.prefix, step_digits=naming.digits)
    return pitstop.CheckpointManager(directory, **kw)


def entries(d) -> list[str]:
    return sorted(e for e in os.listdir(d) if e != ".pitstop")


def recorded(d) -> dict:
    return json.loads((d / ".pitstop" / "directory.json").read_text())


# ------------------------------------------------------------------ the names themselves
@pytest.mark.parametrize("naming, step, name", [
    (DEFAULT, 3, "step_0000000003"),
    (DEFAULT, 12_345_678_901, "step_12345678901"),
    (TF, 3, "ckpt-3"),
    (TF, 0, "ckpt-0"),
    (ORBAX, 3, "3"),
    (ORBAX, 120, "120"),
    (Naming("run.", 4), 7, "run.0007"),
    (Naming("run.", 4), 12345, "run.12345"),
])
def test_names_and_their_canonical_spelling(naming, step, name):
    assert naming.name(step) == name
    assert naming.parse(name) == step
    padded = naming.prefix + "0" + name[len(naming.prefix):]  # one leading zero too many
    for other in (padded, name + "x", name + ".bak", " " + name, "." + name):
        assert naming.parse(other) is None, other
    moved = naming.aside(step, "corrupt", 1_700_000_000, "ab12")
    assert moved == aside_name(name, "corrupt", 1_700_000_000, "ab12")
    assert naming.parse_aside(moved) == (step, "corrupt")
    assert naming.parse(moved) is None
    for deleting in (False, True):
        tmp = tmp_name(name, "1a2b3c4d", deleting=deleting)
        assert naming.parse_tmp(tmp) == step and naming.parse(tmp) is None
        assert naming.parse_aside(tmp) is None
    assert naming.parse_aside(name) is None and naming.parse_tmp(name) is None


def test_no_extra_leading_zeros_and_no_other_digits():
    assert ORBAX.parse("03") is None and ORBAX.parse("0") == 0 and ORBAX.parse("") is None
    assert TF.parse("ckpt-03") is None and TF.parse("ckpt-") is None
    assert TF.parse("ckpt-\u0663") is None  # an Arabic-Indic three is no step
    assert DEFAULT.parse("step_5") is None and DEFAULT.parse("step_00000000005") is None
    assert TF.parse("step_0000000003") is None and DEFAULT.parse("ckpt-3") is None


# ------------------------------------------------------------------ save, restore, reopen
@pytest.mark.parametrize("naming, name", [(TF, "ckpt-3"), (ORBAX, "3"),
                                          (Naming("ckpt_", 4), "ckpt_0003")])
def test_save_and_restore_under_a_naming(tmp_path, naming, name):
    d = tmp_path / "run"
    with open_mgr(d, naming) as mgr:
        assert mgr.naming == naming
        mgr.save(3, state_of(3)).wait()
    assert entries(d) == [name]
    assert recorded(d)["naming"] == {"step_prefix": naming.prefix, "step_digits": naming.digits}
    with open_mgr(d) as mgr:  # None/None: the directory's naming
        assert mgr.naming == naming and mgr.all_steps() == [3]
        target = blank()
        assert mgr.restore(target) == 3
        np.testing.assert_array_equal(target["w"], state_of(3)["w"])
        assert mgr.metadata(3).step == 3 and mgr.load(3)["meta"] == {"epoch": 3}
        mgr.save(4, state_of(4)).wait()
    assert entries(d) == sorted([name, naming.name(4)])
    with open_mgr(d, read_only=True) as ro:
        assert ro.naming == naming and ro.latest_step() == 4
        assert ro.load()["meta"] == {"epoch": 4}


def test_the_default_naming_is_recorded_and_unchanged(tmp_path):
    d = tmp_path / "run"
    with open_mgr(d) as mgr:
        assert mgr.naming == DEFAULT
        mgr.save(3, state_of(3)).wait()
    assert entries(d) == ["step_0000000003"]
    assert recorded(d)["naming"] == {"step_prefix": "step_", "step_digits": 10}


def test_a_directory_of_older_pitstop_is_step_and_10_digits(tmp_path):
    d = tmp_path / "run"
    with open_mgr(d) as mgr:
        mgr.save(3, state_of(3)).wait()
    doc = recorded(d)
    del doc["naming"]  # as written before namings were recorded
    (d / ".pitstop" / "directory.json").write_text(json.dumps(doc))
    with open_mgr(d) as mgr:
        assert mgr.naming == DEFAULT and mgr.all_steps() == [3]
        mgr.save(4, state_of(4)).wait()
    assert entries(d) == ["step_0000000003", "step_0000000004"]
    with pytest.raises(pitstop.InvalidArgumentError, match="step_prefix='ckpt-'"):
        open_mgr(d, TF)


def test_reopening_adopts_the_recorded_naming_part_by_part(tmp_path):
    d = tmp_path / "run"
    with open_mgr(d, TF) as mgr:
        mgr.save(1, state_of(1)).wait()
    with open_mgr(d, step_prefix="ckpt-") as mgr:  # step_digits left out: the recorded 0
        assert mgr.naming == TF
        mgr.save(2, state_of(2)).wait()
    with open_mgr(d, step_digits=0) as mgr:
        assert mgr.naming == TF
        mgr.save(10, state_of(10)).wait()
    assert entries(d) == ["ckpt-1", "ckpt-10", "ckpt-2"]


@pytest.mark.parametrize("read_only", [False, True])
@pytest.mark.parametrize("asked", [
    {"step_prefix": "step_", "step_digits": 10},
    {"step_prefix": "step_"},
    {"step_digits": 3},
    {"step_prefix": ""},
])
def test_reopening_with_a_conflicting_naming_is_refused(tmp_path, asked, read_only):
    d = tmp_path / "run"
    with open_mgr(d, TF) as mgr:
        mgr.save(1, state_of(1)).wait()
    before = (d / ".pitstop" / "directory.json").read_bytes()
    with pytest.raises(pitstop.InvalidArgumentError) as info:
        open_mgr(d, read_only=read_only, **asked)
    text = str(info.value)
    assert str(d) in text  # the directory
    assert "ckpt-<step>" in text and "step_prefix='ckpt-', step_digits=0" in text  # recorded
    want = Naming(asked.get("step_prefix", "ckpt-"), asked.get("step_digits", 0))
    assert want.describe() in text  # ... and what was asked for
    assert "leave step_prefix and step_digits out" in text  # what to do
    assert (d / ".pitstop" / "directory.json").read_bytes() == before
    assert entries(d) == ["ckpt-1"]
    with open_mgr(d) as mgr:  # the refused writer left no lock behind
        assert mgr.all_steps() == [1]


def test_a_reader_of_a_directory_without_an_identity_uses_the_naming_it_is_given(tmp_path):
    d = tmp_path / "run"
    with open_mgr(d, TF) as mgr:
        for s in (1, 2):
            mgr.save(s, state_of(s)).wait()
    shutil.rmtree(d / ".pitstop")  # checkpoints copied without their directory's records
    with open_mgr(d, read_only=True) as ro:
        assert ro.naming == DEFAULT and ro.all_steps() == []
    with open_mgr(d, TF, read_only=True) as ro:
        assert ro.all_steps() == [1, 2] and ro.load()["meta"] == {"epoch": 2}


@pytest.mark.parametrize("kw, argument", [
    ({"step_prefix": "a/b"}, "step_prefix"),
    ({"step_prefix": "nul\0"}, "step_prefix"),
    ({"step_prefix": ".hidden-"}, "step_prefix"),
    ({"step_prefix": "ckpt1"}, "step_prefix"),
    ({"step_prefix": "v2"}, "step_prefix"),
    ({"step_prefix": "x" * 200}, "step_prefix"),
    ({"step_prefix": b"ckpt-"}, "step_prefix"),
    ({"step_prefix": 5}, "step_prefix"),
    ({"step_digits": -1}, "step_digits"),
    ({"step_digits": 21}, "step_digits"),
    ({"step_digits": 2.0}, "step_digits"),
    ({"step_digits": True}, "step_digits"),
    ({"step_digits": "3"}, "step_digits"),
])
def test_invalid_namings_are_refused_before_anything_is_written(tmp_path, kw, argument):
    d = tmp_path / "run"
    with pytest.raises(pitstop.InvalidArgumentError, match=argument):
        open_mgr(d, **kw)
    assert not d.exists()


def test_an_invalid_recorded_naming_is_refused_by_a_writer(tmp_path):
    d = tmp_path / "run"
    with open_mgr(d, TF) as mgr:
        mgr.save(1, state_of(1)).wait()
    doc = recorded(d)
    doc["naming"] = {"step_prefix": "ckpt1", "step_digits": 0}
    (d / ".pitstop" / "directory.json").write_text(json.dumps(doc))
    with pytest.raises(pitstop.CheckpointError, match="directory.json records no valid"):
        open_mgr(d)


# ------------------------------------------------------------------ retention, aside, cleanup
@pytest.mark.parametrize("naming", NAMINGS)
def test_keep_last_deletes_by_step_under_a_naming(tmp_path, naming):
    d = tmp_path / "run"
    d.mkdir()
    foreign = [naming.prefix + "09", "notes.txt"]  # ckpt-09 / 09: not a canonical name
    with open_mgr(d, naming, keep_last=2) as mgr:
        for s in (8, 9):
            mgr.save(s, state_of(s)).wait()
        shutil.copytree(d / naming.name(9), d / foreign[0])  # a look-alike copy
        (d / foreign[1]).write_text("mine")
        for s in (10, 11):  # 10 sorts before 8 and 9 as text: retention goes by number
            mgr.save(s, state_of(s)).wait()
        assert mgr.all_steps() == [10, 11]
    assert entries(d) == sorted([naming.name(10), naming.name(11), *foreign])


@pytest.mark.parametrize("naming", NAMINGS)
def test_rollback_moves_the_abandoned_steps_aside_under_a_naming(tmp_path, naming):
    d = tmp_path / "run"
    with open_mgr(d, naming) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, state_of(s)).wait()
    with open_mgr(d) as mgr:
        assert mgr.restore(blank(), step=1) == 1
        with pytest.warns(UserWarning, match="abandoned"):
            mgr.save(2, state_of(200)).wait()
        assert mgr.all_steps() == [1, 2]
    moved = sorted(naming.parse_aside(e) for e in entries(d) if naming.parse_aside(e))
    assert moved == [(2, "abandoned"), (3, "abandoned")]
    with open_mgr(d) as mgr:
        target = blank()
        assert mgr.restore(target) == 2
        np.testing.assert_array_equal(target["w"], state_of(200)["w"])


@pytest.mark.parametrize("naming", NAMINGS)
def test_a_corrupt_checkpoint_is_moved_aside_under_a_naming(tmp_path, naming):
    d = tmp_path / "run"
    with open_mgr(d, naming) as mgr:
        for s in (1, 2):
            mgr.save(s, state_of(s)).wait()
    ck = d / naming.name(2)
    entry = json.loads((ck / "manifest.json").read_text())["arrays"]["w"]
    data = bytearray((ck / entry["file"]).read_bytes())
    data[entry["offset"] + 5] ^= 0xFF
    (ck / entry["file"]).write_bytes(bytes(data))
    with open_mgr(d) as mgr:
        target = blank()
        with pytest.warns(UserWarning, match=naming.name(2)):
            assert mgr.restore(target) == 1
        np.testing.assert_array_equal(target["w"], state_of(1)["w"])
        assert mgr.all_steps() == [1]
    assert [naming.parse_aside(e) for e in entries(d) if naming.parse_aside(e)] == \
        [(2, "corrupt")]


def test_a_checkpoint_under_another_steps_name_is_refused_under_a_naming(tmp_path):
    d = tmp_path / "run"
    with open_mgr(d, TF) as mgr:
        for s in (1, 2):
            mgr.save(s, state_of(s)).wait()
    os.rename(d / "ckpt-2", d / "tmp")
    os.rename(d / "ckpt-1", d / "ckpt-2")
    os.rename(d / "tmp", d / "ckpt-1")
    with open_mgr(d) as mgr:
        with pytest.raises(pitstop.CorruptCheckpointError, match="named for step 2"):
            mgr.restore(blank(), step=2)


@pytest.mark.parametrize("naming", NAMINGS)
def test_leftovers_of_interrupted_saves_are_cleaned_by_the_naming(tmp_path, naming, caplog):
    d = tmp_path / "run"
    with open_mgr(d, naming) as mgr:
        mgr.save(1, state_of(1)).wait()
    ours = [tmp_name(naming.name(5), "1a2b3c4d"),
            tmp_name(naming.name(1), "2a2b3c4d", deleting=True)]
    theirs = [tmp_name(DEFAULT.name(5), "3a2b3c4d"),  # another naming's: not provably ours
              tmp_name(naming.prefix + "05", "4a2b3c4d")]  # not a canonical name
    for e in ours + theirs:
        (d / e).mkdir()
        (d / e / "data-000.bin").write_bytes(b"x")
    caplog.set_level(logging.WARNING, logger="pitstop")
    with open_mgr(d) as mgr:
        assert mgr.all_steps() == [1]
    assert entries(d) == sorted([naming.name(1), *theirs])
    assert all(e in caplog.text for e in ours)


# ------------------------------------------------------------------ memory tier
_CHILD = textwrap.dedent("""
    import sys, time
    import numpy as np
    import pitstop
    d, prefix, digits = sys.argv[1], sys.argv[2], int(sys.argv[3])
    def state_of(step):
        return {"w": np.arange(64, dtype=np.float32) * step, "meta": {"epoch": step}}
    mgr = pitstop.CheckpointManager(d, save_on_signals=None, memory_tier=True,
                                    step_prefix=prefix, step_digits=digits)
    def hold(step):
        if step == 2:
            print("HOLD", mgr.directory_id, flush=True)
            time.sleep(600)
    mgr.hooks["before_write"] = hold
    mgr.save(1, state_of(1)).wait()
    st = state_of(2)
    mgr.save(2, st)          # returned: the snapshot is taken, the persist is held
    st["w"][:] = -1
    time.sleep(600)
""")


@pytest.mark.skipif(not os.access(SHM, os.W_OK), reason="no writable /dev/shm")
@pytest.mark.parametrize("naming", NAMINGS)
def test_memory_tier_recovers_a_killed_save_under_a_naming(tmp_path, naming):
    d = tmp_path / "run"
    p = subprocess.Popen([PY, "-c", _CHILD, str(d), naming.prefix, str(naming.digits)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    ident = None
    try:
        line = p.stdout.readline()
        assert line.startswith("HOLD"), p.stderr.read()
        ident = line.split()[1]
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    try:
        assert p.returncode == -signal.SIGKILL
        assert entries(d) == [naming.name(1)]  # step 2 never reached the disk
        with open_mgr(d, memory_tier=True) as mgr:
            assert mgr.naming == naming
            target = blank()
            assert mgr.restore(target) == 2  # from memory, as save() returned it
            np.testing.assert_array_equal(target["w"], state_of(2)["w"])
            mgr.wait()
            assert mgr.all_steps() == [1, 2]
        assert entries(d) == sorted([naming.name(1), naming.name(2)])
        with open_mgr(d, read_only=True) as ro:
            assert ro.load(2)["meta"] == {"epoch": 2}
    finally:
        if ident is not None:
            for f in os.listdir(SHM):
                if f.startswith(f"pitstop-{ident}-"):
                    os.unlink(os.path.join(SHM, f))
