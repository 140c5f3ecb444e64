"""Keras's own ``.keras`` and ``.weights.h5`` files, written from an in-memory snapshot.

:func:`snapshot` runs Keras's save traversal on the training thread into a recording store
that copies each value (the only part ``fit()`` waits for); :func:`write` replays it into
Keras's own H5 store on a background thread, so the file is byte for byte the layout
``model.save`` / ``model.save_weights`` write and ``keras.models.load_model`` /
``model.load_weights`` open. A file appears atomically (temporary file, fsync, rename), and an
integrity record (``<file>.pitstop``: size and hash) is written beside it; :func:`verify_file`
checks one. Where Keras's private saving internals are not what this module expects (another
Keras version), the snapshot steps aside and the file is saved by Keras itself, still
atomically.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import secrets
import shutil
import time
import zipfile
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np

from pitstop.adapters.keras._leaf import _host
from pitstop.core.errors import CheckpointNotFoundError, CorruptCheckpointError
from pitstop.core.format.hashing import DEFAULT, new_hasher
from pitstop.core.storage.local import fsync_dir

RECORD_SUFFIX = ".pitstop"
_RECORD_FORMAT = "pitstop-file-integrity"
_tmp_ids = itertools.count()

try:  # Keras's saving internals (private): the fast path needs them, the fallback does not
    from keras.src.saving import saving_lib as _lib

    _BASE_STORE: Any = _lib.H5IOStore
except Exception:  # pragma: no cover - another Keras layout
    _lib = None
    _BASE_STORE = object


def _copy(value: Any) -> np.ndarray:
    if isinstance(value, keras.Variable):
        value = value.value
    try:
        a = _host(value)
    except Exception:
        a = np.asarray(keras.ops.convert_to_numpy(value))
    return np.array(a, copy=True)


class _Recorder(_BASE_STORE):  # type: ignore[misc, valid-type]
    """An H5 store that writes nothing: it keeps ``(path, metadata, [(key, copy)])`` in order."""

    def __init__(self) -> None:  # no file: the base class's __init__ would open one
        self.mode = "w"
        self.entries: list[tuple[str, dict[str, Any] | None, list[tuple[str, np.ndarray]]]] = []
        self._items: list[tuple[str, np.ndarray]] = []

    def __bool__(self) -> bool:
        return True

    def make(self, path: str, metadata: dict[str, Any] | None = None) -> _Recorder:
        self._items = []
        self.entries.append((path, dict(metadata) if metadata else None, self._items))
        return self

    def __setitem__(self, key: str, value: Any) -> None:
        self._items.append((str(key), _copy(value)))

    def __getitem__(self, key: str) -> np.ndarray:
        return dict(self._items)[key]

    def __contains__(self, key: object) -> bool:
        return any(k == key for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list[str]:
        return [k for k, _ in self._items]

    def close(self) -> None:
        pass


@dataclass
class Snapshot:
    """What one save of a model holds: Keras's entries, copied, or the model itself (fallback)."""

    weights_only: bool
    entries: list[Any] = field(default_factory=list)
    config_json: str = ""
    metadata_json: str = ""
    assets: Any = None  # a DiskIOStore holding the assets (files), for a .keras archive
    model: Any = None  # set when Keras saves the file itself (the fallback)
    nbytes: int = 0


def snapshot(model: Any, filepath: str, weights_only: bool) -> Snapshot:
    """Copy what a save of ``model`` to ``filepath`` writes (the training thread's part)."""
    legacy = not weights_only and not filepath.endswith(".keras")
    if _lib is None or legacy:
        return Snapshot(weights_only, model=model)
    rec = _Recorder()
    assets = None
    try:
        if not weights_only:
            config_json, metadata_json = _lib._serialize_model_as_json(model)
            assets = _lib.DiskIOStore(_lib._ASSETS_DIRNAME, mode="w")
        else:
            config_json = metadata_json = ""
        _lib._save_state(model, weights_store=rec, assets_store=assets, inner_path="",
                         visited_saveables=set())
    except (AttributeError, TypeError, ValueError):
        if assets is not None:
            assets.close()
        # Keras's internals differ from what the fast path knows: Keras saves the file
        return Snapshot(weights_only, model=model)
    n = sum(a.nbytes for _, _, items in rec.entries for _, a in items)
    return Snapshot(weights_only, rec.entries, config_json, metadata_json, assets, nbytes=n)


def _replay(snap: Snapshot, store: Any) -> None:
    try:
        for path, metadata, items in snap.entries:
            store.make(path, metadata=metadata)
            for key, value in items:
                store[key] = value
    finally:
        store.close()


def _write_tmp(snap: Snapshot, tmp: str) -> None:
    if snap.model is not None:
        if snap.weights_only:
            snap.model.save_weights(tmp, overwrite=True)
        else:
            snap.model.save(tmp, overwrite=True)
        return
    if snap.weights_only:
        _replay(snap, _lib.H5IOStore(tmp, mode="w"))
        return
    try:
        # (made just now by _create_tmp: reopened without following a symlink)
        fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "wb") as f, zipfile.ZipFile(f, "w") as zf:
            with zf.open(_lib._METADATA_FILENAME, "w") as m:
                m.write(snap.metadata_json.encode())
            with zf.open(_lib._CONFIG_FILENAME, "w") as c:
                c.write(snap.config_json.encode())
            _replay(snap, _lib.H5IOStore(_lib._VARS_FNAME_H5, archive=zf, mode="w"))
            _lib._write_to_zip_recursively(zf, snap.assets.working_dir, snap.assets.root_path)
    finally:
        snap.assets.close()


