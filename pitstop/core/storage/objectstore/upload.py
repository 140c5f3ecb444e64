"""One object written to S3: a single PUT, or a multipart upload of parallel parts."""

from __future__ import annotations

import asyncio
import errno
import hashlib
from collections.abc import Callable
from typing import Any

from pitstop.core.storage.base import Writer
from pitstop.core.storage.objectstore.ops import (
    MAX_PARTS,
    ObjectStoreError,
    _Conflict,
    _human,
    _Ops,
    _Unsupported,
    log,
)


class _S3Writer(Writer):
    """One object: a single PUT when it fits one part, else a multipart upload whose parts
    go up in parallel. ``write`` returns once its bytes are uploaded (it keeps no reference
    to the caller's buffer); ``close`` completes the upload (create-only) or raises."""

    direct = False

    def __init__(self, ops: _Ops, key: str, create_only: bool,
                 done: Callable[[str, str | None], None]) -> None:
        self.ops = ops
        self.key = key
        self.url = ops.url_of(key)
        self.create_only = create_only
        self.done = done
        self.part = ops.opts.part_size
        self.tail = bytearray()
        self.upload_id: str | None = None
        self.parts: list[dict[str, Any]] = []
        self.failed = False
        self.closed = False

    def write(self, data: Any) -> None:
        if self.closed or self.failed:
            raise ObjectStoreError(self.url, "write after the upload was closed or failed")
        view = memoryview(data).cast("B")
        batch = self.ops.opts.max_concurrency  # parts copied and in flight at once, at most
        try:
            while True:
                pieces: list[bytes] = []
                if self.tail:
                    take = min(len(view), self.part - len(self.tail))
                    self.tail += view[:take]
                    view = view[take:]
                    if len(self.tail) == self.part:
                        pieces.append(bytes(self.tail))
                        self.tail = bytearray()
                while len(view) >= self.part and len(pieces) < batch:
                    pieces.append(bytes(view[:self.part]))
                    view = view[self.part:]
                if not pieces:
                    break
                self.ops.run(self._upload, pieces)
            self.tail += view
        except BaseException:
            self.failed = True
            raise

    async def _start(self) -> None:
        r = await self.ops._call("create_multipart_upload", self.key, "starting an upload")
        self.upload_id = str(r["UploadId"])

    async def _upload(self, pieces: list[bytes]) -> None:
        if self.upload_id is None:
            await self._start()
        first = len(self.parts) + 1
        if first + len(pieces) - 1 > MAX_PARTS:
            raise ObjectStoreError(
                self.url, f"needs more than {MAX_PARTS} parts of {_human(self.part)} (S3's "
                f"limit: {MAX_PARTS * self.part / 2**30:.0f} GiB per object); pass a larger "
                "part_size to FsspecStorage(...)")

        async def one(n: int, body: bytes) -> dict[str, Any]:
            r = await self.ops._call("upload_part", self.key,
                                     f"uploading part {n} ({_human(len(body))})", data=True,
                                     Body=body, UploadId=self.upload_id, PartNumber=n)
            return {"PartNumber": n, "ETag": r["ETag"]}

        results = await asyncio.gather(*(one(first + i, p) for i, p in enumerate(pieces)),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        self.parts.extend(r for r in results if isinstance(r, dict))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.failed:
            self._abort()  # write() raised already; that error is the one the caller sees
            return
        try:
            if self.upload_id is None:
                etag = self.ops.put(self.key, bytes(self.tail), create_only=self.create_only)
            else:
                if self.tail:
                    self.ops.run(self._upload, [bytes(self.tail)])
                etag = self.ops.run(self._complete)
            self.tail = bytearray()
        except BaseException:
            self.failed = True
            self._abort()
            raise
        self.done(self.key, etag)

    async def _complete(self) -> str | None:
        cond: dict[str, Any] = {}
        if self.create_only and self.ops.conditional:
            cond["IfNoneMatch"] = "*"
        parts = {"Parts": self.parts}
        try:
            r = await self.ops._call("complete_multipart_upload", self.key,
                                     f"completing the upload ({len(self.parts)} parts)",
                                     UploadId=self.upload_id, MultipartUpload=parts, **cond)
        except (_Conflict, FileNotFoundError) as e:
            # an earlier attempt may have completed it before its answer was lost: ours if
            # the object's ETag is the one these parts make
            want = _multipart_etag([p["ETag"] for p in self.parts])
            try:
                head = await self.ops._call("head_object", self.key, "checking the upload")
            except FileNotFoundError:
                raise ObjectStoreError(self.url, f"the upload vanished ({e})") from None
            if str(head.get("ETag", "")).strip('"') == want:
                self.upload_id = None
                return str(head.get("ETag"))
            self.upload_id = None if isinstance(e, FileNotFoundError) else self.upload_id
            raise FileExistsError(errno.EEXIST, "exists already (another writer saved this "
                                  "step; nothing was overwritten)", self.url) from None
        except _Unsupported:
            self.ops._no_conditions()
            r = await self.ops._call("complete_multipart_upload", self.key,
                                     "completing the upload", UploadId=self.upload_id,
                                     MultipartUpload=parts)
        self.upload_id = None
        return str(r.get("ETag", "")) or None

    def _abort(self) -> None:
        if self.upload_id is None:
            return
        uid, self.upload_id = self.upload_id, None
        try:
            self.ops.run(self.ops._call, "abort_multipart_upload", self.key,
                         "aborting the upload", UploadId=uid)
        except Exception as e:  # noqa: BLE001 - the marker lets cleanup abort it later
            log.warning("pitstop: could not abort the unfinished upload of %s (%s); the next "
                        "writer on this directory (or `pitstop gc`) aborts it", self.url, e)


def _multipart_etag(etags: list[str]) -> str:
    """S3's ETag of a completed multipart upload: md5 of the parts' md5s, "-<count>"."""
    try:
        digest = hashlib.md5(b"".join(bytes.fromhex(t.strip('"')) for t in etags),
                             usedforsecurity=False).hexdigest()
    except ValueError:
        return ""
    return f"{digest}-{len(etags)}"
