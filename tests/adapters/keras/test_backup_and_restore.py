"""pitstop's BackupAndRestore: Keras's arguments and semantics, and a resume that is exact.

The exactness tests run a real ``fit()`` in a child process (fit_child.py), kill it with
SIGKILL (or SIGTERM) in the middle of an epoch, start it again, and compare with a ``fit()``
that was never interrupted: every per-batch loss logged after the resume point, the final
weights and the optimizer variables must be bitwise equal. The tests after them re-express
Keras's own tests (keras/src/callbacks/backup_and_restore_test.py) for pitstop's class.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest
from keras_helpers import on_backends

from pitstop.adapters.keras import BackupAndRestore

CHILD = Path(__file__).with_name("fit_child.py")
BACKEND = keras.backend.backend()


def start_child(out: Path, *args: str) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, str(CHILD), str(out), *args], text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=dict(os.environ, KERAS_BACKEND=BACKEND))


def finish(p: subprocess.Popen, expect: int = 0) -> None:
    _, err = p.communicate(timeout=240)
    assert p.returncode == expect, f"child exited {p.returncode}, expected {expect}:\n{err[-3000:]}"


def result(out: Path) -> dict:
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Start an uninterrupted fit per configuration (once per module); its result later."""
    runs: dict = {}

    def start(*args: str):
        if args not in runs:
            out = tmp_path_factory.mktemp("full")
            runs[args] = (out, start_child(out, *args), [])
        out, proc, done = runs[args]

        def get() -> dict:
            if not done:
                finish(proc)
                done.append(result(out))
            return done[0]
        return get
    return start


def assert_resumed_exactly(full: dict, resumed: dict, trained_before: int) -> None:
    """The resumed run's own batches log what the uninterrupted run logged; weights and
    optimizer end bitwise equal."""
    by_batch = {(e, b): loss for e, b, loss in full["logged"]}
    # the resumed run logs the passed-over batches of the resumed epoch (with the backup's
    # logs), then trains: the batches it trained are the last len(full) - trained_before
    fresh = resumed["logged"][len(resumed["logged"]) - (len(full["logged"]) - trained_before):]
    assert fresh, "the resumed run trained nothing"
    assert (fresh[0][0], fresh[0][1]) == divmod(trained_before, 10), "resumed at the wrong batch"
    wrong = [(e, b, loss, by_batch[(e, b)]) for e, b, loss in fresh if loss != by_batch[(e, b)]]
    assert not wrong, f"per-batch losses differ after the resume (epoch, batch, got, want): {wrong[:5]}"
    assert resumed["weights"] == full["weights"], "final weights differ"
    assert resumed["optimizer"] == full["optimizer"], "final optimizer variables differ"


# 10 batches per epoch, a backup every 3 batches (the child's default)
@pytest.mark.parametrize(("kind", "policy", "kill_at", "newest"), [
    # killed at epoch 1 batch 3; backup after batch 1 (each case on one backend: a killed
    # and a restarted Keras process cost ~30 s on the CI machine)
    pytest.param("functional", "float32", 14, 12, marks=on_backends("jax")),
    pytest.param("sequential", "mixed_float16", 17, 15, marks=on_backends("torch")),
    pytest.param("subclassed", "float32", 26, 24, marks=on_backends("tensorflow")),
])
def test_sigkill_mid_epoch_resumes_bitwise_identical(tmp_path, uninterrupted, kind, policy,
                                                     kill_at, newest) -> None:
    full = uninterrupted(kind, "--policy", policy)
    finish(start_child(tmp_path, kind, "--policy", policy, "--kill-at", str(kill_at)), -9)
    resumed = start_child(tmp_path, kind, "--policy", policy)
    finish(resumed)
    assert_resumed_exactly(full(), result(tmp_path), trained_before=newest)


