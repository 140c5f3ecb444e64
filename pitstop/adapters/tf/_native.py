"""tf.train's own checkpoints in a directory a pitstop manager writes (a run that changed
only its import): which native checkpoints a prefix has, what tf.train's ``checkpoint``
state file says of them, and the two things tf.train's manager does to them (delete the old
ones its sweep drops, keep the ``checkpoint`` file naming the newest).

A native checkpoint ``<dir>/<name>-<N>`` is the pair ``<dir>/<name>-<N>.index`` +
``<dir>/<name>-<N>.data-*``; a pitstop one is the directory ``<dir>/<name>-<N>/``. They share
the numbering of one prefix, so a path names one of them at most: pitstop removes the native
files of a number before it writes that number again (tf.train overwrites them too)."""

from __future__ import annotations

import glob
import logging
import os
import re
from typing import Any

import tensorflow as tf
from tensorflow.python.checkpoint import checkpoint_management

log = logging.getLogger("pitstop")

#: tf.train's state file in a checkpoint directory
STATE_FILE = "checkpoint"


def steps(directory: str, name: str) -> set[int]:
    """The numbers N of the native checkpoints ``<directory>/<name>N`` (``name`` ends with
    ``-``) on disk."""
    pattern = re.compile(re.escape(name) + r"(0|[1-9]\d*)\.index$")
    try:
        entries = os.listdir(directory)
    except OSError:
        return set()
    return {int(m.group(1)) for e in entries if (m := pattern.match(e))}


def exists(prefix: str) -> bool:
    """Whether ``prefix`` is a native TensorFlow checkpoint (its ``.index`` is there)."""
    return os.path.exists(prefix + ".index")


def state(directory: str, name: str) -> dict[str, Any] | None:
    """What tf.train's ``checkpoint`` file in ``directory`` says of the checkpoints named
    ``<name>N`` that are still on disk, as pitstop's manager state (``latest``,
    ``managed`` [[N, time]...], ``last_preserved``); None without a state file or without
    a native checkpoint of that name.

    The file is shared by every prefix of the directory (tf.train keeps one per directory):
    its newest entry may be another prefix's, so ``latest`` is its newest of this one."""
    if not os.path.exists(os.path.join(directory, STATE_FILE)):
        return None
    try:
        st = tf.train.get_checkpoint_state(directory)
    except (tf.errors.OpError, ValueError, OSError) as e:  # a malformed text proto
        log.warning("pitstop: cannot read tf.train's state file %s (%s); its native "
                    "checkpoints are not resumed from", os.path.join(directory, STATE_FILE), e)
        return None
    if st is None:
        return None
    on_disk = steps(directory, name)

    def number(path: str) -> int | None:
        # (get_checkpoint_state joined a relative path to the directory already)
        head, base = os.path.split(os.path.abspath(path))
        if head != os.path.abspath(directory) or not base.startswith(name):
            return None
        rest = base[len(name):]
        if not re.fullmatch(r"0|[1-9]\d*", rest) or int(rest) not in on_disk:
            return None
        return int(rest)

    last = float(st.last_preserved_timestamp)
    stamps = list(st.all_model_checkpoint_timestamps) or [last] * len(
        st.all_model_checkpoint_paths)
    managed = [[n, float(t)]
               for p, t in zip(st.all_model_checkpoint_paths, stamps, strict=False)
               if (n := number(p)) is not None]
    latest = number(st.model_checkpoint_path)
    if latest is None and managed:
        latest = managed[-1][0]
    if latest is None and not managed:
        if not on_disk or exists(st.model_checkpoint_path):
            return None  # the file names another prefix's checkpoint, which is there
        # the file names checkpoints that are not there: written with absolute paths
        # (save_relative_paths=False, TF1's Saver) in a directory since moved or copied.
        # tf.train's restore then fails on the stale path; a fresh start here would write
        # over tf.train's checkpoint 1. Resume from the newest one on disk, loudly, and
        # manage none of them (nothing tf.train did not drop is deleted).
        log.warning(
            "pitstop: tf.train's state file %s names %s, which is not there (a directory "
            "moved after tf.train wrote absolute paths?); resuming from the newest "
            "checkpoint of that name on disk, %s%d, and deleting none of the native ones",
            os.path.join(directory, STATE_FILE), st.model_checkpoint_path, name,
            max(on_disk))
        return {"latest": max(on_disk), "managed": [], "last_preserved": last}
    return {"latest": latest, "managed": managed, "last_preserved": last}


def delete(prefix: str) -> None:
    """Delete the native checkpoint at ``prefix`` (its ``.index`` and ``.data-*`` files), as
    tf.train's manager deletes one its sweep drops. A file that cannot be deleted is left
    with a warning (the next sweep does not come back to it)."""
    for path in [prefix + ".index", *glob.glob(glob.escape(prefix) + ".data-?????-of-?????")]:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("pitstop: could not delete %s of the native checkpoint %s: %s", path,
                        prefix, e)


def has_state_file(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, STATE_FILE))


def record(directory: str, latest: str, managed: list[tuple[str, float]],
           last_preserved: float) -> None:
    """Rewrite tf.train's ``checkpoint`` file in ``directory`` as tf.train's manager would
    after the save of ``latest``, so ``tf.train.latest_checkpoint(directory)`` names the
    newest checkpoint of the mixed directory rather than the last native one."""
    try:
        checkpoint_management.update_checkpoint_state_internal(
            directory, model_checkpoint_path=latest,
            all_model_checkpoint_paths=[p for p, _t in managed] or [latest],
            all_model_checkpoint_timestamps=[t for _p, t in managed] or None,
            last_preserved_timestamp=last_preserved, save_relative_paths=True)
    except (tf.errors.OpError, OSError, ValueError) as e:
        log.warning("pitstop: could not update tf.train's state file %s (%s): "
                    "tf.train.latest_checkpoint(%r) may name an older checkpoint",
                    os.path.join(directory, STATE_FILE), e, directory)
