"""pitstop.adapters.tf.Checkpoint and CheckpointManager against tf.train's: the same calls in
the same order through both, and the same results (paths, numbering, interval checks,
retention, restored values, status assertions)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import pitstop

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import killed_after_save, make_model, rel, same, settle, train_step, values  # noqa: E402

from pitstop.adapters.tf import Checkpoint, CheckpointManager  # noqa: E402

PEERS = {"tf": (tf.train.Checkpoint, tf.train.CheckpointManager),
         "pitstop": (Checkpoint, CheckpointManager)}


def manager_scenario(kind, directory):
    """Every public call of the manager, with interval checks, explicit numbers and a
    restart; returns what each call returned."""
    Ckpt, Manager = PEERS[kind]
    directory = str(directory)
    v, step = tf.Variable(0.0), tf.Variable(0, dtype=tf.int64)
    ck = Ckpt(v=v, step=step)
    mgr = Manager(ck, directory, max_to_keep=2, step_counter=step, checkpoint_interval=3)
    log = [mgr.directory == directory, mgr.checkpoint_interval, mgr.latest_checkpoint,
           mgr.checkpoints]
    for i in range(8):
        step.assign(i)
        v.assign(float(i))
        path = mgr.save()
        settle(mgr)
        log += [rel(path, directory), [rel(c, directory) for c in mgr.checkpoints],
                rel(mgr.latest_checkpoint, directory), int(ck.save_counter.numpy())]
    log.append(rel(mgr.save(check_interval=False), directory))  # same step: not again
    step.assign(9)
    log.append(rel(mgr.save(check_interval=False), directory))
    log.append(rel(mgr.save(checkpoint_number=100), directory))  # same step 9 again: None
    step.assign(20)
    log.append(rel(mgr.save(checkpoint_number=tf.constant(100, tf.int64)), directory))
    settle(mgr)
    log.append([rel(c, directory) for c in mgr.checkpoints])
    v.assign(-1.0)
    status = ck.restore(mgr.latest_checkpoint)
    status.assert_consumed().assert_existing_objects_matched().assert_nontrivial_match()
    log += [float(v.numpy()), int(step.numpy()), int(ck.save_counter.numpy())]
    # a restart: a new manager on the same directory, a fresh checkpoint object
    v2, step2 = tf.Variable(0.0), tf.Variable(0, dtype=tf.int64)
    ck2 = Ckpt(v=v2, step=step2)
    if isinstance(mgr, CheckpointManager):
        mgr.close()
    mgr2 = Manager(ck2, directory, max_to_keep=2)
    log += [rel(mgr2.latest_checkpoint, directory),
            [rel(c, directory) for c in mgr2.checkpoints],
            rel(mgr2.restore_or_initialize(), directory), float(v2.numpy()),
            int(ck2.save_counter.numpy())]
    log.append(rel(mgr2.save(), directory))
    settle(mgr2)
    log.append([rel(c, directory) for c in mgr2.checkpoints])
    if isinstance(mgr2, CheckpointManager):
        mgr2.close()
    return log


def test_the_manager_does_what_tf_trains_does(tmp_path):
    theirs = manager_scenario("tf", tmp_path / "tf")
    ours = manager_scenario("pitstop", tmp_path / "pitstop")
    assert ours == theirs


def test_checkpoint_save_write_read_as_tf_train(tmp_path):
    def scenario(kind):
        Ckpt, _ = PEERS[kind]
        d = tmp_path / kind
        v = tf.Variable([1.0, 2.0])
        ck = Ckpt(v=v)
        out = [rel(ck.save(str(d / "ckpt")), d), rel(ck.save(str(d / "ckpt")), d),
               int(ck.save_counter.numpy())]
        v.assign([5.0, 6.0])
        out.append(rel(ck.write(str(d / "exported")), d))
        if isinstance(ck, Checkpoint):
            ck.sync()
        v.assign([0.0, 0.0])
        ck.read(str(d / "exported")).assert_consumed()
        out.append(v.numpy().tolist())
        ck.restore(str(d / "ckpt-1")).assert_consumed()
        out += [v.numpy().tolist(), int(ck.save_counter.numpy())]
        status = ck.restore(None)
        with pytest.raises(AssertionError):
            status.assert_consumed()
        return out

    assert scenario("pitstop") == scenario("tf")


def test_init_fn_runs_only_when_there_is_nothing_to_restore(tmp_path):
    calls = []
    ck = Checkpoint(v=tf.Variable(1.0))
    mgr = CheckpointManager(ck, tmp_path, max_to_keep=1, init_fn=lambda: calls.append(1))
    assert mgr.restore_or_initialize() is None and calls == [1]
    mgr.save()
    mgr.sync()
    assert mgr.restore_or_initialize() == str(tmp_path / "ckpt-1") and calls == [1]
    mgr.close()


def test_arguments_are_checked_as_tf_train_checks_them(tmp_path):
    ck = Checkpoint(v=tf.Variable(1.0))
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_to_keep"):
            CheckpointManager(ck, tmp_path, max_to_keep=bad)
        with pytest.raises(ValueError, match="max_to_keep"):
            tf.train.CheckpointManager(tf.train.Checkpoint(), tmp_path, max_to_keep=bad)
    with pytest.raises(ValueError, match="step_counter"):
        CheckpointManager(ck, tmp_path, max_to_keep=1, checkpoint_interval=2)
    with pytest.raises(ValueError, match="trackable"):
        Checkpoint(v=3.0)  # tf.train's own check: children must be trackable


def test_restoring_a_model_built_later_and_asserting(tmp_path):
    model, opt = make_model(0, dropout=False), keras.optimizers.Adam(1e-2)
    train_step(model, opt)
    ck = Checkpoint(model=model, optimizer=opt)
    mgr = CheckpointManager(ck, tmp_path, max_to_keep=3)
    mgr.save()
    mgr.close()
    ref = [train_step(model, opt) for _ in range(2)]

    model2, opt2 = make_model(3, build=False, dropout=False), keras.optimizers.Adam(1e-2)
    ck2 = Checkpoint(model=model2, optimizer=opt2)
    status = ck2.restore(str(tmp_path / "ckpt-1"))
    with pytest.raises(AssertionError, match="Unresolved"):
        status.assert_consumed()  # the model is not built yet, as with tf.train
    status.assert_nontrivial_match()
    assert [train_step(model2, opt2) for _ in range(2)] == ref
    status.assert_consumed()
    assert same(values(model2.variables), values(model.variables))


def test_the_save_returns_before_the_commit_and_sync_waits(tmp_path):
    v = tf.Variable(np.zeros(1 << 22, np.float32))  # 16 MiB
    ck = Checkpoint(v=v)
    mgr = CheckpointManager(ck, tmp_path, max_to_keep=None)
    path = mgr.save()
    v.assign_add(tf.ones_like(v))  # after the snapshot: not in the checkpoint
    mgr.sync()
    v.assign(tf.zeros_like(v) + 7)
    ck.restore(path).assert_consumed()
    assert float(v.numpy().max()) == 0.0
    mgr.close()


def test_a_native_tf_checkpoint_is_restored_and_saved_again_as_pitstop(tmp_path):
    model, opt = make_model(0, dropout=False), keras.optimizers.Adam(1e-2)
    gen = tf.random.Generator.from_seed(3)
    data = iter(tf.data.Dataset.range(100).shuffle(20, seed=1).repeat())
    for _ in range(2):
        train_step(model, opt), next(data), gen.normal([1])
    native = tf.train.Checkpoint(model=model, opt=opt, gen=gen, data=data).save(
        str(tmp_path / "tf" / "ckpt"))
    ref = [(train_step(model, opt), int(next(data)), gen.normal([1]).numpy().tobytes())
           for _ in range(3)]

    def fresh():
        m, o = make_model(4, build=False, dropout=False), keras.optimizers.Adam(1e-2)
        g = tf.random.Generator.from_seed(9)
        d = iter(tf.data.Dataset.range(100).shuffle(20, seed=1).repeat())
        return m, o, g, d

    m, o, g, d = fresh()
    ck = Checkpoint(model=m, opt=o, gen=g, data=d)
    ck.restore(native).assert_nontrivial_match()
    o.build(m.trainable_variables) if m.built else None
    m.build((None, 3))
    o.build(m.trainable_variables)
    ck.restore(native).assert_consumed()
    mgr = CheckpointManager(ck, tmp_path / "pitstop", max_to_keep=2)
    migrated = mgr.save()
    mgr.close()
    got = [(train_step(m, o), int(next(d)), g.normal([1]).numpy().tobytes()) for _ in range(3)]
    assert got == ref

    m, o, g, d = fresh()
    Checkpoint(model=m, opt=o, gen=g, data=d).restore(migrated)
    got = [(train_step(m, o), int(next(d)), g.normal([1]).numpy().tobytes()) for _ in range(3)]
    assert got == ref


def test_tf_trains_async_option_fails_with_keras_optimizers_and_pitstops_does_not(tmp_path):
    model, opt = make_model(0, dropout=False), keras.optimizers.Adam(1e-2)
    train_step(model, opt)
    ck = Checkpoint(model=model, opt=opt)
    mgr = CheckpointManager(ck, tmp_path, max_to_keep=2)
    for _ in range(3):
        train_step(model, opt)
        mgr.save()
    mgr.sync()
    assert mgr.checkpoints == [str(tmp_path / "ckpt-2"), str(tmp_path / "ckpt-3")]
    mgr.close()


def test_a_checkpoint_in_a_plain_pitstop_manager(tmp_path):
    v = tf.Variable([1.0])
    ck = Checkpoint(v=v)
    with pitstop.CheckpointManager(tmp_path / "p", save_on_signals=None) as m:
        m.save(1, {"ckpt": ck.tf_checkpoint})
        v.assign([0.0])
        m.restore({"ckpt": ck.tf_checkpoint})
    assert v.numpy().tolist() == [1.0]


def test_retention_survives_a_restart_and_leaves_foreign_checkpoints_alone(tmp_path):
    """tf.train's manager forgets what it did not list in its state file and deletes by
    name; pitstop's re-reads the directory and deletes only what this directory wrote."""
    v = tf.Variable(1.0)
    other = CheckpointManager(Checkpoint(v=v), tmp_path / "other", max_to_keep=None)
    other.save(checkpoint_number=0)
    other.close()
    import shutil
    mgr = CheckpointManager(Checkpoint(v=v), tmp_path / "run", max_to_keep=2)
    mgr.save()
    mgr.close()
    shutil.copytree(tmp_path / "other" / "ckpt-0", tmp_path / "run" / "ckpt-0")  # foreign
    mgr = CheckpointManager(Checkpoint(v=v), tmp_path / "run", max_to_keep=2)  # a restart
    for _ in range(3):
        mgr.save()
    mgr.sync()
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("ckpt")) \
        == ["ckpt-0", "ckpt-2", "ckpt-3"]
    assert mgr.checkpoints[-2:] == [str(tmp_path / "run" / f"ckpt-{n}") for n in (2, 3)]
    mgr.close()


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="needs /dev/shm")
def test_a_save_that_returned_survives_sigkill_in_the_memory_tier(tmp_path):
    assert killed_after_save(str(tmp_path / "run"), 1 << 20).endswith("ckpt-2")
    v = tf.Variable(np.zeros(1 << 20, np.float32))
    mgr = CheckpointManager(Checkpoint(v=v), tmp_path / "run", max_to_keep=2, memory_tier=True)
    assert mgr.latest_checkpoint == str(tmp_path / "run" / "ckpt-2")  # before it is on disk
    assert mgr.restore_or_initialize() == str(tmp_path / "run" / "ckpt-2")
    assert float(v.numpy()[0]) == 1.0 and float(v.numpy()[-1]) == float(1 << 20)
    mgr.sync()
    assert (tmp_path / "run" / "ckpt-2" / "manifest.json").exists()
    mgr.close()


def test_latest_checkpoint_reads_pitstop_and_native_directories(tmp_path):
    from pitstop.adapters.tf import latest_checkpoint
    v = tf.Variable(1.0)
    assert latest_checkpoint(tmp_path / "none") is None
    mgr = CheckpointManager(Checkpoint(v=v), tmp_path / "run", max_to_keep=2)
    mgr.save()
    mgr.save(checkpoint_number=7)
    mgr.save(checkpoint_number=3)  # saved last: the latest, as tf.train says
    assert latest_checkpoint(tmp_path / "run") == str(tmp_path / "run" / "ckpt-3")  # in flight
    mgr.close()
    assert latest_checkpoint(str(tmp_path / "run")) == str(tmp_path / "run" / "ckpt-3")
    native = tf.train.CheckpointManager(tf.train.Checkpoint(v=v), str(tmp_path / "tf"), 2)
    path = native.save()
    assert latest_checkpoint(tmp_path / "tf") == path == tf.train.latest_checkpoint(
        str(tmp_path / "tf"))