@on_backends("jax")
def test_sigterm_saves_at_the_next_batch_and_resumes_exactly(tmp_path, uninterrupted) -> None:
    """Epoch backups only; SIGTERM sent at the end of batch 13 (after the backup callback's
    turn) is saved at the next step boundary, batch 14's end; the process exits, and the
    run resumes from there exactly."""
    full = uninterrupted("functional", "--policy", "float32")
    p = start_child(tmp_path, "functional", "--save-freq", "epoch", "--term-at", "13")
    _, err = p.communicate(timeout=240)
    assert p.returncode != 0, "SIGTERM should end the run (after its save)"
    steps = sorted(p.name for p in (tmp_path / "backup").glob("step_*"))
    assert steps and int(steps[-1].split("_")[1]) == 14, (steps, err[-3000:])
    finish(start_child(tmp_path, "functional", "--save-freq", "epoch"))
    assert_resumed_exactly(full(), result(tmp_path), trained_before=14)


@on_backends("tensorflow")
def test_keras_own_callback_is_not_exact_where_pitstops_is(tmp_path, uninterrupted) -> None:
    """The differential: the same kill through keras.callbacks.BackupAndRestore resumes at
    the start of the epoch with the batches already trained trained again."""
    full = uninterrupted("functional", "--policy", "float32")
    finish(start_child(tmp_path, "functional", "--keras-callback", "--kill-at", "14"), -9)
    finish(start_child(tmp_path, "functional", "--keras-callback"))
    assert result(tmp_path)["weights"] != full()["weights"]


# --------------------------------------------------------------------------------------
# Keras's own tests (keras/src/callbacks/backup_and_restore_test.py), re-expressed. Keras
# resumes a step-wise backup at the start of the interrupted epoch, training its first
# batches again; pitstop resumes at the next batch, so its counts are those of a fit() that
# was never interrupted (15 where Keras's test expects 17).
class InterruptingCallback(keras.callbacks.Callback):
    def __init__(self, steps_int=None, epoch_int=None) -> None:
        super().__init__()
        self.batch_count = self.epoch_count = 0
        self.steps_int, self.epoch_int = steps_int, epoch_int

    def on_epoch_end(self, epoch, log=None):
        self.epoch_count += 1
        if self.epoch_int is not None and self.epoch_count == self.epoch_int:
            raise RuntimeError("EpochInterruption")

    def on_batch_end(self, batch, logs=None):
        self.batch_count += 1
        if self.steps_int is not None and self.batch_count == self.steps_int:
            raise RuntimeError("StepsInterruption")


