"""docs/migration.md, "From tf.train": every row, the same loop through tf.train and through
pitstop's ``Checkpoint`` / ``CheckpointManager`` side by side in this process: the same
checkpoints kept (paths relative to the directory), the same training after a restore.
Where tf.train itself loses state (a Keras 3 Dropout's seed), pitstop's resume is held to
the uninterrupted run instead."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_helpers import make_model, train_step  # noqa: E402

from pitstop.adapters.tf import Checkpoint, CheckpointManager, latest_checkpoint  # noqa: E402

PEERS = {"tf": (tf.train.Checkpoint, tf.train.CheckpointManager, tf.train.latest_checkpoint),
         "pitstop": (Checkpoint, CheckpointManager, latest_checkpoint)}


def rel(path: Any, directory: Path) -> str | None:
    return None if path is None else os.path.relpath(str(path), str(directory))


def loop(kind: str, directory: Path, dropout: bool) -> dict[str, Any]:
    """Train 5 steps saving each through a manager with ``max_to_keep=3``; restart with a
    fresh model: ``restore_or_initialize()``, then 3 more steps; what each call said."""
    Ckpt, Manager, latest = PEERS[kind]
    model, opt = make_model(0, dropout=dropout), keras.optimizers.Adam(1e-2)
    mgr = Manager(Ckpt(model=model, optimizer=opt), str(directory), max_to_keep=3)
    out: dict[str, Any] = {"saved": []}
    for _ in range(5):
        train_step(model, opt)
        out["saved"].append(rel(mgr.save(), directory))
    if kind == "pitstop":
        mgr.sync()  # (the row: before another program reads the directory)
    out["kept"] = [rel(c, directory) for c in mgr.checkpoints]
    out["latest"] = rel(latest(str(directory)), directory)
    out["next"] = [train_step(model, opt) for _ in range(3)]
    if kind == "pitstop":
        mgr.close()
    model2, opt2 = make_model(7, dropout=dropout), keras.optimizers.Adam(1e-2)
    ck2 = Ckpt(model=model2, optimizer=opt2)
    mgr2 = Manager(ck2, str(directory), max_to_keep=3)
    out["resumed"] = rel(mgr2.restore_or_initialize(), directory)
    out["after"] = [train_step(model2, opt2) for _ in range(3)]
    # ckpt.restore(path) of an older one, and its status assertions
    ck2.restore(os.path.join(str(directory), "ckpt-3")).assert_consumed() \
        .assert_existing_objects_matched()
    out["older"] = [train_step(model2, opt2) for _ in range(1)]
    if kind == "pitstop":
        mgr2.close()
    return out


@pytest.mark.parametrize("dropout", [False, True])
def test_checkpoint_and_manager_keep_restore_and_resume_as_tf_train(tmp_path: Path,
                                                                    dropout: bool) -> None:
    """``Checkpoint(model=..., optimizer=...)``, ``CheckpointManager(ckpt, dir,
    max_to_keep=3)``, ``save()``, ``restore_or_initialize()``, ``ckpt.restore(path)`` with
    its assertions, ``latest_checkpoint(dir)``: the same paths, the same checkpoints kept,
    the same losses after the restart."""
    theirs = loop("tf", tmp_path / "tf", dropout)
    ours = loop("pitstop", tmp_path / "pitstop", dropout)
    assert theirs["kept"] == ["ckpt-3", "ckpt-4", "ckpt-5"]
    if dropout:
        # tf.train does not save a Keras 3 Dropout's SeedGenerator (it is no Trackable), so
        # its resumed losses differ from the uninterrupted ones; pitstop's are those (item 1)
        assert theirs["after"] != theirs["next"]
        assert ours["after"] == ours["next"]
        for k in ("after", "older"):
            theirs.pop(k), ours.pop(k)
    assert ours == theirs


def test_write_then_read_asserts_consumed_as_tf_train(tmp_path: Path) -> None:
    for kind in PEERS:
        v = tf.Variable([1.0, 2.0])
        ck = PEERS[kind][0](v=v)
        path = ck.write(str(tmp_path / kind / "exported"))
        if kind == "pitstop":
            ck.sync()
        v.assign([0.0, 0.0])
        ck.read(path).assert_consumed()
        assert v.numpy().tolist() == [1.0, 2.0], kind


def native_directory(directory: Path) -> list[float]:
    """Two native tf.train checkpoints of a variable (3.0, then 4.0)."""
    v = tf.Variable(3.0)
    native = tf.train.CheckpointManager(tf.train.Checkpoint(v=v), str(directory), 3)
    native.save()
    v.assign(4.0)
    native.save()
    return [3.0, 4.0]


def test_a_native_checkpoint_is_restored_by_path_and_the_next_save_is_pitstops(
        tmp_path: Path) -> None:
    """``Checkpoint.restore(native_path)`` restores what tf.train's own restore does; the
    next save through pitstop's manager writes a pitstop checkpoint, which restores too."""
    native_directory(tmp_path / "tf")
    path = tf.train.latest_checkpoint(str(tmp_path / "tf"))
    values = {}
    for kind in PEERS:
        v = tf.Variable(0.0)
        PEERS[kind][0](v=v).restore(path).assert_consumed()
        values[kind] = float(v.numpy())
    assert values == {"tf": 4.0, "pitstop": 4.0}
    v = tf.Variable(0.0)
    ck = Checkpoint(v=v)
    ck.restore(path).assert_consumed()
    mgr = CheckpointManager(ck, tmp_path / "pitstop", max_to_keep=2)
    v.assign_add(1.0)
    saved = mgr.save()
    mgr.close()
    w = tf.Variable(0.0)
    Checkpoint(v=w).restore(saved).assert_consumed()
    assert float(w.numpy()) == 5.0 and latest_checkpoint(tmp_path / "pitstop") == saved


def test_changing_only_the_import_resumes_a_native_directory(tmp_path: Path) -> None:
    """The user who switches changes one import on the directory they have: the manager's
    ``restore_or_initialize()`` resumes from the newest native checkpoint, as tf.train's."""
    native_directory(tmp_path / "d")
    got = {}
    for kind in ("tf", "pitstop"):
        v = tf.Variable(0.0)
        mgr = PEERS[kind][1](PEERS[kind][0](v=v), str(tmp_path / "d"), max_to_keep=3)
        got[kind] = (rel(mgr.restore_or_initialize(), tmp_path / "d"), float(v.numpy()))
        if kind == "pitstop":
            mgr.close()
    assert got["pitstop"] == got["tf"] == ("ckpt-2", 4.0)
