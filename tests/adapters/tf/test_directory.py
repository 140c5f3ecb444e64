"""The directory a tf.train user already has, with one import changed: tf.train's own
checkpoints in it, several checkpoint names in it, a corrupt newest checkpoint, a missing
one, ``CheckpointOptions``, and a pitstop ``Checkpoint`` handed to tf.train's manager. Each
scenario runs through tf.train and through pitstop, and the results are compared."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import make_model, rel, same, settle, train_step, values  # noqa: E402

import pitstop  # noqa: E402
import pitstop.adapters.tf._options  # noqa: E402
from pitstop.adapters.tf import Checkpoint, CheckpointManager, latest_checkpoint  # noqa: E402

PEERS = {"tf": (tf.train.Checkpoint, tf.train.CheckpointManager),
         "pitstop": (Checkpoint, CheckpointManager)}


def objects(seed=0):
    model = make_model(seed, dropout=False)
    opt = keras.optimizers.Adam(1e-2)
    opt.build(model.trainable_variables)
    return model, opt, tf.Variable(0, dtype=tf.int64)


def state_of(model, opt, step, ck):
    return values(model.variables) + values(opt.variables) + [step.numpy(),
                                                             ck.save_counter.numpy()]


def native_run(directory, steps):
    """A tf.train job: ``steps`` steps, a save after each (max_to_keep=3)."""
    model, opt, step = objects()
    ck = tf.train.Checkpoint(model=model, optimizer=opt, step=step)
    mgr = tf.train.CheckpointManager(ck, directory, max_to_keep=3)
    for _ in range(steps):
        train_step(model, opt)
        step.assign_add(1)
        mgr.save()
    return model, opt, step, ck, mgr


def test_changing_the_import_resumes_from_tf_train_checkpoints(tmp_path, monkeypatch):
    """A tf.train job for 4 steps, then the same directory with pitstop's classes for 3
    more, against 7 uninterrupted tf.train steps: same weights, optimizer, step and
    save_counter; numbering, ``checkpoints``, retention over the native and pitstop
    checkpoints, ``latest_checkpoint`` (pitstop's and tf.train's) as tf.train's. Relative
    paths, as a job started in its run folder gives them."""
    monkeypatch.chdir(tmp_path)
    ref_dir, d = "ref", "run"
    ref = native_run(ref_dir, 4)
    ref_mgr = ref[4]
    for _ in range(3):
        train_step(ref[0], ref[1])
        ref[2].assign_add(1)
        ref_mgr.save()

    native_run(d, 4)  # the job that was stopped; its objects are gone
    model, opt, step = objects(seed=5)
    ck = Checkpoint(model=model, optimizer=opt, step=step)
    mgr = CheckpointManager(ck, d, max_to_keep=3)
    assert rel(mgr.latest_checkpoint, d) == "ckpt-4"
    assert [rel(c, d) for c in mgr.checkpoints] == ["ckpt-2", "ckpt-3", "ckpt-4"]
    assert rel(mgr.restore_or_initialize(), d) == "ckpt-4"
    assert int(step.numpy()) == 4 and int(ck.save_counter.numpy()) == 4
    paths = []
    for _ in range(3):
        train_step(model, opt)
        step.assign_add(1)
        paths.append(rel(mgr.save(), d))
    mgr.sync()
    assert paths == ["ckpt-5", "ckpt-6", "ckpt-7"]
    assert same(state_of(model, opt, step, ck), state_of(*ref[:4]))
    assert [rel(c, d) for c in mgr.checkpoints] == \
        [rel(c, ref_dir) for c in ref_mgr.checkpoints] == ["ckpt-5", "ckpt-6", "ckpt-7"]
    # the native checkpoints the sweep dropped are deleted, as tf.train deletes them
    assert not [e for e in os.listdir(d) if e.endswith(".index") or ".data-" in e]
    for reader in (latest_checkpoint, tf.train.latest_checkpoint):
        assert rel(reader(d), d) == rel(reader(ref_dir), ref_dir) == "ckpt-7"
    # a path save() returned restores, and a restart resumes from it
    model2, opt2, step2 = objects(seed=9)
    ck2 = Checkpoint(model=model2, optimizer=opt2, step=step2)
    ck2.restore(os.path.join(d, paths[-1])).assert_existing_objects_matched()
    mgr.close()
    again = CheckpointManager(ck2, d, max_to_keep=3)
    assert [rel(c, d) for c in again.checkpoints] == ["ckpt-5", "ckpt-6", "ckpt-7"]
    assert rel(again.restore_or_initialize(), d) == "ckpt-7"
    assert same(state_of(model2, opt2, step2, ck2), state_of(*ref[:4]))
    again.close()


@pytest.mark.parametrize("kind", ["tf", "pitstop"])
def test_a_save_at_a_native_checkpoints_path_replaces_it(kind, tmp_path):
    """A manager that did not restore numbers its first save 1, the path of a tf.train
    checkpoint there: the new one replaces it, as tf.train overwrites it."""
    d = str(tmp_path)
    v = tf.Variable(1.0)
    native = tf.train.CheckpointManager(tf.train.Checkpoint(v=v), d, max_to_keep=None)
    native.save()
    native.save()
    Ckpt, Manager = PEERS[kind]
    w = tf.Variable(7.0)
    ck = Ckpt(v=w)
    mgr = Manager(ck, d, max_to_keep=None)
    path = mgr.save()
    settle(mgr)
    assert rel(path, d) == "ckpt-1"
    w.assign(0.0)
    ck.restore(path).assert_consumed()
    assert float(w.numpy()) == 7.0
    assert os.path.exists(path + ".index") == (kind == "tf")
    if isinstance(mgr, CheckpointManager):
        mgr.close()


def names_scenario(kind, d):
    """``model-N`` and ``best-N`` managers on one Checkpoint, a second Checkpoint saving
    ``extra-N`` by ``save()``, in one directory and one process."""
    Ckpt, Manager = PEERS[kind]
    v, u = tf.Variable(0.0), tf.Variable(0.0)
    ck, other = Ckpt(v=v), Ckpt(u=u)
    model = Manager(ck, d, max_to_keep=2, checkpoint_name="model")
    best = Manager(ck, d, max_to_keep=1, checkpoint_name="best")
    log = []
    for i in range(1, 5):
        v.assign(float(i))
        log.append(rel(model.save(), d))
        if i % 2 == 0:
            log.append(rel(best.save(), d))
        u.assign(float(-i))
        log.append(rel(other.save(os.path.join(d, "extra")), d))
    for m in (model, best):
        settle(m)
    if isinstance(other, Checkpoint):
        other.sync()
    log += [[rel(c, d) for c in model.checkpoints], rel(model.latest_checkpoint, d),
            [rel(c, d) for c in best.checkpoints], rel(best.latest_checkpoint, d)]
    for path in [model.latest_checkpoint, *model.checkpoints, best.latest_checkpoint]:
        v.assign(-1.0)
        ck.restore(path).assert_consumed()
        log.append(float(v.numpy()))
    other.restore(os.path.join(d, "extra-4")).assert_consumed()
    log.append(float(u.numpy()))
    for m in (model, best):
        if isinstance(m, CheckpointManager):
            m.close()
    return log


def test_several_checkpoint_names_in_one_directory(tmp_path):
    ours = names_scenario("pitstop", str(tmp_path / "pitstop"))
    theirs = names_scenario("tf", str(tmp_path / "tf"))
    assert ours == theirs
    # (the managers share the Checkpoint's save_counter, as in tf.train)
    assert ours[-9:] == [["model-4", "model-5"], "model-5", ["best-6"], "best-6",
                         4.0, 3.0, 4.0, 4.0, -4.0]
    # a restarted manager of each name finds its own newest (tf.train's reads the one
    # shared `checkpoint` file, which names extra-4, the last save of any name)
    d = str(tmp_path / "pitstop")
    for name, latest in (("model", "model-5"), ("best", "best-6")):
        mgr = CheckpointManager(Checkpoint(v=tf.Variable(0.0)), d, max_to_keep=2,
                                checkpoint_name=name)
        assert rel(mgr.latest_checkpoint, d) == latest
        mgr.close()


def test_tf_train_manager_of_a_pitstop_checkpoint_says_to_switch(tmp_path):
    mgr = tf.train.CheckpointManager(Checkpoint(v=tf.Variable(1.0)), str(tmp_path), 2)
    with pytest.raises(pitstop.InvalidArgumentError,
                       match=r"change tf\.train\.CheckpointManager to it too") as e:
        mgr.save()
    assert "\n" not in str(e.value)


def flip_a_byte(checkpoint: Path) -> Path:
    """Flip a byte in the middle of the largest tensor of a pitstop checkpoint."""
    arrays = json.loads((checkpoint / "manifest.json").read_text())["arrays"]
    entry = max(arrays.values(), key=lambda a: a["length"])
    path = checkpoint / entry["file"]
    data = bytearray(path.read_bytes())
    data[entry["offset"] + entry["length"] // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return path


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    """restore_or_initialize() falls back, with a warning naming the checkpoint and what
    was wrong; restore() of the corrupt path itself raises, as pitstop's manager does for
    an explicit step. A corrupt native newest one is passed over the same way."""
    d = str(tmp_path / "run")
    v = tf.Variable(tf.zeros(256))
    # (no memory tier: the restart would read its verified copy, not the flipped disk)
    mgr = CheckpointManager(Checkpoint(v=v), d, max_to_keep=3, memory_tier=False)
    for i in (1, 2, 3):
        v.assign(tf.fill([256], float(i)))
        mgr.save()
    mgr.close()
    flip_a_byte(Path(d) / "ckpt-3")
    w = tf.Variable(tf.zeros(256))
    with pytest.raises(pitstop.CorruptCheckpointError):
        Checkpoint(v=w).restore(os.path.join(d, "ckpt-3"))
    ck = Checkpoint(v=w)
    again = CheckpointManager(ck, d, max_to_keep=3)
    with pytest.warns(UserWarning, match=r"ckpt-3 is corrupt .*falling back"):
        assert rel(again.restore_or_initialize(), d) == "ckpt-2"
    assert float(w.numpy()[0]) == 2.0 and rel(again.latest_checkpoint, d) == "ckpt-2"
    assert rel(again.save(), d) == "ckpt-3"  # the corrupt one was moved aside
    again.close()
    assert any(".corrupt-" in e for e in os.listdir(d))

    nd = str(tmp_path / "native")
    native = tf.train.CheckpointManager(tf.train.Checkpoint(v=v), nd, max_to_keep=3)
    for i in (1, 2):
        v.assign(tf.fill([256], float(i)))
        native.save()
    data = next(p for p in Path(nd).iterdir() if p.name.startswith("ckpt-2.data-"))
    data.write_bytes(data.read_bytes()[:100])
    w.assign(tf.zeros(256))
    mgr = CheckpointManager(Checkpoint(v=w), nd, max_to_keep=3)
    with pytest.warns(UserWarning, match=r"ckpt-2 is corrupt .*falling back"):
        assert rel(mgr.restore_or_initialize(), nd) == "ckpt-1"
    assert float(w.numpy()[0]) == 1.0
    mgr.close()


@pytest.mark.parametrize("kind", ["tf", "pitstop"])
def test_missing_checkpoints_and_checkpoint_options(kind, tmp_path, caplog, monkeypatch):
    """A missing checkpoint is a tf.errors.NotFoundError (and pitstop's own error); options
    of the wrong type are refused; a CheckpointOptions' write callbacks are called with the
    path, once per save, after it is written."""
    Ckpt, Manager = PEERS[kind]
    monkeypatch.setattr(pitstop.adapters.tf._options, "_warned_options", set())  # once
    d = str(tmp_path)
    ck = Ckpt(v=tf.Variable(1.0))
    called = []
    options = tf.train.CheckpointOptions(
        experimental_io_device="/job:localhost/device:CPU:0",
        experimental_write_callbacks=[lambda path: called.append(rel(path, d))])
    mgr = Manager(ck, d, max_to_keep=2)
    with caplog.at_level(logging.WARNING, logger="pitstop"):
        paths = [rel(mgr.save(options=options), d), rel(mgr.save(options=options), d),
                 rel(ck.save(os.path.join(d, "ckpt"), options=options), d),
                 rel(ck.write(os.path.join(d, "one"), options=options), d)]
        settle(mgr)
        if isinstance(ck, Checkpoint):
            ck.sync()
    assert paths == ["ckpt-1", "ckpt-2", "ckpt-3", "one"]
    assert called == paths
    if kind == "pitstop":  # said once, that pitstop has no device placement
        said = [r.getMessage() for r in caplog.records if "experimental_io_device" in
                r.getMessage()]
        assert len(said) == 1 and "ignored" in said[0]
    for missing in ("ckpt-9", "nowhere/ckpt-1"):
        with pytest.raises(tf.errors.NotFoundError) as e:
            ck.restore(os.path.join(d, missing))
        if kind == "pitstop":
            assert isinstance(e.value, pitstop.CheckpointNotFoundError)
            assert isinstance(e.value, pitstop.adapters.tf.NotFoundError)
            assert missing.split("/")[-1] in str(e.value)
    # tf.train fails on the options' attributes (AttributeError); pitstop refuses them
    refused = AttributeError if kind == "tf" else pitstop.InvalidArgumentError
    for call in (lambda: mgr.save(options="fast"), lambda: ck.write(os.path.join(d, "x"),
                                                                    options={"a": 1}),
                 lambda: ck.restore(os.path.join(d, "ckpt-1"), options="fast")):
        with pytest.raises(refused):
            call()
    if isinstance(mgr, CheckpointManager):
        mgr.close()
    shutil.rmtree(d)


def test_a_moved_directory_whose_state_file_has_absolute_paths(tmp_path, caplog):
    """tf.train's ``checkpoint`` file written with absolute paths (``save_relative_paths``
    off, TF1's Saver), the directory then moved: tf.train's restore_or_initialize raises
    on the stale path; pitstop's resumed from nothing in silence and its first save
    replaced tf.train's ckpt-1. It now resumes from the newest on disk, with a warning."""
    from tensorflow.python.checkpoint import checkpoint_management as cm

    old = tmp_path / "old"
    model, opt, step, ck, mgr = native_run(str(old), 3)
    cm.update_checkpoint_state_internal(
        str(old), model_checkpoint_path=str(old / "ckpt-3"),
        all_model_checkpoint_paths=[str(old / f"ckpt-{n}") for n in (1, 2, 3)],
        save_relative_paths=False)
    want = state_of(model, opt, step, ck)
    for kind in PEERS:
        shutil.copytree(old, tmp_path / kind)
    shutil.rmtree(old)

    model_t, opt_t, step_t = objects(1)
    peer = tf.train.CheckpointManager(
        tf.train.Checkpoint(model=model_t, optimizer=opt_t, step=step_t),
        str(tmp_path / "tf"), max_to_keep=3)
    with pytest.raises(tf.errors.NotFoundError):
        peer.restore_or_initialize()

    model_p, opt_p, step_p = objects(1)
    ck_p = Checkpoint(model=model_p, optimizer=opt_p, step=step_p)
    moved = CheckpointManager(ck_p, str(tmp_path / "pitstop"), max_to_keep=3)
    with caplog.at_level(logging.WARNING, logger="pitstop"):
        assert rel(moved.restore_or_initialize(), tmp_path) == os.path.join("pitstop", "ckpt-3")
    assert "not there" in caplog.text and "ckpt-3" in caplog.text
    assert same(state_of(model_p, opt_p, step_p, ck_p), want)
    assert rel(moved.save(), tmp_path / "pitstop") == "ckpt-4"
    moved.close()
    assert (tmp_path / "pitstop" / "ckpt-1.index").exists()  # nothing managed: none deleted


def test_pitstop_ls_of_a_mixed_directory(tmp_path, capsys):
    """`pitstop ls` of a directory holding tf.train's checkpoints, pitstop's, and a second
    name: it hid the `.pitstop-best-/` run directory, called tf.train's files someone
    else's "left alone" although the manager sweeps them, and named the retention by a
    private class."""
    from pitstop.cli import main

    d = tmp_path / "mix"
    v = tf.Variable([1.0, 2.0])
    native = tf.train.CheckpointManager(tf.train.Checkpoint(v=v), str(d), max_to_keep=3)
    for _ in range(3):
        native.save()
    (d / "notes.txt").write_text("mine")
    ck = Checkpoint(v=v)
    mgr = CheckpointManager(ck, str(d), max_to_keep=3)
    assert rel(mgr.restore_or_initialize(), d) == "ckpt-3"
    mgr.save()
    best = CheckpointManager(ck, str(d), max_to_keep=1, checkpoint_name="best")
    best.save()
    best.close()
    mgr.close()
    capsys.readouterr()
    assert main(["ls", str(d)]) == 0
    text = capsys.readouterr().out
    assert f"pitstop ls {d / '.pitstop-best-'}" in text
    assert "tf.train checkpoints: ckpt-2, ckpt-3 " in text and "deletes old ones" in text
    assert "not pitstop's: notes.txt (left alone" in text
    assert "ckpt-2.index" not in text and "_Doomed" not in text
    assert "retention: tf.train's max_to_keep (pitstop.adapters.tf)" in text


def test_a_save_after_passing_over_a_corrupt_native_checkpoint_replaces_it(tmp_path):
    """The fallback passed over tf.train's corrupt ckpt-2 and forgot it: the next save wrote
    ckpt-2/ beside the corrupt ckpt-2.index, and every restart then read the corrupt native
    one (the .index wins), fell back to ckpt-1 and lost the resumed run's progress."""
    import warnings

    d = str(tmp_path / "native")
    v = tf.Variable(tf.zeros(256))
    native = tf.train.CheckpointManager(tf.train.Checkpoint(v=v), d, max_to_keep=3)
    for i in (1, 2):
        v.assign(tf.fill([256], float(i)))
        native.save()
    data = next(p for p in Path(d).iterdir() if p.name.startswith("ckpt-2.data-"))
    data.write_bytes(data.read_bytes()[:100])
    w = tf.Variable(tf.zeros(256))
    mgr = CheckpointManager(Checkpoint(v=w), d, max_to_keep=3)
    with pytest.warns(UserWarning, match=r"ckpt-2 is corrupt"):
        assert rel(mgr.restore_or_initialize(), d) == "ckpt-1"
    w.assign(tf.fill([256], 7.0))
    assert rel(mgr.save(), d) == "ckpt-2"
    mgr.close()
    assert not os.path.exists(os.path.join(d, "ckpt-2.index"))
    u = tf.Variable(tf.zeros(256))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = CheckpointManager(Checkpoint(v=u), d, max_to_keep=3)
        assert rel(again.restore_or_initialize(), d) == "ckpt-2"
    assert float(u.numpy()[0]) == 7.0
    again.close()


def test_a_restart_finishes_what_a_killed_save_was_to_do_to_native_files(tmp_path, monkeypatch):
    """A job killed after save() returned (its save recovered from the memory tier by the
    restart) never ran the pass after the commit: tf.train's ckpt-2, dropped by that save's
    sweep, then stayed forever (no later sweep knew it), and tf.train's checkpoint file kept
    naming ckpt-3. Here the pass is held back as the kill would, then the directory reopened;
    tf.train's own run of the same saves is the reference."""
    import pitstop.adapters.tf._native as native_mod

    def tf_run(d):
        v, step = tf.Variable(0.0), tf.Variable(0, dtype=tf.int64)
        mgr = tf.train.CheckpointManager(tf.train.Checkpoint(v=v, step=step), d, max_to_keep=2)
        for _ in range(3):
            step.assign_add(1)
            mgr.save()
        return v, step, mgr

    _v, _s, peer = tf_run(str(tmp_path / "tf"))
    peer.save()                                   # ckpt-4: tf.train deletes ckpt-2
    d = str(tmp_path / "pitstop")
    v, step, _ = tf_run(d)
    mgr = CheckpointManager(Checkpoint(v=v, step=step), d, max_to_keep=2)
    assert rel(mgr.restore_or_initialize(), d) == "ckpt-3"
    with monkeypatch.context() as m:              # the process dies before the pass
        m.setattr(native_mod, "delete", lambda prefix: None)
        m.setattr(native_mod, "record", lambda *a, **k: None)
        mgr.save()
        mgr.close()
    assert os.path.exists(os.path.join(d, "ckpt-2.index"))
    again = CheckpointManager(Checkpoint(v=v, step=step), d, max_to_keep=2)
    assert rel(again.restore_or_initialize(), d) == "ckpt-4"
    again.close()
    native_left = sorted(f for f in os.listdir(d) if f.endswith(".index"))
    assert native_left == ["ckpt-3.index"]       # tf.train kept ckpt-3 and ckpt-4
    assert [rel(p, tmp_path / "tf") for p in peer.checkpoints] == ["ckpt-3", "ckpt-4"] == [
        rel(p, d) for p in again.checkpoints]
    assert rel(tf.train.latest_checkpoint(d), d) == "ckpt-4" == rel(peer.latest_checkpoint,
                                                                     tmp_path / "tf")


@pytest.mark.parametrize("command", ["ls", "inspect", "verify"])
def test_pitstop_commands_given_a_tf_train_checkpoint_path(command, tmp_path, capsys):
    """A tf.train user gives pitstop the path tf.train prints (`<dir>/ckpt-2`): it said
    "no such directory; check the path" of a checkpoint that is there."""
    from pitstop.cli import main

    d = tmp_path / "native"
    mgr = tf.train.CheckpointManager(tf.train.Checkpoint(v=tf.Variable(1.0)), str(d), 1)
    path = mgr.save()
    assert main([command, path]) != 0
    err = capsys.readouterr().err
    assert "a tf.train checkpoint" in err and f"pitstop import {path}" in err
