"""Reading native TensorFlow checkpoints (``<prefix>.index`` + ``<prefix>.data-*``), so a run
moves to pitstop with ``Checkpoint.restore(tf_path)`` and its next ``save``."""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import tensorflow as tf
from google.protobuf.message import DecodeError
from tensorflow.core.protobuf import trackable_object_graph_pb2

from pitstop.adapters.tf import _graph
from pitstop.core.errors import CorruptCheckpointError, UnsupportedFormatError

log = logging.getLogger("pitstop")
GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"


def read_native(prefix: str) -> dict[str, Any]:
    """The saved tree (as :func:`pitstop.adapters.tf._graph.capture` builds it) of the native
    TensorFlow checkpoint at ``prefix``."""
    try:
        reader = tf.train.load_checkpoint(prefix)
        dtypes = reader.get_variable_to_dtype_map()
    except _READ_ERRORS as e:
        raise _unreadable(prefix, None, e) from e
    if GRAPH_KEY not in dtypes:
        raise UnsupportedFormatError(
            f"{prefix} is a name-based (TF1 tf.compat.v1.train.Saver) checkpoint without an "
            "object graph; restore it with tf.compat.v1 and save it again with tf.train."
            "Checkpoint first")
    proto = trackable_object_graph_pb2.TrackableObjectGraph()
    try:
        proto.ParseFromString(reader.get_tensor(GRAPH_KEY))
    except (*_READ_ERRORS, DecodeError) as e:
        raise _unreadable(prefix, GRAPH_KEY, e) from e
    graph: list[list[Any]] = []
    for node in proto.nodes:
        kids = [[c.local_name, int(c.node_id)] for c in node.children]
        attrs = []
        for a in node.attributes:
            if a.checkpoint_key in dtypes:
                parts = [(a.name, "", a.checkpoint_key)]
            else:
                # a legacy-named saveable (a tf.data iterator's "ITERATOR"): its tensors are
                # stored under the key plus each tensor's own name ("ITERATOR_STATE")
                parts = [(a.name + k[len(a.checkpoint_key):], k[len(a.checkpoint_key):], k)
                         for k in sorted(dtypes) if k.startswith(a.checkpoint_key)]
            if not parts:
                raise CorruptCheckpointError(
                    f"{prefix}: the object graph names {a.checkpoint_key!r} but the checkpoint "
                    "holds no such tensor", checkpoint=prefix, key=a.checkpoint_key)
            for name, tname, key in parts:
                dt = dtypes[key]
                kind = ("variable" if name == _graph.VARIABLE_VALUE else
                        f"serialized:{dt.name}" if dt in (tf.variant, tf.string) else "tensor")
                attrs.append([name, tname, kind, key])
        entry: list[Any] = [kids, attrs]
        if node.slot_variables:  # a tf.compat.v1.train optimizer's (Adam's m and v)
            entry.append([[r.slot_name, int(r.original_variable_node_id),
                           int(r.slot_variable_node_id)] for r in node.slot_variables])
        graph.append(entry)
    tree: dict[str, Any] = {}
    keys = _graph.saved_keys(graph)
    for sid, (_kids, attrs, *_slots) in enumerate(graph):
        if not attrs:
            continue
        node = tree
        for c in keys[sid]:
            node = node.setdefault(c, {})
        values = node.setdefault(_graph.ATTRIBUTES, {})
        for attr in attrs:
            name, _t, kind, key = attr
            values[name] = _read(prefix, reader, key, kind, dtypes[key])
            del attr[3]
    tree[_graph.GRAPH] = graph
    return tree


#: what TensorFlow's checkpoint reader raises for a missing, truncated or corrupt file (the
#: reader turns a short read into an IndexError, a failed checksum into an OpError)
_READ_ERRORS = (tf.errors.OpError, ValueError, IndexError, RuntimeError, OSError)