class CanaryLayer(keras.layers.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.counter = self.add_weight(shape=(), initializer="zeros", dtype="float32",
                                       trainable=False)

    def call(self, x):
        self.counter.assign_add(1)
        return x


def make_model() -> keras.Model:
    model = keras.Sequential([keras.layers.Input((3,)), CanaryLayer(), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer="sgd", metrics=["mse"])
    return model


def data():
    rs = np.random.RandomState(0)
    return rs.random_sample((10, 3)), rs.random_sample((10, 1))


def test_save_freq_unknown_error() -> None:
    with pytest.raises(ValueError, match="Invalid value"):
        BackupAndRestore(backup_dir="backup_dir", save_freq="batch")
    with pytest.raises(ValueError, match="Invalid value"):
        BackupAndRestore(backup_dir="backup_dir", save_freq=0.15)


@pytest.mark.parametrize("bad", ["", None])
def test_backup_dir_empty_error(bad) -> None:
    with pytest.raises(ValueError, match="Empty `backup_dir` argument passed"):
        BackupAndRestore(backup_dir=bad, save_freq="epoch")


def test_best_case_step(tmp_path) -> None:
    backup_dir = tmp_path / "subdir"
    model, (x, y) = make_model(), data()
    cbk = BackupAndRestore(backup_dir, save_freq=1)
    with pytest.raises(RuntimeError, match="StepsInterruption"):
        model.fit(x, y, batch_size=4, epochs=2, verbose=0,
                  callbacks=[cbk, InterruptingCallback(steps_int=2)])
    assert backup_dir.exists()
    assert cbk._current_epoch == 0 and cbk._last_batch_seen == 1
    assert int(model.layers[0].counter.value) == 2
    hist = model.fit(x, y, batch_size=4, callbacks=[cbk], epochs=5, verbose=0)
    assert cbk._current_epoch == 5
    assert hist.epoch[-1] == 4
    assert int(model.layers[0].counter.value) == 15  # Keras's own: 17 (2 batches twice)
    assert not backup_dir.exists()  # delete_checkpoint=True: removed when fit() completes


def interrupted_after_two_epochs(cbk: BackupAndRestore):
    """A fit() of 6 epochs that a callback interrupts after its second epoch."""
    model, (x, y) = make_model(), data()
    with pytest.raises(RuntimeError, match="EpochInterruption"):
        model.fit(x, y, batch_size=4, epochs=6, verbose=0,
                  callbacks=[cbk, InterruptingCallback(epoch_int=2)])
    return model, x, y


def test_best_case_epoch(tmp_path) -> None:
    backup_dir = tmp_path / "subdir"
    cbk = BackupAndRestore(backup_dir=backup_dir, save_freq="epoch")
    model, x, y = interrupted_after_two_epochs(cbk)
    assert cbk._current_epoch == 2
    assert backup_dir.exists()
    assert int(model.layers[0].counter.value) == 6
    hist = model.fit(x, y, batch_size=4, callbacks=[cbk], epochs=5, verbose=0)
    assert cbk._current_epoch == 5
    assert hist.epoch[-1] == 4
    assert int(model.layers[0].counter.value) == 5 * 3


def corrupt_newest(backup_dir: Path) -> None:
    steps = sorted(p for p in backup_dir.iterdir() if p.name.startswith("step_"))
    for data_file in steps[-1].glob("data-*"):
        data_file.write_bytes(bytes(b ^ 0xFF for b in data_file.read_bytes()))


def test_backup_corrupted_falls_back_to_the_previous_one(tmp_path) -> None:
    backup_dir = tmp_path / "subdir"
    cbk = BackupAndRestore(backup_dir=backup_dir, save_freq="epoch", double_checkpoint=True,
                           delete_checkpoint=False)
    model, x, y = interrupted_after_two_epochs(cbk)
    cbk.wait()
    steps = sorted(p for p in backup_dir.iterdir() if p.name.startswith("step_"))
    assert len(steps) == 2, "double_checkpoint keeps the current backup and the previous one"
    corrupt_newest(backup_dir)
    hist = model.fit(x, y, batch_size=4, callbacks=[cbk], epochs=5, verbose=0)
    # resumed from the previous backup (after epoch 1): epochs 1..4 trained again
    assert hist.epoch == [1, 2, 3, 4]
    assert cbk._current_epoch == 5
    assert int(model.layers[0].counter.value) == 5 * 3


def test_backup_corrupted_without_double_checkpoint_says_so(tmp_path) -> None:
    backup_dir = tmp_path / "subdir"
    cbk = BackupAndRestore(backup_dir=backup_dir, save_freq="epoch")
    model, x, y = interrupted_after_two_epochs(cbk)
    cbk.wait()
    (step,) = [p for p in backup_dir.iterdir() if p.name.startswith("step_")]
    for p in step.rglob("*"):
        if p.is_file() and p.suffix != ".json":
            p.write_bytes(b"\0" * p.stat().st_size)
    import pitstop

    with pytest.raises(pitstop.CorruptCheckpointError):
        model.fit(x, y, batch_size=4, callbacks=[cbk], epochs=5, verbose=0)


def test_model_deleted_case_epoch(tmp_path) -> None:
    backup_dir = tmp_path / "subdir"
    model, (x, y) = make_model(), data()
    cbk = BackupAndRestore(backup_dir, save_freq="epoch")
    model.fit(x, y, batch_size=4, callbacks=[cbk], epochs=2, verbose=0)
    assert not backup_dir.exists()
    # and the model does not keep a resumed epoch for the next fit()
    hist = model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    assert hist.epoch == [0, 1]


def test_a_changed_model_is_refused_before_anything_is_written(tmp_path) -> None:
    import pitstop

    backup_dir = tmp_path / "b"
    model, (x, y) = make_model(), data()
    cbk = BackupAndRestore(backup_dir, save_freq="epoch", delete_checkpoint=False)
    model.fit(x, y, batch_size=4, callbacks=[cbk], epochs=1, verbose=0)
    other = keras.Sequential([keras.layers.Input((3,)), keras.layers.Dense(2),
                              keras.layers.Dense(1)])
    other.compile(loss="mse", optimizer="sgd")
    before = [np.array(keras.ops.convert_to_numpy(v)) for v in other.variables]
    with pytest.raises(pitstop.IncompatibleTargetError):
        other.fit(x, y, batch_size=4, epochs=2, verbose=0,
                  callbacks=[BackupAndRestore(backup_dir, save_freq="epoch")])
    after = [np.array(keras.ops.convert_to_numpy(v)) for v in other.variables]
    assert all((a == b).all() for a, b in zip(before, after, strict=True))


class HoldThenRaise(keras.callbacks.Callback):
    """Placed after a BackupAndRestore: holds its writer until this callback raises, at the
    end of the first epoch, right after the backup of that epoch was taken."""

    def __init__(self, backup: BackupAndRestore) -> None:
        super().__init__()
        self.backup, self.release = backup, threading.Event()

    def on_train_begin(self, logs=None):
        self.backup._mgr.hooks["before_write"] = lambda step: self.release.wait(120)

    def on_epoch_end(self, epoch, logs=None):
        self.release.set()  # the writer goes on from here, as fit() ends by the exception
        raise RuntimeError("a later callback failed")


def test_a_failed_fit_returns_with_its_backups_committed(tmp_path, caplog) -> None:
    """fit() ending by an exception waits for the backup being written: the user's cleanup
    right after it (shutil.rmtree of the backup dir) races no writer, and nothing is lost."""
    backup_dir = tmp_path / "backup"
    model, (x, y) = make_model(), data()
    cbk = BackupAndRestore(backup_dir, save_freq="epoch")
    with caplog.at_level(logging.WARNING, logger="pitstop"), \
            pytest.raises(RuntimeError, match="a later callback failed"):
        model.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[cbk, HoldThenRaise(cbk)])
    # the backup of epoch 0 (3 batches) was committed before fit() raised
    assert sorted(p.name for p in backup_dir.iterdir() if p.name.startswith("step_")) \
        == ["step_0000000003"]
    shutil.rmtree(backup_dir)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    # the callback is usable again: a new fit() starts from scratch and completes
    hist = model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[cbk])
    assert hist.epoch == [0, 1] and not backup_dir.exists()


