"""Damaged checkpoints: each kind of damage gives the right error, an explicit step raises,
``restore()`` of the latest warns naming the checkpoint and falls back to the newest valid
one, and nothing else is lost: the other checkpoints restore bit-exact and no byte is deleted.

A corrupt checkpoint found by a writer's ``restore()`` is moved aside to
``step_X.corrupt-<time>-<id>`` (kept whole, for inspection): that is deliberate. Left in place,
it would stay "the newest" forever — every restart would warn again, retention would protect it
as the newest instead of the real newest, and saving that step again would fail. Renamed, its
step number can be saved again and nothing is lost. A checkpoint written by a *newer* pitstop
is not corrupt and is never moved; read-only managers never move anything.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import warnings

import numpy as np
import pytest

import pitstop
from pitstop.core.format.seal import seal
from pitstop.core.manager import step_name

STEPS = (1, 2, 3)


def open_mgr(directory, **kw) -> pitstop.CheckpointManager:
    kw.setdefault("memory_tier", False)
    kw.setdefault("save_on_signals", None)
    return pitstop.CheckpointManager(directory, **kw)


def state_of(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {
        "model": {"w": rng.standard_normal((64, 64)).astype("f4"),
                  "b": rng.standard_normal(64)},
        "opt": [rng.integers(0, 1 << 40, 500), np.float32(step / 3)],
        "big": rng.integers(0, 255, 1 << 20, dtype=np.uint8),  # its own 4 KiB-aligned region
        "epoch": step, "history": [step, str(step)],
    }


def blank() -> dict:
    s = state_of(0)
    for a in (s["model"]["w"], s["model"]["b"], s["opt"][0], s["big"]):
        a[...] = 0
    s["opt"][1] = np.float32(-1)
    s["epoch"] = -1
    return s


def assert_state_is(target: dict, step: int) -> None:
    want = state_of(step)
    for get in (lambda s: s["model"]["w"], lambda s: s["model"]["b"], lambda s: s["opt"][0],
                lambda s: s["big"]):
        assert get(target).tobytes() == get(want).tobytes(), f"not step {step}"
    assert target["opt"][1] == want["opt"][1] and type(target["opt"][1]) is np.float32
    assert target["epoch"] == step and target["history"] == [step, str(step)]


@pytest.fixture(params=[{}, {"compression": "zstd+shuffle"}], ids=["raw", "zstd"])
def ckdir(request, tmp_path):
    d = tmp_path / "run"
    with open_mgr(d, **request.param) as mgr:
        for s in STEPS:
            mgr.save(s, state_of(s)).result(timeout=60)
    return d


def step_dir(d, step: int) -> str:
    return os.path.join(d, step_name(step))


def data_files(d, step: int) -> list[str]:
    return sorted(glob.glob(os.path.join(step_dir(d, step), "data-*.bin")))


def edit_manifest(d, step: int, fn, reseal: bool = True) -> None:
    """Edit a committed manifest. ``reseal`` recomputes its manifest_hash, as a deliberate
    forger would, so each structural check is tested on its own; without it the manifest
    hash is what must catch the change."""
    p = os.path.join(step_dir(d, step), "manifest.json")
    with open(p) as f:
        doc = json.load(f)
    old = doc.pop("manifest_hash", None)
    fn(doc)
    if reseal:
        body = seal(json.dumps(doc, separators=(",", ":")).encode(),
                    doc.get("hash_algorithm", "xxh3-128"))
    else:
        doc["manifest_hash"] = old  # stays the last member, as written
        body = json.dumps(doc, separators=(",", ":")).encode()
    with open(p, "wb") as f:
        f.write(body)


def test_an_edited_value_in_the_manifest_is_caught_by_its_own_hash(ckdir):
    # valid JSON, valid schema, only a saved value changed: the manifest's hash catches it
    edit_manifest(ckdir, 3, lambda doc: doc["values"].update(
        {k: 12345 for k in list(doc["values"])[:1]}), reseal=False)
    with open_mgr(ckdir) as mgr:
        with pytest.raises(pitstop.CorruptCheckpointError, match="manifest hash mismatch"):
            mgr.restore(blank(), step=3)
        t = blank()
        with pytest.warns(UserWarning, match=step_name(3)):
            assert mgr.restore(t) == 2
        assert_state_is(t, 2)


def file_tree(d) -> dict[str, bytes]:
    """Every regular file under d (relative path -> bytes), the quarantine suffix removed."""
    out = {}
    for root, _dirs, files in os.walk(d):
        for name in files:
            p = os.path.join(root, name)
            rel = os.path.relpath(p, d)
            if rel.startswith(".pitstop"):
                continue
            top, _, rest = rel.partition(os.sep)
            top = top.split(".corrupt-")[0]
            with open(p, "rb") as f:
                out[os.path.join(top, rest)] = f.read()
    return out


# --------------------------------------------------------------------------- kinds of damage
def flip_byte(d, step):
    # the last data file, near its end: arrays earlier in the file were already streamed into
    # the live state when the mismatch is found, so the fallback must overwrite them all
    p = data_files(d, step)[-1]
    with open(p, "r+b") as f:
        size = os.path.getsize(p)
        f.seek(size - 10)
        b = f.read(1)
        f.seek(size - 10)
        f.write(bytes([b[0] ^ 0x01]))


def truncate(d, step):
    p = data_files(d, step)[0]
    os.truncate(p, os.path.getsize(p) - 1)


def delete_data(d, step):
    os.remove(data_files(d, step)[0])


def garbage_manifest(d, step):
    with open(os.path.join(step_dir(d, step), "manifest.json"), "wb") as f:
        f.write(os.urandom(300))


def empty_manifest(d, step):
    open(os.path.join(step_dir(d, step), "manifest.json"), "wb").close()


def wrong_shape_manifest(d, step):
    def fn(doc):
        doc["arrays"] = [1, 2]
        doc["files"] = "nope"
    edit_manifest(d, step, fn)


def wrong_hash_in_manifest(d, step):
    def fn(doc):
        e = doc["arrays"]["model/w"]
        e["hash"] = ("0" if e["hash"][0] != "0" else "1") + e["hash"][1:]
    edit_manifest(d, step, fn)


def offset_past_end(d, step):
    def fn(doc):
        e = doc["arrays"]["model/b"]
        e["offset"] = doc["files"][e["file"]]["length"]
    edit_manifest(d, step, fn)


def object_dtype_in_manifest(d, step):
    def fn(doc):
        doc["arrays"]["model/b"]["dtype"] = [["a", "|O"]]
    edit_manifest(d, step, fn)


def dotdot_path(d, step):
    def fn(doc):
        name = sorted(doc["files"])[0]
        doc["files"]["../" + name] = doc["files"].pop(name)
        for e in doc["arrays"].values():
            if e["file"] == name:
                e["file"] = "../" + name
    edit_manifest(d, step, fn)


def absolute_path(d, step):
    target = data_files(d, step)[0]
    outside = os.path.join(os.path.dirname(d), "outside.bin")
    shutil.copy(target, outside)  # the right bytes, but outside the checkpoint

    def fn(doc):
        name = os.path.basename(target)
        doc["files"][outside] = doc["files"].pop(name)
        for e in doc["arrays"].values():
            if e["file"] == name:
                e["file"] = outside
    edit_manifest(d, step, fn)


def symlink_data_outside(d, step):
    p = data_files(d, step)[0]
    outside = os.path.join(os.path.dirname(d), "outside.bin")
    shutil.move(p, outside)  # the right bytes, but outside the checkpoint
    os.symlink(outside, p)


def symlink_manifest_outside(d, step):
    p = os.path.join(step_dir(d, step), "manifest.json")
    outside = os.path.join(os.path.dirname(d), "outside.json")
    shutil.move(p, outside)
    os.symlink(outside, p)


CORRUPT = [flip_byte, truncate, delete_data, garbage_manifest, empty_manifest,
           wrong_shape_manifest, wrong_hash_in_manifest, offset_past_end,
           object_dtype_in_manifest, dotdot_path, absolute_path, symlink_data_outside,
           symlink_manifest_outside]


@pytest.mark.parametrize("damage", CORRUPT, ids=lambda f: f.__name__)
def test_corrupt_latest_raises_explicitly_and_falls_back_loudly(ckdir, damage):
    damage(ckdir, 3)
    damaged = file_tree(ckdir)
    with open_mgr(ckdir) as mgr:
        # explicit step: raises, names the checkpoint
        with pytest.raises(pitstop.CorruptCheckpointError) as info:
            mgr.restore(blank(), step=3)
        assert step_name(3) in str(info.value)
        assert info.value.checkpoint and step_name(3) in info.value.checkpoint
        with pytest.raises(pitstop.CorruptCheckpointError):
            mgr.load(step=3)
        assert mgr.all_steps() == [1, 2, 3]  # explicit requests never move anything

        # latest: warns naming it, falls back to the newest valid one, bit-exact
        target = blank()
        with pytest.warns(UserWarning, match=step_name(3)):
            step = mgr.restore(target)
        assert step == 2
        assert_state_is(target, 2)

        # the corrupt one was moved aside whole; everything else is where it was
        assert mgr.all_steps() == [1, 2]
        moved = glob.glob(os.path.join(ckdir, step_name(3) + ".corrupt-*"))
        assert len(moved) == 1
        assert file_tree(ckdir) == damaged  # not a byte deleted or changed
        for s in (1, 2):
            t = blank()
            assert mgr.restore(t, step=s) == s
            assert_state_is(t, s)
        # no warning any more: the fallback is not repeated on every restart
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert mgr.restore(blank()) == 2

        # the step can be saved again, and the new one is the latest
        mgr.save(3, state_of(3)).result(timeout=60)
        t = blank()
        assert mgr.restore(t) == 3
        assert_state_is(t, 3)
    # a restart keeps the quarantined copy (it is no leftover)
    with open_mgr(ckdir, keep_last=1) as mgr:
        mgr.save(4, state_of(4)).result(timeout=60)
        assert mgr.all_steps() == [4]
    assert len(glob.glob(os.path.join(ckdir, step_name(3) + ".corrupt-*"))) == 1


@pytest.mark.parametrize("damage", [flip_byte, truncate, garbage_manifest, symlink_data_outside],
                         ids=lambda f: f.__name__)
def test_load_of_latest_skips_corrupt_with_a_warning(ckdir, damage):
    damage(ckdir, 3)
    with open_mgr(ckdir, read_only=True) as mgr:
        with pytest.warns(UserWarning, match=step_name(3)):
            loaded = mgr.load()
        assert loaded["epoch"] == 2
        assert loaded["big"].tobytes() == state_of(2)["big"].tobytes()


def test_read_only_manager_falls_back_without_moving_anything(ckdir):
    flip_byte(ckdir, 3)
    before = sorted(os.listdir(ckdir))
    with open_mgr(ckdir, read_only=True) as mgr:
        t = blank()
        with pytest.warns(UserWarning, match=step_name(3)):
            assert mgr.restore(t) == 2
        assert_state_is(t, 2)
    assert sorted(os.listdir(ckdir)) == before


def test_corrupt_older_checkpoint_does_not_affect_latest(ckdir):
    flip_byte(ckdir, 1)
    with open_mgr(ckdir) as mgr:
        t = blank()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert mgr.restore(t) == 3
        assert_state_is(t, 3)
        with pytest.raises(pitstop.CorruptCheckpointError, match="hash mismatch"):
            mgr.restore(blank(), step=1)
    assert mgr.all_steps() == [1, 2, 3]


def test_every_checkpoint_corrupt_raises_instead_of_starting_over_and_keeps_them_all(ckdir):
    for s in STEPS:
        truncate(ckdir, s)
    damaged = file_tree(ckdir)
    with open_mgr(ckdir) as mgr:
        t = blank()
        with pytest.warns(UserWarning) as rec:
            with pytest.raises(pitstop.CorruptCheckpointError, match="no valid checkpoint") as info:
                mgr.restore(t)
        named = " ".join(str(w.message) for w in rec)
        assert all(step_name(s) in named for s in STEPS)
        assert step_name(STEPS[-1]) in str(info.value)
        # a second restore() is the user's explicit choice to start from scratch
        assert mgr.restore(t) is None
        assert t["epoch"] == -1
    assert file_tree(ckdir) == damaged


def test_future_major_format_is_refused_clearly_and_never_moved(ckdir):
    edit_manifest(ckdir, 3, lambda doc: doc.update(format_version="5.0"))
    with open_mgr(ckdir) as mgr:
        with pytest.raises(pitstop.UnsupportedFormatError, match="5.0") as info:
            mgr.restore(blank(), step=3)
        assert "Upgrade pitstop" in str(info.value) and step_name(3) in str(info.value)
        with pytest.raises(pitstop.UnsupportedFormatError):
            mgr.load(step=3)
        with pytest.raises(pitstop.UnsupportedFormatError):
            mgr.metadata(3)
        t = blank()
        with pytest.warns(UserWarning, match=step_name(3)):
            assert mgr.restore(t) == 2
        assert_state_is(t, 2)
        with pytest.warns(UserWarning, match=step_name(3)):
            assert mgr.load()["epoch"] == 2
        # not corrupt: a newer pitstop wrote it. It stays where it is, untouched
        assert mgr.all_steps() == [1, 2, 3]
        assert not glob.glob(os.path.join(ckdir, "*.corrupt-*"))


def test_future_format_alone_raises_instead_of_starting_from_scratch(tmp_path):
    d = tmp_path / "run"
    with open_mgr(d) as mgr:
        mgr.save(7, state_of(7)).result(timeout=60)
    edit_manifest(d, 7, lambda doc: doc.update(format_version="5.1"))
    with open_mgr(d) as mgr:
        with pytest.warns(UserWarning):
            with pytest.raises(pitstop.UnsupportedFormatError):
                mgr.restore(blank())
        # and retention never deletes what it cannot read
        mgr2_steps = mgr.all_steps()
    assert mgr2_steps == [7]
    with open_mgr(d, keep_last=1) as mgr:
        mgr.save(8, state_of(8)).result(timeout=60)
        mgr.save(9, state_of(9)).result(timeout=60)
        assert mgr.all_steps() == [7, 9]


def test_checkpoint_without_manifest_does_not_exist(ckdir):
    # an interrupted commit never publishes a manifest: such a directory is not a checkpoint
    os.remove(os.path.join(step_dir(ckdir, 3), "manifest.json"))
    with open_mgr(ckdir) as mgr:
        assert mgr.all_steps() == [1, 2]
        t = blank()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert mgr.restore(t) == 2
        assert_state_is(t, 2)
    assert os.path.isdir(step_dir(ckdir, 3))  # and it is not deleted either
