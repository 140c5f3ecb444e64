"""`pitstop import` of a native TensorFlow checkpoint (this folder runs in a process of its
own: TensorFlow and torch crash together)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import tensorflow as tf

import pitstop
from pitstop.adapters.tf import Checkpoint
from pitstop.cli import main


def test_tf_native_imports_with_its_values_and_save_counter(tmp_path, capsys):
    w = tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3))
    n = tf.Variable(np.int64(41))
    ckpt = tf.train.Checkpoint(w=w, n=n)
    ckpt.save(str(tmp_path / "tf" / "ckpt"))
    w.assign_add(tf.ones((2, 3)))
    prefix = ckpt.save(str(tmp_path / "tf" / "ckpt"))  # ckpt-2: save counter 2
    reader = tf.train.load_checkpoint(prefix)
    rc = main(["import", prefix + ".index", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    assert (rc, err) == (0, ""), err
    assert out == f"imported 3 arrays (40 B) from {prefix} as step 2 of {tmp_path / 'run'}\n"
    assert "torch" not in sys.modules  # only the framework the format needs
    with pitstop.CheckpointManager(tmp_path / "run", read_only=True) as mgr:
        tree = mgr.load(2)
    got = tree["w"][".ATTRIBUTES"]["VARIABLE_VALUE"]
    np.testing.assert_array_equal(got, reader.get_tensor("w/.ATTRIBUTES/VARIABLE_VALUE"))
    # restores into live TensorFlow objects through pitstop's tf.train.Checkpoint
    w2, n2 = tf.Variable(tf.zeros((2, 3))), tf.Variable(np.int64(0))
    Checkpoint(w=w2, n=n2).restore(str(tmp_path / "run" / "ckpt-2")).assert_consumed()
    np.testing.assert_array_equal(w2.numpy(), w.numpy())
    assert int(n2.numpy()) == 41
    # the step exists: refused, one line; --step picks another
    assert main(["import", prefix, str(tmp_path / "run")]) == 2
    assert "already has a checkpoint of step 2" in capsys.readouterr().err
    assert main(["import", prefix, str(tmp_path / "run"), "--from", "tf", "--step", "9"]) == 0
    capsys.readouterr()
    # the directory: its newest checkpoint (the "checkpoint" state file's), as TF's own
    assert main(["import", str(tmp_path / "tf"), str(tmp_path / "latest")]) == 0
    assert f"from {prefix} as step 2" in capsys.readouterr().out
    # a truncated data file: one line, exit 2
    data = tmp_path / "tf" / "ckpt-1.data-00000-of-00001"
    data.write_bytes(data.read_bytes()[:8])
    assert main(["import", str(tmp_path / "tf" / "ckpt-1"), str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pitstop: ") and err.count("\n") == 1 and "ckpt-1" in err


def test_tf_import_of_one_key_imports_that_entry_only(tmp_path, capsys):
    """`pitstop import tfdir runs/a --key w` imported the whole checkpoint: import_native
    reused its `key` parameter for the destination's encryption key, so --key was dropped
    (and an encrypted destination would have been given to select() as the key)."""
    w, n = tf.Variable(np.arange(3, dtype=np.float32)), tf.Variable(np.int64(4))
    prefix = tf.train.Checkpoint(w=w, n=n).save(str(tmp_path / "tf" / "ckpt"))
    for dest in ("run", "run"):  # a new directory, then an existing one (another step)
        rc = main(["import", prefix, str(tmp_path / dest), "--key", "w",
                   *(["--step", "5"] if (tmp_path / dest).exists() else [])])
        out, err = capsys.readouterr()
        assert (rc, err) == (0, ""), err
        assert out.startswith("imported 1 arrays (12 B)"), out
    with pitstop.CheckpointManager(tmp_path / "run", read_only=True) as mgr:
        assert mgr.all_steps() == [1, 5]
        got = mgr.load(5)
    np.testing.assert_array_equal(got[".ATTRIBUTES"]["VARIABLE_VALUE"], w.numpy())



def test_tf_import_into_an_existing_run_directory_at_a_url(tmp_path):
    """`pitstop import tf_run s3://b/run` into an existing pitstop run directory failed:
    "names its checkpoints step_<...>, but this manager asks for ckpt-<step>": whether the
    directory was new was decided by looking for .pitstop/ on the local disk. (A memory://
    URL stands for the bucket here: the same object-store code, without a server.)"""
    from pitstop.interop.tf_native import import_native
    url = "memory://tf-probe/run"
    with pitstop.CheckpointManager(url, memory_tier=False, save_on_signals=None) as mgr:
        mgr.save(1, {"w": np.ones(2)}).wait()
    prefix = tf.train.Checkpoint(w=tf.Variable([3.0])).save(str(tmp_path / "tf" / "ckpt"))
    assert import_native(prefix, url, 2) == 2
    with pitstop.CheckpointManager(url, read_only=True) as mgr:
        assert mgr.all_steps() == [1, 2]
    with pytest.raises(pitstop.StepExistsError):
        import_native(prefix, url, 2)
