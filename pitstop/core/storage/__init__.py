"""Storage backends behind one short interface (see :class:`Storage`).

A local path (or ``file://`` URL) opens a :class:`LocalStorage`; any other URL
(``s3://bucket/prefix``, ``memory://run``, ``gs://...`` where gcsfs is installed) an
:class:`FsspecStorage`. To give an object store options (an endpoint, credentials, part
size, timeouts), build the storage yourself and pass it as the manager's directory::

    storage = FsspecStorage("s3://bucket/run", endpoint_url="http://127.0.0.1:9000")
    mgr = pitstop.CheckpointManager(storage)

or pass ``storage_options={...}`` to :func:`open_storage`. See docs/storage.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pitstop.core.storage.base import Storage, Transaction, Writer
from pitstop.core.storage.local import LocalStorage
from pitstop.core.storage.objectstore import FsspecStorage, ObjectStoreError, ObjectStoreTimeout

__all__ = ["Storage", "Transaction", "Writer", "LocalStorage", "FsspecStorage",
           "ObjectStoreError", "ObjectStoreTimeout", "open_storage", "is_url"]


def is_url(location: str) -> bool:
    """True when ``location`` names an object store (``scheme://...``), not a local path
    (a ``file://`` URL is a local path)."""
    scheme, sep, _ = location.partition("://")
    return bool(sep) and scheme.lower() != "file" and "/" not in scheme and bool(scheme)


def open_storage(location: str | os.PathLike[str] | Storage, *,
                 storage_options: Mapping[str, Any] | None = None, **kwargs: Any) -> Storage:
    """A Storage for a path (local), a URL (object storage, through fsspec) or an existing
    Storage object (returned as it is). ``storage_options`` go to the URL's fsspec file
    system (and FsspecStorage's own options: part_size, request_timeout, ...); ``kwargs``
    (``durable``, ``create``) to the backend."""
    if isinstance(location, Storage):
        return location
    text = os.fspath(location)
    if is_url(text):
        kwargs.pop("permissions", None)  # object stores have no POSIX modes (docs/security.md)
        return FsspecStorage(text, **kwargs, **dict(storage_options or {}))
    if storage_options:
        from pitstop.core.errors import InvalidArgumentError
        raise InvalidArgumentError(
            f"storage_options are for object-store URLs (s3://...), not the local path {text}")
    if text.lower().startswith("file://"):
        text = text[len("file://"):]
    return LocalStorage(text, **kwargs)