def test_a_fit_says_nothing_about_save_policies(tmp_path) -> None:
    """The callback decides its own saves (``save_freq``) and gives its manager no save
    policy; the manager's "step() saves only on a signal" warning, meant for a manager a
    user made without an interval, is not for a Keras user, who has no such argument."""
    model, (x, y) = make_model(), data()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=4, epochs=1, verbose=0,
                  callbacks=[BackupAndRestore(tmp_path / "b", save_freq="epoch")])
    assert not [w for w in seen if "saves only on a signal" in str(w.message)]


def test_a_fit_failing_in_a_later_on_train_begin_leaves_the_folder_free(tmp_path) -> None:
    """A callback after ours that raises in its ``on_train_begin`` ends fit() before any
    batch: the backup folder is released (before: a second BackupAndRestore on it in this
    process got DirectoryLockedError naming this process's own pid)."""
    class Refuses(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            raise RuntimeError("refused")

    model, (x, y) = make_model(), data()
    first, later = BackupAndRestore(tmp_path / "b"), Refuses()
    with pytest.raises(RuntimeError, match="refused"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[first, later])
    assert "on_train_begin" not in vars(later)  # (put back)
    hist = make_model().fit(x, y, batch_size=4, epochs=2, verbose=0,
                            callbacks=[BackupAndRestore(tmp_path / "b")])
    assert hist.epoch == [0, 1]
