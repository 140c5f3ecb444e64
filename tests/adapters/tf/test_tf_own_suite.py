"""TensorFlow's own tests of ``tf.train.Checkpoint`` and ``tf.train.CheckpointManager``,
re-expressed against pitstop's classes (and, where the case allows, against tf.train's too:
the same function runs on both implementations and must give the same results).

Ported from tensorflow/python/checkpoint/checkpoint_management_test.py (CheckpointManagerTest)
and tensorflow/python/checkpoint/checkpoint_test.py (the eager-mode cases of
CheckpointingTests and SerializeToTensorTest). Each test below names the TensorFlow test it
re-expresses. What is adapted, and only where it must be:

- Files on disk: a pitstop checkpoint is a directory ``<prefix>`` rather than
  ``<prefix>.index`` + ``<prefix>.data-*``, and there is no ``checkpoint`` state file, so
  ``checkpoint_exists`` is a per-implementation helper (:meth:`Peer.exists`), and assertions
  on the state file (``get_checkpoint_state``, its timestamps, ``last_preserved_timestamp``,
  ``tf.train.latest_checkpoint``) are replaced by the manager's own ``checkpoints`` and
  ``latest_checkpoint``, or assert pitstop's documented behaviour (docs/tf.md, "What differs
  from tf.train").
- Saves are asynchronous: ``sync()`` before the disk is inspected (:meth:`Peer.settle`).
- Time: TensorFlow's tests patch ``checkpoint_management.time``; here ``time.time`` itself
  is patched (:func:`clock`), since pitstop records save times in its manifests too.
- TF1 helpers the cases use only to build objects (``add_variable`` under a variable scope,
  ``variable_scope.get_variable``) become plain ``tf.Variable`` attributes where the
  case is not about them.

Skipped, and why:

- checkpoint_management_test.py: LatestCheckpointWithRelativePaths (testNameCollision,
  testRelativePath), SaverUtilsTest (testCheckpointExists, testGetCheckpointMtimes,
  testRemoveCheckpoint): TF1 ``tf.compat.v1.train.Saver`` in graph sessions, not these
  classes. CheckpointStateTest (all): the ``checkpoint`` state-file protocol buffer
  functions, which pitstop deliberately does not write.
- checkpoint_test.py: InterfaceTests (testAddVariable, testInitNotCalled, testShapeDtype):
  TensorFlow's ``add_variable`` helper and variable scopes, nothing a checkpoint does.
  testMoreComplexSaveableReturnedWithGlobalName, test_save_in_graph_but_no_session,
  SerializeToTensorTest.test_reference_variable, TemplateTests: TF1 Saver, sessions,
  reference variables and templates (graph mode). testFreezing: ``frozen_saver`` builds
  graph save/restore ops. test_write_checkpoint_path_str_from_function,
  test_write_checkpoint_path_tensor_from_function,
  test_write_checkpoint_path_tensor_does_not_exist_from_function: ``write`` traced inside a
  ``tf.function`` as graph ops; pitstop's save is host-side Python (an in-memory snapshot
  handed to a background commit) and has no op form. test_checkpoint_saved_model_compatibility:
  restoring a SavedModel directory (not a checkpoint). test_defer_objects_with_values_only:
  asserts on the length of TensorFlow's private ``_deferred_dependencies`` lists, not on
  behaviour (the behaviour, values applied when the object is created, is covered by the
  deferred-restoration cases here). The ``_enable_async_ckpt`` parameterizations: pitstop is
  always asynchronous and its cases here run that way; tf.train's async option is covered
  elsewhere (test_checkpoint.py). Every graph-mode half of ``run_in_graph_and_eager_modes``.
"""

from __future__ import annotations

import copy
import gc
import os
import pathlib
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any
from unittest import mock

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from tensorflow.python.checkpoint.checkpoint import add_variable  # noqa: E402
from tensorflow.python.platform import tf_logging  # noqa: E402
from tensorflow.python.trackable import autotrackable  # noqa: E402
from tensorflow.python.trackable import base as trackable_base  # noqa: E402

import pitstop  # noqa: E402
from pitstop.adapters.tf import Checkpoint, CheckpointManager  # noqa: E402
from pitstop.adapters.tf import _runs as pitstop_runs  # noqa: E402


@dataclass
class Peer:
    """One implementation of the two classes, with what must differ between them."""

    name: str
    Checkpoint: Any
    Manager: Any

    @property
    def is_pitstop(self) -> bool:
        return self.name == "pitstop"

    def settle(self, *objects: Any) -> None:
        """Wait for asynchronous saves (pitstop) before the disk is looked at."""
        if self.is_pitstop:
            for o in objects:
                o.sync()

    def exists(self, path: str | None) -> bool:
        """``checkpoint_management.checkpoint_exists``: ``<prefix>.index`` for tf.train, the
        directory ``<prefix>`` for pitstop."""
        if path is None:
            return False
        if self.is_pitstop:  # (a second name's checkpoints live beside, see run_directory)
            head, base = os.path.split(path)
            where = pitstop_runs.run_directory(head, base.rsplit("-", 1)[0] + "-") if "-" in base else head
            return os.path.exists(os.path.join(where, base, "manifest.json"))
        return os.path.exists(path + ".index")


PEERS = {"tf": Peer("tf", tf.train.Checkpoint, tf.train.CheckpointManager),
         "pitstop": Peer("pitstop", Checkpoint, CheckpointManager)}


@pytest.fixture(params=list(PEERS))
def peer(request) -> Peer:
    gap = getattr(request.function, "pitstop_gap", None)
    if gap is not None and request.param == "pitstop":
        request.applymarker(pytest.mark.xfail(reason=gap, strict=True))
    return PEERS[request.param]


def pitstop_gap(reason: str):
    """A tf.train behaviour pitstop does not have yet, for a reason outside
    pitstop/adapters/tf/checkpoint.py and manager.py: the pitstop case is a strict xfail (it fails loudly
    once fixed, to be turned into a plain test)."""
    def mark(fn):
        fn.pitstop_gap = reason
        return fn

    return mark


#: the reasons, each naming where the fix belongs
NO_VALUE_OBJECT = ("pitstop/adapters/tf/_restore.py (Restore.check/_cannot_take): a live "
                   "object that cannot take a saved value (a bare Trackable where a variable "
                   "was saved) is refused with IncompatibleTargetError at restore(); "
                   "tf.train leaves the value unused, warns of it when the restore is "
                   "released and fails assert_consumed() with 'Unused attributes'")
CYCLE = ("pitstop/adapters/tf/_restore.py: Outcome.matched holds the live objects strongly and "
         "a deferred value (_Deferred on the parent) holds the Restore, so a restore with "
         "values still deferred makes a reference cycle; tf.train keeps its matched objects "
         "in a WeakValueDictionary, so they are freed by reference counting alone")
