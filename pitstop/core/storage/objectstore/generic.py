"""Any other fsspec URL (``memory://``, ``gs://`` ...) through fsspec's generic, blocking
calls: no conditional writes, so create-only is a check, then a write."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable
from typing import Any

from pitstop.core.storage.base import Writer
from pitstop.core.storage.objectstore.ops import ObjectStoreError, _not_found, _Ops


class _FsOps(_Ops):
    """Any fsspec filesystem, through its generic (blocking) calls. No conditional writes:
    create-only is a check, then a write."""

    def __init__(self, fs: Any, protocol: str) -> None:
        self.fs = fs
        self.protocol = protocol

    def url_of(self, key: str) -> str:
        try:
            return str(self.fs.unstrip_protocol(key))
        except Exception:  # noqa: BLE001
            return f"{self.protocol}://{key.lstrip('/')}"

    def _do(self, key: str, action: str, fn: Callable[..., Any], *args: Any,
            **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (FileNotFoundError, FileExistsError):
            raise
        except OSError as e:
            if isinstance(e, ObjectStoreError):
                raise
            raise ObjectStoreError(self.url_of(key), f"{action} failed ({type(e).__name__}: "
                                   f"{e})", e.errno or errno.EIO) from e
        except Exception as e:  # noqa: BLE001 - any fsspec implementation's own errors
            raise ObjectStoreError(self.url_of(key),
                                   f"{action} failed ({type(e).__name__}: {e})") from e

    def check(self, root: str) -> None:
        pass

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> str | None:
        if create_only and self.exists(key):
            raise FileExistsError(errno.EEXIST, "exists already (never overwritten)",
                                  self.url_of(key))
        self._do(key, "writing", self._pipe, key, data)
        return None

    def _pipe(self, key: str, data: bytes) -> None:
        parent = key.rsplit("/", 1)[0]
        if parent and parent != key:
            with contextlib.suppress(Exception):
                self.fs.makedirs(parent, exist_ok=True)
        self.fs.pipe_file(key, data)

    def get(self, key: str) -> bytes:
        try:
            return bytes(self._do(key, "reading", self.fs.cat_file, key))
        except FileNotFoundError:
            raise _not_found(self.url_of(key)) from None

    def get_range_into(self, key: str, offset: int, view: memoryview) -> int:
        try:
            data = self._do(key, "reading", self.fs.cat_file, key, start=offset,
                            end=offset + len(view))
        except FileNotFoundError:
            raise _not_found(self.url_of(key)) from None
        n = min(len(data), len(view))
        view[:n] = data[:n]
        return n

    def size(self, key: str) -> int:
        try:
            info = self._do(key, "reading its size", self.fs.info, key)
        except FileNotFoundError:
            raise _not_found(self.url_of(key)) from None
        if info.get("type") == "directory":
            raise _not_found(self.url_of(key), "a directory, not an object")
        return int(info.get("size") or 0)

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                self._do(key, "deleting", self.fs.rm_file, key)

    def list_prefix(self, prefix: str) -> dict[str, int]:
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache()
        try:
            found = self._do(prefix, "listing", self.fs.find, prefix, detail=True)
        except FileNotFoundError:
            return {}
        strip = prefix.rstrip("/") + "/" if prefix else ""
        return {str(k): int((v or {}).get("size") or 0) for k, v in found.items()
                if str(k).startswith(strip) and (v or {}).get("type") != "directory"}

    def copy(self, src: str, dst: str, size: int) -> None:
        self._do(dst, f"copying {self.url_of(src)}", self.fs.cp_file, src, dst)

    def open_writer(self, key: str, create_only: bool,
                    done: Callable[[str, str | None], None]) -> Writer:
        if create_only and self.exists(key):
            raise FileExistsError(errno.EEXIST, "exists already (never overwritten)",
                                  self.url_of(key))
        parent = key.rsplit("/", 1)[0]
        with contextlib.suppress(Exception):
            self.fs.makedirs(parent, exist_ok=True)
        f = self._do(key, "opening for writing", self.fs.open, key, "wb")
        return _FsWriter(self, key, f, done)


class _FsWriter(Writer):
    direct = False

    def __init__(self, ops: _FsOps, key: str, f: Any,
                 done: Callable[[str, str | None], None]) -> None:
        self.ops, self.key, self.f, self.done = ops, key, f, done
        self.failed = False
        self.closed = False

    def write(self, data: Any) -> None:
        try:
            self.ops._do(self.key, "writing", self.f.write, memoryview(data).cast("B"))
        except BaseException:
            self.failed = True
            raise

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.failed:
            discard = getattr(self.f, "discard", None)
            with contextlib.suppress(Exception):
                if discard is not None:
                    discard()  # a buffered upload: nothing of it is published
            return
        self.ops._do(self.key, "finishing the upload", self.f.close)
        self.done(self.key, None)