def _tmp_name(filepath: str) -> str:
    """A temporary beside ``filepath`` whose name nobody can predict: the folder may be
    shared (/tmp), and a symlink another user planted at a name made of the pid and a
    counter had the write go through it into a file of the victim's. Digits only after
    the pid (remove_stale_temporaries parses the name); the counter keeps names unique."""
    d, base = os.path.split(filepath)
    ext = ".weights.h5" if base.endswith(".weights.h5") else os.path.splitext(base)[1]
    token = f"{next(_tmp_ids)}{secrets.randbelow(10**12):012d}"
    return os.path.join(d, f".{base}.{os.getpid()}-{token}.pitstop-tmp{ext}")


def _create_tmp(path: str) -> None:
    """Create ``path`` new (never an existing file, never through a symlink): Keras then
    writes into this user's own file (the umask decides its mode, as for Keras's save)."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o666))


_TMP = re.compile(r"^\..+\.(\d+)-\d+\.pitstop-tmp")


def remove_stale_temporaries(directory: str) -> list[str]:
    """Delete the temporary files of writers that died (SIGKILL mid-write) in ``directory``;
    a live process's files are left alone. Returns the names removed."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _TMP.match(name)
        if not m or _alive(int(m.group(1))):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _hash_file(path: str, algorithm: str = DEFAULT) -> tuple[int, str]:
    """Size and hex digest of a file, read in 4 MiB pieces."""
    h = new_hasher(algorithm)
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
    return size, str(h.hexdigest())


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(snap: Snapshot, filepath: str, info: dict[str, Any] | None = None) -> None:
    """Write ``snap`` to ``filepath`` atomically, then its integrity record beside it.

    A reader sees the previous file or the new one, never part of one; the old record is
    removed before the new file replaces the old, so a record never vouches for other bytes.
    """
    filepath = os.path.abspath(filepath)
    d = os.path.dirname(filepath)
    os.makedirs(d, exist_ok=True)
    tmp = _tmp_name(filepath)
    record = filepath + RECORD_SUFFIX
    created = False
    try:
        _create_tmp(tmp)
        created = True
        _write_tmp(snap, tmp)
        size, digest = _hash_file(tmp)
        _fsync_file(tmp)
        if os.path.lexists(record):
            os.unlink(record)
        os.replace(tmp, filepath)
    except BaseException:
        if created and os.path.lexists(tmp):  # (only ours: never a file in the way)
            os.unlink(tmp)
        raise
    body = {"format": _RECORD_FORMAT, "version": 1, "file": os.path.basename(filepath),
            "bytes": size, "hash": {"algorithm": DEFAULT, "digest": digest},
            "created_unix": time.time(), **(info or {})}
    rtmp = _tmp_name(record)
    with os.fdopen(os.open(rtmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                           | os.O_CLOEXEC, 0o666), "w") as f:
        json.dump(body, f, indent=1, default=float)
        f.flush()
        os.fsync(f.fileno())
    os.replace(rtmp, record)
    fsync_dir(d)


def verify_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Check a file pitstop's ``ModelCheckpoint`` wrote against its integrity record.

    Returns the record (size, hash, epoch, batch, logs); raises
    :class:`pitstop.CorruptCheckpointError` when the bytes differ from what was written (or
    the record is damaged), and :class:`pitstop.CheckpointNotFoundError` when the file or
    its record is missing. A file being replaced meanwhile (a best-only checkpoint saved
    again) is read again, not reported as damaged.
    """
    path = os.fspath(path)
    record = path + RECORD_SUFFIX
    for _ in range(5):
        if not os.path.exists(path):
            raise CheckpointNotFoundError(f"{path}: no such file")
        body = _read_record(path, record)
        size, digest = _hash_with(path, record, body)
        if _read_record(path, record) != body:
            continue  # replaced by a newer save while it was read: check the new one
        if size != body["bytes"] or digest != body["hash"]["digest"]:
            raise CorruptCheckpointError(
                f"{path} does not match its integrity record ({size} bytes, record says "
                f"{body['bytes']}; the hash differs): the file was changed or damaged after "
                "it was written; use an earlier checkpoint", checkpoint=path, file=path)
        return body
    raise CorruptCheckpointError(
        f"{path} kept changing while it was verified (saved again and again?); verify it "
        "once training stopped writing it", checkpoint=path, file=path)


def _read_record(path: str, record: str) -> dict[str, Any]:
    try:
        with open(record) as f:
            body = json.load(f)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{path} has no integrity record ({os.path.basename(record)}): it was not written "
            "by pitstop's ModelCheckpoint, or its writer was killed between the file and the "
            "record; the file itself is complete (files appear whole or not at all)") from None
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{record}: unreadable integrity record ({e})",
                                     file=record) from None
    h = body.get("hash") if isinstance(body, dict) else None
    if not isinstance(body, dict) or body.get("format") != _RECORD_FORMAT \
            or not isinstance(h, dict) or not isinstance(h.get("digest"), str) \
            or not isinstance(body.get("bytes"), int):
        raise CorruptCheckpointError(f"{record} is not a valid pitstop integrity record",
                                     file=record)
    return body


def _hash_with(path: str, record: str, body: dict[str, Any]) -> tuple[int, str]:
    algorithm = str(body["hash"].get("algorithm", DEFAULT))
    try:
        new_hasher(algorithm)
    except ValueError as e:
        raise CorruptCheckpointError(f"{record}: {e}", file=record) from None
    return _hash_file(path, algorithm)


def remove(filepath: str) -> None:
    """Delete a file this module wrote and its record (retention)."""
    for p in (filepath, filepath + RECORD_SUFFIX):
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.unlink(p)
        except FileNotFoundError:
            pass