ONE_CALL = ("pitstop/adapters/tf/_restore.py (Restore._assign): _restore_from_tensors is called "
            "once per saved tensor with that tensor alone; tf.train calls it once with all "
            "of the object's tensors, so an object saving two (MultiTensor) gets a KeyError")


@pytest.fixture(autouse=True)
def _close_pitstop_runs():
    """Each test's run directories are released at its end (as a process exit would): every
    manager still open is closed, also one only garbage keeps alive (no gc.collect() here:
    with TensorFlow loaded, one takes most of a test's time)."""
    yield
    for ref in list(pitstop_runs._Runs._open.values()):
        mgr = ref()
        if mgr is not None and not mgr._closed:
            try:
                mgr.close()
            except pitstop.CheckpointError:
                pass


class Clock:
    """``time.time`` patched to a settable value (TensorFlow's tests patch its module's
    ``time``; pitstop also stamps its manifests with ``time.time``)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock(3.0)
    monkeypatch.setattr(time, "time", c)
    return c


def keys_of(peer: Peer, path: str) -> set[str]:
    """The tensor keys a checkpoint holds (TensorFlow's own, e.g. ``v/.ATTRIBUTES/...``)."""
    if not peer.is_pitstop:
        return {k for k, _ in tf.train.list_variables(path)} - {"_CHECKPOINTABLE_OBJECT_GRAPH"}
    tree = pitstop_runs.read_tree(path)
    out: set[str] = set()

    def visit(node: Any, prefix: tuple[str, ...]) -> None:
        for k, v in node.items():
            if k == ".OBJECT_GRAPH":
                continue
            if k == ".ATTRIBUTES":
                out.update(f"{'/'.join(prefix)}/{k}/{a}" for a in v)
            else:
                visit(v, (*prefix, k))

    visit(tree, ())
    return out


# ====================================================================================
# checkpoint_management_test.py: CheckpointManagerTest
# ====================================================================================

def test_deletion(peer, tmp_path):
    """testDeletion"""
    checkpoint = peer.Checkpoint()
    manager = peer.Manager(checkpoint, str(tmp_path), max_to_keep=3)
    first, second, third, fourth = (manager.save() for _ in range(4))
    peer.settle(manager)
    assert peer.exists(fourth)
    assert peer.exists(third)
    assert peer.exists(second)
    assert not peer.exists(first)


def test_keep_all(peer, tmp_path):
    """testKeepAll: max_to_keep=None keeps everything, across new managers on the
    directory; a later manager with max_to_keep=3 trims the older ones on its first save."""
    checkpoint = peer.Checkpoint()
    directory = str(tmp_path / "True")
    manager = peer.Manager(checkpoint, directory, max_to_keep=None)
    first, second, third = (manager.save() for _ in range(3))
    peer.settle(manager)
    assert all(peer.exists(p) for p in (first, second, third))
    assert manager.latest_checkpoint == third
    assert manager.checkpoints == [first, second, third]
    del manager
    manager = peer.Manager(checkpoint, directory, max_to_keep=None)
    fourth = manager.save()
    peer.settle(manager)
    assert manager.checkpoints == [first, second, third, fourth]
    del manager
    manager = peer.Manager(checkpoint, directory, max_to_keep=3)
    assert manager.checkpoints == [first, second, third, fourth]
    assert all(peer.exists(p) for p in (first, second, third, fourth))
    fifth = manager.save()
    peer.settle(manager)
    assert manager.checkpoints == [third, fourth, fifth]
    assert [peer.exists(p) for p in (first, second, third, fourth, fifth)] == \
        [False, False, True, True, True]


def test_save_restore_state(peer, tmp_path, clock):
    """testSaveRestoreState: keep_checkpoint_every_n_hours across managers, with a patched
    clock. The state-file assertions (timestamps, last_preserved_timestamp) have no
    pitstop counterpart (no state file, deliberately); what is on disk and the managers'
    lists are asserted instead."""
    directory = str(tmp_path)
    clock.now = 3.0
    checkpoint = peer.Checkpoint()
    first_manager = peer.Manager(checkpoint, directory, max_to_keep=2)
    first_time = 10000.0
    first_name = os.path.join(directory, "ckpt-1")
    clock.now = first_time
    first_manager.save()
    peer.settle(first_manager)
    second_time = first_time + 3610.0
    second_name = os.path.join(directory, "ckpt-2")
    clock.now = second_time
    first_manager.save()
    peer.settle(first_manager)
    assert first_manager.checkpoints == [first_name, second_name]
    assert first_manager.latest_checkpoint == second_name
    del first_manager

    second_manager = peer.Manager(checkpoint, directory, max_to_keep=2,
                                  keep_checkpoint_every_n_hours=1.5)
    assert second_manager.checkpoints == [first_name, second_name]
    assert second_manager.latest_checkpoint == second_name
    third_name = os.path.join(directory, "ckpt-3")
    third_time = second_time + 3600.0 * 0.2
    clock.now = third_time
    second_manager.save()
    peer.settle(second_manager)
    assert peer.exists(first_name)
    assert peer.exists(second_name)
    assert second_manager.checkpoints == [second_name, third_name]
    fourth_time = third_time + 3600.0 * 0.5
    clock.now = fourth_time
    fourth_name = os.path.join(directory, "ckpt-4")
    second_manager.save()
    peer.settle(second_manager)
    assert peer.exists(first_name)
    assert not peer.exists(second_name)
    assert second_manager.checkpoints == [third_name, fourth_name]
    fifth_time = fourth_time + 3600.0 * 0.5
    clock.now = fifth_time
    fifth_name = os.path.join(directory, "ckpt-5")
    second_manager.save()
    peer.settle(second_manager)
    assert second_manager.checkpoints == [fourth_name, fifth_name]
    del second_manager

    third_manager = peer.Manager(checkpoint, directory, max_to_keep=2,
                                 keep_checkpoint_every_n_hours=1.5)
    assert third_manager.latest_checkpoint == fifth_name
    clock.now += 10.0
    third_manager.save()
    peer.settle(third_manager)
    sixth_name = os.path.join(directory, "ckpt-6")
    assert [peer.exists(p) for p in (first_name, second_name, third_name, fourth_name,
                                     fifth_name, sixth_name)] == \
        [True, False, False, True, True, True]
    assert third_manager.checkpoints == [fifth_name, sixth_name]


def test_continue_from_unmanaged(peer, tmp_path):
    """testContinueFromUnmanaged: checkpoints written by Checkpoint.save under another
    prefix in the manager's directory are restored from, numbered after, and never deleted
    by the manager."""
    directory = str(tmp_path)
    prefix = os.path.join(directory, "unusual_prefix")
    checkpoint = peer.Checkpoint()
    first = checkpoint.save(prefix)
    second = checkpoint.save(prefix)
    peer.settle(checkpoint)
    del checkpoint
    checkpoint = peer.Checkpoint()
    manager = peer.Manager(checkpoint, directory, max_to_keep=2)
    checkpoint.restore(manager.latest_checkpoint).run_restore_ops()
    assert int(checkpoint.save_counter) == 2
    third = manager.save()
    assert manager.checkpoints == [third]
    fourth = manager.save()
    assert manager.checkpoints == [third, fourth]
    fifth = manager.save()
    assert manager.checkpoints == [fourth, fifth]
    peer.settle(manager)
    assert [peer.exists(p) for p in (first, second, third, fourth, fifth)] == \
        [True, True, False, True, True]


def test_clock_reset(peer, tmp_path, clock):
    """testClockReset: with the clock set back, a new manager errs on the side of keeping
    the older checkpoints, and still knows the newest one and the saves it makes."""
    directory = str(tmp_path)
    clock.now = 10000.0
    checkpoint = peer.Checkpoint()
    first_manager = peer.Manager(checkpoint, directory, max_to_keep=1,
                                 keep_checkpoint_every_n_hours=1.0)
    first = first_manager.save()
    peer.settle(first_manager)
    clock.now += 3600.0
    second = first_manager.save()
    peer.settle(first_manager)
    clock.now += 3600.0
    third = first_manager.save()
    peer.settle(first_manager)
    assert not peer.exists(first)
    assert peer.exists(second)
    assert peer.exists(third)
    assert first_manager.checkpoints == [third]
    clock.now = 5000.0
    del first_manager
    second_manager = peer.Manager(checkpoint, directory, max_to_keep=1)
    assert peer.exists(second)
    assert second_manager.latest_checkpoint == third
    assert second_manager.checkpoints == []
    clock.now += 10.0
    fourth = second_manager.save()
    peer.settle(second_manager)
    assert peer.exists(second)
    assert peer.exists(third)
    assert second_manager.latest_checkpoint == fourth
    assert second_manager.checkpoints == [fourth]
    clock.now += 10.0
    fifth = second_manager.save()
    peer.settle(second_manager)
    assert peer.exists(second)
    assert peer.exists(third)
    assert second_manager.checkpoints == [fifth]


def test_manager_custom_numbering(peer, tmp_path):
    """testCustomNumbering (CheckpointManagerTest)"""
    directory = str(tmp_path)
    step = tf.Variable(0, dtype=tf.int64)
    checkpoint = peer.Checkpoint(step=step)
    manager = peer.Manager(checkpoint, directory, max_to_keep=2)
    for i in range(5):
        path = manager.save(checkpoint_number=step)
        assert path.endswith(f"-{2 * i}"), path
        step.assign_add(2)
    assert int(checkpoint.save_counter) == 5
    last_path = manager.save(checkpoint_number=32)
    assert "-32" in last_path
    assert last_path == manager.latest_checkpoint
    peer.settle(manager)
    if peer.is_pitstop:
        # deliberate: no `checkpoint` state file, so tf.train's reader finds nothing
        assert tf.train.latest_checkpoint(directory) is None
    else:
        assert tf.train.latest_checkpoint(directory) == last_path
    # the state file's all_model_checkpoint_paths are the manager's list
    assert manager.checkpoints == [path, last_path]
    assert sorted(n for n in os.listdir(directory) if n != ".pitstop") == (
        ["ckpt-32", "ckpt-8"] if peer.is_pitstop else
        ["checkpoint", "ckpt-32.data-00000-of-00001", "ckpt-32.index",
         "ckpt-8.data-00000-of-00001", "ckpt-8.index"])


def test_custom_checkpoint_prefix(peer, tmp_path):
    """testCustomCheckpointPrefix: two managers with different names in one directory."""
    directory = str(tmp_path)
    checkpoint = peer.Checkpoint()
    manager = peer.Manager(checkpoint, directory, max_to_keep=2, checkpoint_name="ckpt_name")
    path = manager.save(checkpoint_number=5)
    assert os.path.basename(path) == "ckpt_name-5"
    manager = peer.Manager(checkpoint, directory, max_to_keep=2)
    path2 = manager.save(checkpoint_number=5)
    assert os.path.basename(path2) == "ckpt-5"
    peer.settle(manager)
    assert peer.exists(path) and peer.exists(path2)


def test_restore_or_initialize(peer, tmp_path):
    """testRestoreOrInitialize"""
    directory = str(tmp_path)
    init_prefix = os.path.join(directory, "init")
    init_v = tf.Variable(2.0)
    init_ckpt = peer.Checkpoint(v=init_v)
    init_path = init_ckpt.save(init_prefix)
    ckpt_dir = os.path.join(directory, "ckpt")
    v = tf.Variable(1.0)
    checkpoint = peer.Checkpoint(v=v)
    manager = peer.Manager(checkpoint, ckpt_dir, max_to_keep=None,
                           init_fn=lambda: checkpoint.restore(init_path).run_restore_ops())
    assert manager.restore_or_initialize() is None
    assert float(v) == 2.0
    manager.save()
    assert manager.restore_or_initialize() is not None


def test_manager_fspath_directory(peer, tmp_path):
    """testCheckpointManagerFSpathDirectory"""
    directory = pathlib.Path(tmp_path)
    v = tf.Variable(0.0)
    checkpoint = peer.Checkpoint(v=v)
    manager = peer.Manager(checkpoint, directory, max_to_keep=2, checkpoint_name="ckpt_name")
    save_path = manager.save()
    assert save_path == str(directory / "ckpt_name-1")
    assert manager.restore_or_initialize() == str(directory / "ckpt_name-1")


def test_latest_checkpoint_fspath_directory(peer, tmp_path):
    """testLatestCheckpointFSpathDirectory: tf.train.latest_checkpoint reads the state file,
    which pitstop does not write (deliberate); its manager's latest_checkpoint is the
    counterpart."""
    directory = pathlib.Path(tmp_path)
    checkpoint = peer.Checkpoint()
    manager = peer.Manager(checkpoint, directory, max_to_keep=2, checkpoint_name="ckpt_name")
    manager.save()
    peer.settle(manager)
    if peer.is_pitstop:
        assert tf.train.latest_checkpoint(directory) is None
        assert manager.latest_checkpoint == str(directory / "ckpt_name-1")
    else:
        assert tf.train.latest_checkpoint(directory) == str(directory / "ckpt_name-1")


def test_checkpoint_interval(peer, tmp_path):
    """testCheckpointInterval"""
    v = tf.Variable(1.0)
    step_counter = tf.Variable(0)
    checkpoint = peer.Checkpoint(v=v)
    manager = peer.Manager(checkpoint, str(tmp_path), max_to_keep=None,
                           step_counter=step_counter, checkpoint_interval=2)
    saved = [manager.save(check_interval=True)]  # step 0: an initial checkpoint
    step_counter.assign_add(1)
    saved.append(manager.save(check_interval=True))  # 1: none
    step_counter.assign_add(1)
    saved.append(manager.save(check_interval=True))  # 2: saved
    saved.append(manager.save(check_interval=True))  # 2 again: none
    step_counter.assign_add(1)
    saved.append(manager.save(check_interval=True))  # 3: none
    saved.append(manager.save(check_interval=False))  # always
    peer.settle(manager)
    assert [p is not None and peer.exists(p) for p in saved] == \
        [True, False, True, False, False, True]


def test_checkpoint_interval_with_last_checkpoint_step(peer, tmp_path):
    """testCheckpointIntervalWithLastCheckpointStep"""
    v = tf.Variable(1.0)
    step_counter = tf.Variable(1)
    checkpoint = peer.Checkpoint(v=v)
    manager = peer.Manager(checkpoint, str(tmp_path), max_to_keep=None,
                           step_counter=step_counter, checkpoint_interval=2,
                           last_checkpoint_step=1)
    assert manager.save(check_interval=True) is None
    step_counter.assign_add(1)
    assert manager.save(check_interval=True) is None
    step_counter.assign_add(1)
    path = manager.save(check_interval=True)
    peer.settle(manager)
    assert peer.exists(path)


def test_checkpoint_interval_with_restore(peer, tmp_path):
    """testCheckpointIntervalWithRestore"""
    directory = str(tmp_path)
    v = tf.Variable(1.0)
    step_counter = tf.Variable(0)
    checkpoint = peer.Checkpoint(v=v)
    checkpoint.save(os.path.join(directory, "ckpt"))
    manager = peer.Manager(checkpoint, directory, max_to_keep=None,
                           step_counter=step_counter, checkpoint_interval=2)
    assert manager.restore_or_initialize() is not None
    assert manager.save() is None


# ====================================================================================
# checkpoint_test.py: CheckpointingTests (eager)
# ====================================================================================

class NonLayerTrackable(autotrackable.AutoTrackable):
    def __init__(self):
        super().__init__()
        self.a_variable = add_variable(self, name="a_variable", shape=[])


class _MultiTensor(trackable_base.Trackable):
    """SerializeToTensorTest.MultiTensor: saves two tensors of its own."""

    def __init__(self, v1, v2):
        self.v1, self.v2 = v1, v2

    def _serialize_to_tensors(self):
        return {"v1": self.v1, "v2": self.v2}

    def _restore_from_tensors(self, restored_tensors):
        return tf.group(self.v1.assign(restored_tensors["v1"]),
                        self.v2.assign(restored_tensors["v2"]))


def test_assert_consumed_no_checkpoint(peer, tmp_path):
    """testAssertConsumedNoCheckpoint: the status outlives the checkpoint object."""
    prefix = os.path.join(str(tmp_path), "ckpt")
    v = tf.Variable(0.0)
    ckpt = peer.Checkpoint(v=v)
    save_path = ckpt.save(file_prefix=prefix)
    status = ckpt.restore(save_path=save_path)
    del ckpt
    status.assert_consumed()


def test_deep_copy_checkpoint(peer, tmp_path):
    """testDeepCopyCheckpoint"""
    prefix = os.path.join(str(tmp_path), "ckpt")
    v = tf.Variable(1.0)
    original = peer.Checkpoint(v=v)
    copied = copy.deepcopy(original)
    copied.v.assign(2.0)
    assert float(v) == 1.0
    save_path = copied.save(file_prefix=prefix)
    original.restore(save_path=save_path).assert_consumed()
    assert float(v) == 2.0


def test_passing_checkpoint_options(peer, tmp_path):
    """testPassingCheckpointOptions (options accepted; pitstop has no device placement)"""
    options = tf.train.CheckpointOptions(experimental_io_device="/job:localhost/device:CPU:0")
    prefix = os.path.join(str(tmp_path), "ckpt")
    v = tf.Variable(0.0)
    ckpt = peer.Checkpoint(v=v)
    save_path = ckpt.save(file_prefix=prefix, options=options)
    status = ckpt.restore(save_path=save_path, options=options)
    del ckpt
    status.assert_consumed()


def test_checkpoint_write_custom_numbering(peer, tmp_path):
    """testCustomNumbering (CheckpointingTests): write() at "<prefix>-<step>"."""
    prefix = os.path.join(str(tmp_path), "ckpt")
    step = tf.Variable(0, dtype=tf.int64)
    checkpoint = peer.Checkpoint(step=step)
    for i in range(5):
        path = checkpoint.write(f"{prefix}-{int(step)}")
        assert path.endswith(f"-{2 * i}"), path
        step.assign_add(2)
    peer.settle(checkpoint)
    assert all(peer.exists(f"{prefix}-{2 * i}") for i in range(5))


def _warnings(peer: Peer, caplog, fn) -> str:
    """What ``fn`` warned: tf.train through tf_logging.warning (patched as TensorFlow's test
    does), pitstop through its logger."""
    with mock.patch.object(tf_logging, "warning") as mock_log, caplog.at_level("WARNING"):
        fn()
        gc.collect()
        return str(mock_log.call_args_list) + "\n" + caplog.text



def test_partial_restore_warning_attribute(peer, tmp_path, caplog):
    """testPartialRestoreWarningAttribute: a value nothing took is warned about (naming it
    and expect_partial()) once the restore is released."""
    original_root = peer.Checkpoint(v1=tf.Variable(2.0), v2=tf.Variable(3.0))
    save_path = original_root.save(os.path.join(str(tmp_path), "ckpt"))
    peer.settle(original_root)
    partial_root = peer.Checkpoint(v1=trackable_base.Trackable(), v2=tf.Variable(0.0))
    weak_partial_root = weakref.ref(partial_root)

    def run():
        nonlocal partial_root
        partial_root.restore(save_path)
        assert float(partial_root.v2) == 3.0
        del partial_root
        assert weak_partial_root() is None

    messages = _warnings(peer, caplog, run)
    assert "(root).v1" in messages
    assert "(root).v2" not in messages
    assert "expect_partial()" in messages



def test_attribute_exception(peer, tmp_path):
    """testAttributeException: a value whose object cannot take it fails assert_consumed."""
    original_root = peer.Checkpoint(v1=tf.Variable(2.0), v2=tf.Variable(3.0))
    save_path = original_root.save(os.path.join(str(tmp_path), "ckpt"))
    partial_root = peer.Checkpoint(v1=trackable_base.Trackable(), v2=tf.Variable(0.0))
    status = partial_root.restore(save_path)
    with pytest.raises(AssertionError, match=r"(?s)Unused attributes.*\(root\)\.v1"):
        status.assert_consumed()



def test_silence_partial_warning(peer, tmp_path, caplog):
    """testSilencePartialWarning: expect_partial() silences it, and nothing keeps the
    objects alive."""
    original_root = peer.Checkpoint(v1=tf.Variable(2.0), v2=tf.Variable(3.0))
    save_path = original_root.save(os.path.join(str(tmp_path), "ckpt"))
    peer.settle(original_root)
    partial_root = peer.Checkpoint(v1=tf.Variable(0.0))
    weak_partial_root = weakref.ref(partial_root)
    weak_v1 = weakref.ref(partial_root.v1)
    partial_root.restore(save_path).expect_partial()
    assert float(partial_root.v1) == 2.0

    def run():
        nonlocal partial_root
        del partial_root
        assert weak_partial_root() is None
        assert weak_v1() is None

    messages = _warnings(peer, caplog, run)
    assert "expect_partial" not in messages and "v2" not in messages, messages


@pytest.mark.parametrize("name", [r"a/b/c", r"b", r"c/", r"d/.S", r"d/.ATTRIBUTES/f"])
def test_variable_name_escaping(peer, tmp_path, name):
    """testVariableNameEscaping: the keys tensors are saved at escape '/' and '.'."""
    root = autotrackable.AutoTrackable()
    add_variable(root, name=name, shape=[1, 2], dtype=tf.float64)
    ckpt = peer.Checkpoint(root=root)
    path = ckpt.write(os.path.join(str(tmp_path), "ckpt"))
    peer.settle(ckpt)
    expected = {r"a/b/c": r"a.Sb.Sc", "b": "b", "c/": "c.S", r"d/.S": r"d.S..S",
                r"d/.ATTRIBUTES/f": r"d.S..ATTRIBUTES.Sf"}[name]
    assert keys_of(peer, path) == {expected + "/.ATTRIBUTES/VARIABLE_VALUE"}


def test_numbered_path_and_local_name_validation(peer, tmp_path):
    """testNumberedPath and testLocalNameValidation: keys of nested objects, and a local
    name that looks reserved (escaped, so no conflict)."""
    root = autotrackable.AutoTrackable()
    root.leaf = autotrackable.AutoTrackable()
    add_variable(root.leaf, name="v", shape=[])
    other = autotrackable.AutoTrackable()
    odd = autotrackable.AutoTrackable()
    other._track_trackable(odd, name=".ATTRIBUTES")
    add_variable(trackable=odd, name="a", shape=[])
    p1 = peer.Checkpoint(root=root).write(os.path.join(str(tmp_path), "one"))
    p2 = peer.Checkpoint(root=other).write(os.path.join(str(tmp_path), "two"))
    assert keys_of(peer, p1) == {"leaf/v/.ATTRIBUTES/VARIABLE_VALUE"}
    assert keys_of(peer, p2) == {"..ATTRIBUTES/a/.ATTRIBUTES/VARIABLE_VALUE"}


class _Dependency(autotrackable.AutoTrackable):
    def build(self):
        self.var = add_variable(self, "var", initializer=0.0)


def _late_dependencies(peer):
    class LateDependencies(peer.Checkpoint):
        def add_dep(self):
            self.dep = _Dependency()
            self.dep.build()

    return LateDependencies


def test_late_dependency_tracking(peer, tmp_path):
    """testLateDependencyTracking: a subclass of Checkpoint that adds a dependency after the
    restore; assert_consumed fails until it exists, then its value arrives."""
    LateDependencies = _late_dependencies(peer)
    original = LateDependencies()
    original.add_dep()
    original.dep.var.assign(123.0)
    save_path = original.save(os.path.join(str(tmp_path), "ckpt"))
    load_into = LateDependencies()
    status = load_into.restore(save_path)
    status.assert_existing_objects_matched()
    with pytest.raises(AssertionError):
        status.assert_consumed()
    load_into.add_dep()
    status.assert_consumed()
    status.assert_existing_objects_matched().run_restore_ops()
    assert float(load_into.dep.var) == 123.0


def test_dep_after_var(peer, tmp_path):
    """testDepAfterVar: the dependency's variable exists before it is attached."""
    class DepAfterVar(peer.Checkpoint):
        def add_dep(self):
            dep = _Dependency()
            dep.build()
            self.dep = dep

    dep_after_var = DepAfterVar()
    dep_after_var.add_dep()
    dep_after_var.dep.var.assign(-14.0)
    save_path = dep_after_var.save(os.path.join(str(tmp_path), "ckpt"))
    loaded = DepAfterVar()
    status = loaded.restore(save_path)
    loaded.add_dep()
    status.assert_consumed()
    status.run_restore_ops()
    assert float(loaded.dep.var) == -14.0


def test_overlapping_restores(peer, tmp_path):
    """testOverlappingRestores: two deferred restores into one object; the most recent
    restore() decides the value, whichever is attached last."""
    directory = str(tmp_path)
    save_root = peer.Checkpoint()
    save_root.dep = autotrackable.AutoTrackable()
    save_root.dep.var = add_variable(save_root.dep, name="var", initializer=0.0)
    save_root.dep.var.assign(12.0)
    # each prefix in a directory of its own (see test_root_arg)
    first_path = save_root.save(os.path.join(directory, "a", "first"))
    save_root.dep.var.assign(13.0)
    second_path = save_root.save(os.path.join(directory, "b", "second"))

    def attach(order):
        first_root, second_root = peer.Checkpoint(), peer.Checkpoint()
        statuses = {}
        for which in order:
            root, path = (first_root, first_path) if which == 1 else (second_root, second_path)
            statuses[which] = root.restore(path)
        load_dep = autotrackable.AutoTrackable()
        load_dep.var = add_variable(load_dep, name="var", shape=[])
        out = []
        first_root.dep = load_dep
        statuses[1].assert_consumed().run_restore_ops()
        out.append(float(load_dep.var))
        second_root.dep = load_dep
        statuses[2].assert_consumed().run_restore_ops()
        out.append(float(load_dep.var))
        return out

    assert attach([1, 2]) == [12.0, 13.0]
    assert attach([2, 1]) == [12.0, 12.0]


def test_ambiguous_load(peer, tmp_path):
    """testAmbiguousLoad: one saved object may not be split into two live ones."""
    save_root = peer.Checkpoint()
    save_root.dep_one = autotrackable.AutoTrackable()
    save_root.dep_two = autotrackable.AutoTrackable()
    dep_three = autotrackable.AutoTrackable()
    save_root.dep_one.dep_three = dep_three
    save_root.dep_two.dep_three = dep_three
    add_variable(dep_three, name="var", initializer=0.0)
    save_path = save_root.save(os.path.join(str(tmp_path), "ckpt"))
    load_root = peer.Checkpoint()
    status = load_root.restore(save_path)
    load_root.dep_one = autotrackable.AutoTrackable()
    load_root.dep_two = autotrackable.AutoTrackable()
    load_root.dep_one.dep_three = autotrackable.AutoTrackable()
    load_root.dep_two.dep_three = autotrackable.AutoTrackable()
    add_variable(load_root.dep_one.dep_three, name="var", initializer=0.0)
    add_variable(load_root.dep_two.dep_three, name="var", initializer=0.0)
    with pytest.raises(AssertionError):
        status.assert_consumed()
    with pytest.raises(AssertionError):
        status.assert_existing_objects_matched()


def test_objects_combined(peer, tmp_path):
    """testObjectsCombined: two saved objects may load into one live object."""
    save_root = peer.Checkpoint()
    save_root.dep_one = autotrackable.AutoTrackable()
    save_root.dep_two = autotrackable.AutoTrackable()
    add_variable(save_root.dep_one, name="var1", initializer=32.0, dtype=tf.float64)
    add_variable(save_root.dep_two, name="var2", initializer=64.0, dtype=tf.float64)
    save_path = save_root.save(os.path.join(str(tmp_path), "ckpt"))
    load_root = peer.Checkpoint()
    load_root.dep_one = autotrackable.AutoTrackable()
    load_root.dep_two = load_root.dep_one
    v1 = add_variable(load_root.dep_one, name="var1", shape=[], dtype=tf.float64)
    v2 = add_variable(load_root.dep_one, name="var2", shape=[], dtype=tf.float64)
    status = load_root.restore(save_path).assert_consumed().assert_existing_objects_matched()
    status.run_restore_ops()
    assert float(v1) == 32.0 and float(v2) == 64.0


def test_empty_containers_ignored(peer, tmp_path):
    """testEmptyContainersIgnored (the prefix is the temporary directory itself)."""
    save_root = peer.Checkpoint(a=[])
    path = save_root.save(str(tmp_path))
    load_root = peer.Checkpoint(b=[])
    load_root.dep = []
    load_root.dep.append([])
    status = load_root.restore(path)
    status.assert_consumed()
    status.assert_existing_objects_matched()
    status.assert_nontrivial_match()


def test_dependency_loop(peer, tmp_path):
    """testDependencyLoop: two checkpoints referring to each other, restored deferred and
    then into existing variables."""
    first, second = peer.Checkpoint(), peer.Checkpoint()
    first.second = second
    second.first = first
    first.v = add_variable(first, "v1", initializer=[3.0, 1.0, 4.0])
    second.v = add_variable(second, "v2", initializer=[1.0, 1.0, 2.0, 3.0])
    save_path = first.save(os.path.join(str(tmp_path), "ckpt"))

    first_load = peer.Checkpoint()
    status = first_load.restore(save_path)
    second_load = autotrackable.AutoTrackable()
    first_load.second = second_load
    second_load.first = first_load
    with pytest.raises(AssertionError):
        status.assert_consumed()
    first_load.v = add_variable(first_load, "v1", shape=[3])
    second_load.v = add_variable(second_load, "v2", shape=[4])
    status.assert_consumed()
    status.run_restore_ops()
    assert first_load.v.numpy().tolist() == [3.0, 1.0, 4.0]
    assert second_load.v.numpy().tolist() == [1.0, 1.0, 2.0, 3.0]

    first_load.v.assign([2.0, 7.0, 1.0])
    second_load.v.assign([2.0, 7.0, 1.0, 8.0])
    status = first_load.restore(save_path).assert_consumed()
    status.run_restore_ops()
    assert first_load.v.numpy().tolist() == [3.0, 1.0, 4.0]
    assert second_load.v.numpy().tolist() == [1.0, 1.0, 2.0, 3.0]


def test_restore_on_assign(peer, tmp_path):
    """testRestoreOnAssign: a value waits until its variable is attached."""
    first = peer.Checkpoint()
    first.var1 = tf.Variable(0.0, name="outside_var")
    first.var2 = tf.Variable(0.0, name="blah")
    first.var1.assign(4.0)
    first.var2.assign(8.0)
    save_path = first.save(os.path.join(str(tmp_path), "ckpt"))
    second = peer.Checkpoint()
    second.var2 = tf.Variable(0.0, name="blah")
    status = second.restore(save_path)
    recreated_var1 = tf.Variable(0.0, name="outside_var")
    status.run_restore_ops()
    assert float(second.var2) == 8.0
    recreated_var1.assign(-2.0)
    assert float(recreated_var1) == -2.0
    second.var1 = recreated_var1
    status.run_restore_ops()
    assert float(recreated_var1) == 4.0


def test_checkpoint_state(peer, tmp_path):
    """testCheckpointState: Checkpoint.save deletes nothing. (tf.train also writes its
    `checkpoint` state file; pitstop deliberately does not.)"""
    directory = str(tmp_path)
    prefix = os.path.join(directory, "ckpt")
    obj = autotrackable.AutoTrackable()
    obj.var = tf.Variable(0.0, name="v")
    saver = peer.Checkpoint(obj=obj)
    for _ in range(10):
        saver.save(prefix)
    peer.settle(saver)
    assert all(peer.exists(f"{prefix}-{n}") for n in range(1, 11))
    assert os.path.exists(os.path.join(directory, "checkpoint")) is not peer.is_pitstop


def test_checkpoint_state_changing_var_list(peer, tmp_path):
    """testCheckpointStateChangingVarList: variables added between saves; restoring an
    older checkpoint leaves the newer variables alone."""
    directory = str(tmp_path)
    prefix = os.path.join(directory, "ckpt")
    obj = autotrackable.AutoTrackable()
    obj.var = tf.Variable(0.0, name="v")
    checkpoint = peer.Checkpoint(obj=obj)
    looped = []
    for iteration in range(10):
        new_variable = tf.Variable(iteration)
        setattr(checkpoint, f"var_{iteration}", new_variable)
        checkpoint.save(prefix)
        looped.append(new_variable)
    peer.settle(checkpoint)
    assert all(peer.exists(f"{prefix}-{n}") for n in range(1, 11))
    if peer.is_pitstop:
        assert tf.train.latest_checkpoint(directory) is None  # deliberate: no state file
    else:
        assert tf.train.latest_checkpoint(directory) == prefix + "-10"
    for v in looped:
        v.assign(314)
    checkpoint.restore(prefix + "-6").run_restore_ops()
    assert [int(getattr(checkpoint, f"var_{i}")) for i in (9, 8, 6, 5, 1, 0)] == \
        [314, 314, 314, 5, 1, 0]
    checkpoint.restore(prefix + "-10").run_restore_ops()
    assert [int(getattr(checkpoint, f"var_{i}")) for i in (9, 8, 1, 0)] == [9, 8, 1, 0]


def test_restore_after_adding_empty_trackable_data_structure(peer, tmp_path):
    """test_restore_after_adding_empty_trackable_data_structure"""
    model = NonLayerTrackable()
    checkpoint = peer.Checkpoint(model=model)
    checkpoint.restore(None).initialize_or_restore()
    save_path = checkpoint.save(os.path.join(str(tmp_path), "ckpt"))
    del model, checkpoint
    model = NonLayerTrackable()
    model.dict = {"a": 1}
    model.list = {"b": 1}
    checkpoint = peer.Checkpoint(model=model)
    checkpoint.restore(save_path).assert_existing_objects_matched().run_restore_ops()


def test_initialize_with_data_structures(peer, tmp_path):
    """test_inititialize_with_data_structures"""
    checkpoint = peer.Checkpoint(a=[tf.Variable(0.0), tf.Variable(1.0)],
                                 b={"a": tf.Variable(2.0), "b": tf.Variable(3.0)})
    save_path = checkpoint.save(file_prefix=os.path.join(str(tmp_path), "ckpt"))
    load = peer.Checkpoint(a=[tf.Variable(4.0), tf.Variable(5.0)],
                           b={"a": tf.Variable(6.0), "b": tf.Variable(7.0)})
    load.restore(save_path)
    assert [float(x) for x in load.a] == [0.0, 1.0]
    assert {k: float(x) for k, x in load.b.items()} == {"a": 2.0, "b": 3.0}


class _Model(autotrackable.AutoTrackable):
    def __init__(self):
        self.v = tf.Variable(2.0)

    def __call__(self, x):
        return self.v * x


def test_initialize_with_root_object(peer, tmp_path):
    """test_initialize_with_root_object: a positional root; a variable attached later to
    the new root takes the saved value."""
    model = _Model()
    x = tf.constant([[3.0]])
    expected = model(x).numpy()
    model.deferred_variable = tf.Variable(5.0)
    save_path = peer.Checkpoint(model).save(os.path.join(str(tmp_path), "ckpt"))
    new_model = _Model()
    new_model.v.assign(0.0)
    peer.Checkpoint(new_model).restore(save_path)
    np.testing.assert_allclose(new_model(x).numpy(), expected)
    new_model.deferred_variable = tf.Variable(1.0)
    assert float(new_model.deferred_variable) == 5.0


def test_initialize_with_root_object_and_kwargs(peer, tmp_path):
    """test_initialize_with_root_object_and_kwargs"""
    model = _Model()
    model.v.assign(3.0)
    separate_variable = tf.Variable(5.0)
    with pytest.raises(ValueError, match="root.v already exists"):
        peer.Checkpoint(model, v=separate_variable)
    save_path = peer.Checkpoint(model, separate_variable=separate_variable).save(
        os.path.join(str(tmp_path), "ckpt"))

    # same configuration
    new_model = _Model()
    separate_variable = tf.Variable(1.0)
    load = peer.Checkpoint(new_model, separate_variable=separate_variable)
    load.restore(save_path).assert_consumed()
    assert (float(new_model.v), float(separate_variable), int(load.save_counter)) == (3, 5, 1)

    # v and separate_variable swap between the root object and the keyword arguments
    new_model = autotrackable.AutoTrackable()
    new_model.separate_variable = tf.Variable(200.0)
    v = tf.Variable(100.0)
    load = peer.Checkpoint(new_model, v=v)
    load.restore(save_path).assert_consumed()
    assert (float(v), float(new_model.separate_variable), int(load.save_counter)) == (3, 5, 1)

    # no root object
    separate_variable = tf.Variable(200.0)
    v = tf.Variable(100.0)
    load = peer.Checkpoint(v=v, separate_variable=separate_variable)
    load.restore(save_path).assert_consumed()
    assert (float(v), float(separate_variable), int(load.save_counter)) == (3, 5, 1)



def test_deferred_dependency_avoids_reference_cycles(peer, tmp_path):
    """test_deferred_dependency_avoids_reference_cycles: objects are freed by reference
    counting alone (no cycle through a deferred restore or the checkpoint)."""
    deleted = 0

    class TrackableWithDel(autotrackable.AutoTrackable):
        def __del__(self):
            nonlocal deleted
            deleted += 1

    gc.collect()
    gc.disable()
    try:
        x = autotrackable.AutoTrackable()
        x.v = tf.Variable(100.0)
        x.has_del = TrackableWithDel()
        checkpoint = peer.Checkpoint(x)
        save_path = checkpoint.save(os.path.join(str(tmp_path), "ckpt"))
        peer.settle(checkpoint)
        assert deleted == 0
        del checkpoint, x
        assert deleted == 1
        no_v = autotrackable.AutoTrackable()
        no_v.has_del = TrackableWithDel()
        checkpoint = peer.Checkpoint(no_v)
        checkpoint.restore(save_path).expect_partial()
        del checkpoint, no_v
        assert deleted == 2
    finally:
        gc.enable()


def test_root_arg(peer, tmp_path):
    """test_root_arg: root= plus keyword children, restored crosswise by name."""
    root = autotrackable.AutoTrackable()
    root.v = tf.Variable(1)
    w, y = tf.Variable(2), tf.Variable(3)
    root_ckpt = peer.Checkpoint(root=root, w=w, y=y)
    root2 = autotrackable.AutoTrackable()
    root2.w = tf.Variable(4)
    v2, z = tf.Variable(5), tf.Variable(6)
    root2_ckpt = peer.Checkpoint(root=root2, v=v2, z=z)
    # each prefix in a directory of its own: a pitstop directory keeps one naming
    # (see test_continue_from_unmanaged)
    root_path = root_ckpt.save(os.path.join(str(tmp_path), "a", "root_ckpt"))
    root2_path = root2_ckpt.save(os.path.join(str(tmp_path), "b", "root2_ckpt"))
    root_ckpt.restore(root2_path)
    root2_ckpt.restore(root_path)
    assert [int(t) for t in (root.v, w, y, root2.w, v2, z)] == [5, 4, 3, 2, 1, 6]


def test_weakref_root(peer, tmp_path):
    """test_weakref_root: a checkpoint given a weak reference keeps nothing alive."""
    root = autotrackable.AutoTrackable()
    root.v = tf.Variable(1)
    ref = root.v.ref()
    ckpt = peer.Checkpoint(root=weakref.ref(root))
    save_path = ckpt.save(os.path.join(str(tmp_path), "ckpt"))
    root.v.assign(2)
    ckpt.restore(save_path)
    restored = int(root.v.numpy())
    del root
    gc.collect()
    count = sys.getrefcount(ref.deref())
    assert restored == 1
    assert count == 2, gc.get_referrers(ref.deref())


def test_restore_incompatible_shape(peer, tmp_path):
    """test_restore_incompatible_shape. Deliberate difference (docs/tf.md): pitstop refuses
    with IncompatibleTargetError naming the key, before anything is written, where tf.train
    raises ValueError."""
    v = tf.Variable([1.0, 1.0])
    w = tf.Variable([1.0])
    save_path = peer.Checkpoint(v=v).save(os.path.join(str(tmp_path), "ckpt"))
    if peer.is_pitstop:
        with pytest.raises(pitstop.IncompatibleTargetError, match="v/.ATTRIBUTES"):
            peer.Checkpoint(v=w).restore(save_path)
    else:
        with pytest.raises(ValueError, match="incompatible tensor with shape"):
            peer.Checkpoint(v=w).restore(save_path)
    assert w.numpy().tolist() == [1.0]


def test_save_restore_fspath(peer, tmp_path):
    """test_save_restore_fspath (the restored variable is checked too)"""
    v, w = tf.Variable(1.0), tf.Variable(0.0)
    ckpt = peer.Checkpoint(v=v)
    save_path = pathlib.Path(ckpt.save(pathlib.Path(tmp_path) / "ckpt"))
    peer.Checkpoint(v=w).restore(save_path)
    assert float(ckpt.v) == 1.0 and float(w) == 1.0


def test_read_write_fspath(peer, tmp_path):
    """test_read_write_fspath (the read variable is checked too)"""
    v, w = tf.Variable(1.0), tf.Variable(0.0)
    ckpt = peer.Checkpoint(v=v)
    save_path = pathlib.Path(ckpt.write(pathlib.Path(tmp_path) / "ckpt"))
    peer.Checkpoint(v=w).read(save_path)
    assert float(ckpt.v) == 1.0 and float(w) == 1.0


def test_ckpt_files_closed_after_restoration(peer, tmp_path):
    """test_ckpt_files_closed_after_restoration"""
    psutil = pytest.importorskip("psutil")
    root = autotrackable.AutoTrackable()
    root.v = tf.Variable(1)
    save_path = peer.Checkpoint(root=root).save(os.path.join(str(tmp_path), "ckpt"))
    peer.Checkpoint(root=autotrackable.AutoTrackable()).restore(save_path)
    for f in psutil.Process().open_files():
        assert save_path not in f.path


def test_more_complex_saveable_returned(peer, tmp_path):
    """testMoreComplexSaveableReturned: an object saved through the legacy SaveableObject
    API (_gather_saveables_for_checkpoint). Deliberate difference: pitstop captures
    TensorFlow's current API (_serialize_to_tensors) only and says so at the save with
    UnsupportedStateError; tf.train restores both mirrored variables."""
    from tensorflow.python.training import saver as saver_lib

    class MirroringSaveable(saver_lib.BaseSaverBuilder.SaveableObject):
        def __init__(self, primary, mirrored, name):
            self._primary, self._mirrored = primary, mirrored
            tensor = primary.read_value()
            spec = saver_lib.BaseSaverBuilder.SaveSpec(tensor=tensor, slice_spec="", name=name)
            super().__init__(tensor, [spec], name)

        def restore(self, restored_tensors, restored_shapes):
            (tensor,) = restored_tensors
            return tf.group(self._primary.assign(tensor), self._mirrored.assign(tensor))

    class OwnsMirroredVariables(trackable_base.Trackable):
        def __init__(self):
            self.non_dep_variable = tf.Variable(6.0, name="non_dep_variable")
            self.mirrored = tf.Variable(15.0, name="mirrored")

        def _gather_saveables_for_checkpoint(self):
            def factory(name=self.non_dep_variable.name):
                return MirroringSaveable(self.non_dep_variable, self.mirrored, name)
            return {trackable_base.VARIABLE_VALUE_KEY: factory}

        @property
        def name(self):
            return self.non_dep_variable.name

    v = OwnsMirroredVariables()
    checkpoint = peer.Checkpoint(v=v)
    prefix = os.path.join(str(tmp_path), "ckpt")
    v.non_dep_variable.assign(42.0)
    if peer.is_pitstop:
        with pytest.raises(pitstop.UnsupportedStateError, match="SaveableObject"):
            checkpoint.save(file_prefix=prefix)
        return
    save_path = checkpoint.save(file_prefix=prefix)
    v.non_dep_variable.assign(43.0)
    v.mirrored.assign(44.0)
    checkpoint.restore(save_path).assert_consumed().initialize_or_restore()
    assert (float(v.non_dep_variable), float(v.mirrored)) == (42.0, 42.0)


# ====================================================================================
# checkpoint_test.py: SerializeToTensorTest (eager)
# ====================================================================================


def test_keys_and_metadata(peer, tmp_path):
    """SerializeToTensorTest.test_keys_and_metadata: an object saving tensors of its own
    (the root and a child), at TensorFlow's keys, restored through _restore_from_tensors.
    (TensorFlow's object_metadata proto is read for tf.train only.)"""
    root = _MultiTensor(tf.Variable(1), tf.Variable(2))
    child = _MultiTensor(tf.Variable(3), tf.Variable(4))
    ckpt = peer.Checkpoint(root=root, child=child)
    save_path = ckpt.save(os.path.join(str(tmp_path), "ckpt"))
    peer.settle(ckpt)
    keys = keys_of(peer, save_path)
    assert {"/.ATTRIBUTES/v1", "/.ATTRIBUTES/v2", "child/.ATTRIBUTES/v1",
            "child/.ATTRIBUTES/v2"} <= keys
    if not peer.is_pitstop:
        reader = tf.train.load_checkpoint(save_path)
        assert [int(reader.get_tensor(k)) for k in ("/.ATTRIBUTES/v1", "child/.ATTRIBUTES/v2")] \
            == [1, 4]
    for t in (root.v1, root.v2, child.v1, child.v2):
        t.assign(0)
    ckpt.restore(save_path).assert_consumed().run_restore_ops()
    assert [int(t) for t in (root.v1, root.v2, child.v1, child.v2)] == [1, 2, 3, 4]