def _unreadable(prefix: str, key: str | None, e: BaseException) -> CorruptCheckpointError:
    what = f"tensor {key!r} of " if key else ""
    return CorruptCheckpointError(
        f"{prefix}: TensorFlow cannot read {what}this checkpoint ({type(e).__name__}: "
        f"{getattr(e, 'message', e)}); its .index and .data-* files are missing, truncated "
        "or corrupt: restore an intact copy", checkpoint=prefix, key=key)


def _read(prefix: str, reader: Any, key: str, kind: str, dtype: tf.DType) -> np.ndarray:
    try:
        if kind.startswith("serialized:"):
            (t,) = tf.raw_ops.RestoreV2(prefix=prefix, tensor_names=[key],
                                       shape_and_slices=[""], dtypes=[dtype])
            return np.frombuffer(tf.io.serialize_tensor(t).numpy(), np.uint8).copy()
        value = reader.get_tensor(key)
    except _READ_ERRORS as e:
        raise _unreadable(prefix, key, e) from e
    return np.asarray(value, dtype=np.dtype(dtype.as_numpy_dtype))


def is_native(path: str) -> bool:
    """Whether ``path`` is the prefix of a native TensorFlow checkpoint."""
    return os.path.exists(path + ".index")


def _save_counter(tree: dict[str, Any]) -> int | None:
    """The ``save_counter`` a ``tf.train.Checkpoint`` recorded in the tree, if any."""
    node = tree.get("save_counter")
    try:
        value = node[_graph.ATTRIBUTES][_graph.VARIABLE_VALUE]  # type: ignore[index]
        return int(np.asarray(value))
    except (KeyError, TypeError, ValueError):
        return None


def import_native(prefix: str | os.PathLike[str], directory: str | os.PathLike[str],
                  step: int | None = None, *, key: str | None = None,
                  metrics: dict[str, Any] | None = None) -> int:
    """Import the native TensorFlow checkpoint at ``prefix`` (``<prefix>.index`` beside it)
    as committed pitstop checkpoint ``step`` of ``directory``: the tree
    :func:`read_native` reads, as a live save of a ``pitstop.adapters.tf.Checkpoint`` of the
    same objects would hold it. ``step`` defaults to the checkpoint's ``save_counter`` (0
    without one). A new ``directory`` names its checkpoints ``ckpt-<step>`` as
    tf.train does, so ``pitstop.adapters.tf.Checkpoint(...).restore(f"{directory}/ckpt-{step}")``
    and a ``pitstop.adapters.tf.CheckpointManager`` on it resume from the import. ``key``
    imports one entry of the tree. Returns the step; raises
    :class:`pitstop.StepExistsError` when ``directory`` has that step already."""
    from pitstop.core.errors import StepExistsError
    from pitstop.core.manager import CheckpointManager
    from pitstop.core.tree import select

    source = os.fspath(prefix)
    tree = read_native(source)
    if step is None:
        step = _save_counter(tree) or 0
    target = os.fspath(directory)
    # (read-only: an encrypted directory's key comes from PITSTOP_ENCRYPTION_KEY; a URL's
    # directory is looked up in its store, a path's on disk)
    reader = CheckpointManager(target, read_only=True, save_on_signals=None)
    try:
        fresh = not reader.directory_id  # no .pitstop/directory.json yet
        exists = step in reader.all_steps()
        encryption = reader.encryption
    finally:
        reader.close()
    if exists:
        raise StepExistsError(
            f"{target} already has a checkpoint of step {step}; pitstop never overwrites "
            "one: import under another step, into another directory, or delete it first")
    naming = {"step_prefix": "ckpt-", "step_digits": 0} if fresh else {}
    mgr = CheckpointManager(target, async_save=False, save_on_signals=None, memory_tier=False,
                            encryption=encryption, **naming)  # type: ignore[arg-type]
    try:
        mgr.save(step, select(tree, key, source), metrics).wait()
    finally:
        mgr.close()
    return step
