"""Keras's own ``.keras`` and ``.weights.h5`` files, written from an in-memory snapshot.

:func:`snapshot` runs Keras's save traversal on the training thread into a recording store
that copies each value (the only part ``fit()`` waits for); :func:`write` replays it into
Keras's own H5 store on a background thread, so the file is byte for byte the layout
``model.save`` / ``model.save_weights`` write and ``keras.models.load_model`` /
``model.load_weights`` open. A file appears atomically (temporary file, fsync, rename), and an
integrity record (``<file>.pitstop``: size and hash) is written beside it
(:mod:`pitstop.core.storage.sidecar` does both); :func:`verify_file` checks one. Where Keras's private saving internals are not what this module expects (another
Keras version), the snapshot steps aside and the file is saved by Keras itself, still
atomically.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np

from pitstop.adapters.keras._leaf import _host
from pitstop.core.storage.sidecar import (
    remove_with_record,
    verify_with_record,
    write_with_record,
)

RECORD_SUFFIX = ".pitstop"
_RECORD_FORMAT = "pitstop-file-integrity"
_WRITER = "pitstop's ModelCheckpoint"  # (names the writer where a file has no record)

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
        # (made just now by write_with_record: reopened without following a symlink)
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


def write(snap: Snapshot, filepath: str, info: dict[str, Any] | None = None) -> None:
    """Write ``snap`` to ``filepath`` atomically, then its integrity record beside it.

    A reader sees the previous file or the new one, never part of one; the old record is
    removed before the new file replaces the old, so a record never vouches for other bytes.
    """
    write_with_record(filepath, lambda tmp: _write_tmp(snap, tmp), record_suffix=RECORD_SUFFIX,
                      record_format=_RECORD_FORMAT, info=info, keep=(".weights.h5",))


def verify_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Check a file pitstop's ``ModelCheckpoint`` wrote against its integrity record.

    Returns the record (size, hash, epoch, batch, logs); raises
    :class:`pitstop.CorruptCheckpointError` when the bytes differ from what was written (or
    the record is damaged), and :class:`pitstop.CheckpointNotFoundError` when the file or
    its record is missing. A file being replaced meanwhile (a best-only checkpoint saved
    again) is read again, not reported as damaged.
    """
    return verify_with_record(path, record_suffix=RECORD_SUFFIX, record_format=_RECORD_FORMAT,
                              writer_name=_WRITER)


def remove(filepath: str) -> None:
    """Delete a file this module wrote and its record (retention)."""
    remove_with_record(filepath, record_suffix=RECORD_SUFFIX)
