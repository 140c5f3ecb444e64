"""One file written atomically beside an integrity record, for faces that write a peer's own
file format (Keras's ``.keras``): the face fills a temporary file, this module makes it appear
whole (fsync, rename) and writes the record (size and hash) that :func:`verify_with_record`
checks.

A temporary's name nobody can predict, created ``O_EXCL | O_NOFOLLOW`` (the folder may be
shared); :func:`remove_stale_temporaries` deletes those of writers that died mid-write.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable
from typing import Any

from pitstop.core.errors import CheckpointNotFoundError, CorruptCheckpointError
from pitstop.core.format.hashing import DEFAULT, new_hasher
from pitstop.core.storage.posix import fsync_dir

__all__ = ["write_with_record", "verify_with_record", "remove_with_record",
           "remove_stale_temporaries"]

_tmp_ids = itertools.count()


def _tmp_name(filepath: str, keep: tuple[str, ...] = ()) -> str:
    """A temporary beside ``filepath`` whose name nobody can predict: the folder may be
    shared (/tmp), and a symlink another user planted at a name made of the pid and a
    counter had the write go through it into a file of the victim's. Digits only after
    the pid (remove_stale_temporaries parses the name); the counter keeps names unique.
    It ends as ``filepath`` does: with the one of ``keep`` it ends with (a compound
    extension a writer checks), else its last extension."""
    d, base = os.path.split(filepath)
    ext = next((s for s in keep if base.endswith(s)), os.path.splitext(base)[1])
    token = f"{next(_tmp_ids)}{secrets.randbelow(10**12):012d}"
    return os.path.join(d, f".{base}.{os.getpid()}-{token}.pitstop-tmp{ext}")


def _create_tmp(path: str) -> None:
    """Create ``path`` new (never an existing file, never through a symlink): the writer then
    writes into this user's own file (the umask decides its mode, as for the peer's save)."""
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


def write_with_record(filepath: str, fill: Callable[[str], None], *, record_suffix: str,
                      record_format: str, info: dict[str, Any] | None = None,
                      keep: tuple[str, ...] = ()) -> None:
    """Have ``fill(tmp)`` write the file into a new temporary beside ``filepath``, make it
    ``filepath`` atomically, then write its integrity record (``filepath + record_suffix``:
    ``record_format``, size, hash, time and ``info``) beside it. ``keep``: compound
    extensions the temporary's name keeps (see :func:`_tmp_name`).

    A reader sees the previous file or the new one, never part of one; the old record is
    removed before the new file replaces the old, so a record never vouches for other bytes.
    """
    filepath = os.path.abspath(filepath)
    d = os.path.dirname(filepath)
    os.makedirs(d, exist_ok=True)
    tmp = _tmp_name(filepath, keep)
    record = filepath + record_suffix
    created = False
    try:
        _create_tmp(tmp)
        created = True
        fill(tmp)
        size, digest = _hash_file(tmp)
        _fsync_file(tmp)
        if os.path.lexists(record):
            os.unlink(record)
        os.replace(tmp, filepath)
    except BaseException:
        if created and os.path.lexists(tmp):  # (only ours: never a file in the way)
            os.unlink(tmp)
        raise
    body = {"format": record_format, "version": 1, "file": os.path.basename(filepath),
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


def verify_with_record(path: str | os.PathLike[str], *, record_suffix: str, record_format: str,
                       writer_name: str) -> dict[str, Any]:
    """Check a file :func:`write_with_record` wrote against its integrity record.

    Returns the record; raises :class:`pitstop.CorruptCheckpointError` when the bytes differ
    from what was written (or the record is damaged), and
    :class:`pitstop.CheckpointNotFoundError` when the file or its record is missing (the
    message says the file was perhaps not written by ``writer_name``). A file being replaced
    meanwhile is read again, not reported as damaged.
    """
    path = os.fspath(path)
    record = path + record_suffix
    for _ in range(5):
        if not os.path.exists(path):
            raise CheckpointNotFoundError(f"{path}: no such file")
        body = _read_record(path, record, record_format, writer_name)
        size, digest = _hash_with(path, record, body)
        if _read_record(path, record, record_format, writer_name) != body:
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


def _read_record(path: str, record: str, record_format: str,
                 writer_name: str) -> dict[str, Any]:
    try:
        with open(record) as f:
            body = json.load(f)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{path} has no integrity record ({os.path.basename(record)}): it was not written "
            f"by {writer_name}, or its writer was killed between the file and the "
            "record; the file itself is complete (files appear whole or not at all)") from None
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{record}: unreadable integrity record ({e})",
                                     file=record) from None
    h = body.get("hash") if isinstance(body, dict) else None
    if not isinstance(body, dict) or body.get("format") != record_format \
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


def remove_with_record(filepath: str, *, record_suffix: str) -> None:
    """Delete a file :func:`write_with_record` wrote and its record (retention)."""
    for p in (filepath, filepath + record_suffix):
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.unlink(p)
        except FileNotFoundError:
            pass
