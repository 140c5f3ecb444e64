"""Object storage behind the :class:`~pitstop.core.storage.base.Storage` interface: ``s3://``
through s3fs/aiobotocore, and any other fsspec URL (``memory://``, ``gs://`` where gcsfs is
installed, ...) through fsspec's generic calls.

Object stores have no rename, so a save is published by an object written last:

1. ``begin(name)`` refuses a step whose ``<name>/manifest.json`` exists (StepExistsError),
   then writes a *save marker* ``.tmp-<name>-<8 hex>`` (pitstop's temporary name, see
   :mod:`pitstop.core.names`) that records the data objects the save may write, before it
   writes any of them.
2. Data objects go straight to ``<name>/data-NNN.bin``: large ones as parallel multipart
   uploads (``part_size`` parts, at most ``max_concurrency`` requests in flight), each
   request under a deadline (``request_timeout``) and retried a bounded number of times
   (``max_attempts``). On S3 every object is *created*, never replaced (``If-None-Match:
   *``), so a second writer can never overwrite a committed checkpoint's bytes.
3. ``commit`` writes ``<name>/manifest.json`` last, create-only: that one PUT is the commit.
   Then the marker is deleted.

A checkpoint is listed only when its manifest exists; an interrupted save leaves a marker,
and ``cleanup_incomplete`` (run by a writer when it opens the directory, and by ``pitstop
gc``) removes exactly the objects its marker names, aborts their unfinished multipart
uploads, then the marker. Deletions work the same way: a marker ``.tmp-deleting-<name>-…``
lists the objects, the manifest goes first (the checkpoint is then gone for readers), the
rest after.

The writer lock is a lease object ``.pitstop/lock`` created with ``If-None-Match: *`` and
renewed (``If-Match``) every ``lock_ttl / 4`` seconds; a holder that died on this host
(same boot, pid gone) or that has not renewed it for ``lock_ttl`` seconds (the store's own
clock) is taken over. Before every commit the writer reads the lease back and refuses to
commit when another writer holds it. Where the store ignores conditional writes (checked
when the lock is taken) or fsspec offers none (``gs://`` ...), there is no exclusion between
processes: this is said once, as a warning. ``memory://`` lives in one process, where the
lock is exact.

See docs/storage.md for the options, credentials and what is and is not guaranteed.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import email.utils
import errno
import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError, DirectoryLockedError, InvalidArgumentError, StepExistsError
from ..memtier import boot_id
from ..names import DEFAULT, Naming, aside_name, tmp_name
from .base import Storage, Transaction, Writer

log = logging.getLogger("pitstop")

MANIFEST = "manifest.json"
META_DIR = ".pitstop"
LOCK = "lock"
MiB = 1 << 20
#: S3's limits on multipart uploads
MIN_PART = 5 * MiB
MAX_PART = 5 * 1024 * MiB
MAX_PARTS = 10_000
#: reads up to SMALL_READ bytes are served from a read-ahead window of WINDOW bytes (one
#: request for many small tensors); the window is dropped when the checkpoint's manifest is
#: read again (a new reader) or after WINDOW_TTL seconds
SMALL_READ = 1 * MiB
WINDOW = 8 * MiB
WINDOW_TTL = 30.0
#: what a marker object holds (so cleanup never takes an object of that name it did not write)
_MARKER_KIND = "pitstop-object-store-marker"


# ====================================================================== errors
class ObjectStoreError(OSError):
    """A request to the object store failed. ``filename`` is the object's URL; the message
    says what failed and what to do. errno is EIO (ETIMEDOUT for a timeout), never one the
    reader would take for a corrupt checkpoint: a network or permission problem is not one."""

    def __init__(self, url: str, message: str, code: int = errno.EIO) -> None:
        super().__init__(code, message, url)

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


class ObjectStoreTimeout(ObjectStoreError):
    """A request made no progress within ``request_timeout`` on every attempt."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(url, message, errno.ETIMEDOUT)


class _Conflict(Exception):
    """A conditional write or delete found the object changed (or gone)."""


class _Unsupported(Exception):
    """The store refused a conditional request (it does not implement it)."""


def _not_found(url: str, what: str = "no such object") -> FileNotFoundError:
    e = FileNotFoundError(errno.ENOENT, what, url)
    return e


# ====================================================================== options
@dataclass(frozen=True)
class TransferOptions:
    """How data moves: multipart part size, parallel requests, deadlines and retries."""

    part_size: int = 8 * MiB
    max_concurrency: int = 8
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    request_timeout: float = 120.0
    max_attempts: int = 4
    lock_ttl: float = 60.0

    def __post_init__(self) -> None:
        p = self.part_size
        if isinstance(p, bool) or not isinstance(p, int) or not MIN_PART <= p <= MAX_PART:
            raise InvalidArgumentError(
                f"part_size must be an int from {MIN_PART} (5 MiB, S3's smallest part) to "
                f"{MAX_PART} (5 GiB), got {p!r}")
        for name in ("max_concurrency", "max_attempts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"{name} must be an int >= 1, got {v!r}")
        for name in ("connect_timeout", "read_timeout", "request_timeout", "lock_ttl"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v == float(
                    "inf"):
                raise InvalidArgumentError(f"{name} must be a positive number of seconds, "
                                           f"got {v!r}")


# ====================================================================== the store seam
class _Ops:
    """What :class:`FsspecStorage` needs of a store; keys are full paths in the store."""

    #: create-only and if-match writes are enforced by the store
    conditional = False
    protocol = ""

    def url_of(self, key: str) -> str:
        raise NotImplementedError

    def check(self, root: str) -> None:
        """Raise when the bucket (or root) cannot be used."""

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> str | None:
        raise NotImplementedError

    def get(self, key: str) -> bytes:
        raise NotImplementedError

    def get_lease(self, key: str) -> tuple[bytes, str | None, float | None]:
        """(content, etag, seconds since it was last written by the store's clock)."""
        return self.get(key), None, None

    def put_if_match(self, key: str, data: bytes, etag: str | None) -> str | None:
        return self.put(key, data)

    def delete_if_match(self, key: str, etag: str | None) -> None:
        self.delete([key])

    def get_range_into(self, key: str, offset: int, view: memoryview) -> int:
        raise NotImplementedError

    def size(self, key: str) -> int:
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
            return True
        except FileNotFoundError:
            return False

    def delete(self, keys: list[str]) -> None:
        raise NotImplementedError

    def list_prefix(self, prefix: str) -> dict[str, int]:
        """Every object under ``prefix`` (a "directory": no trailing slash) -> its size."""
        raise NotImplementedError

    def copy(self, src: str, dst: str, size: int) -> None:
        raise NotImplementedError

    def open_writer(self, key: str, create_only: bool,
                    done: Callable[[str, str | None], None]) -> Writer:
        raise NotImplementedError

    def abort_uploads(self, prefix: str, keys: set[str]) -> list[str]:
        """Abort unfinished multipart uploads of ``keys`` (under ``prefix``); returns keys."""
        return []

    def list_uploads(self, prefix: str) -> set[str]:
        """The keys under ``prefix`` that have unfinished multipart uploads."""
        return set()


# ---------------------------------------------------------------------- S3
def _human(n: int) -> str:
    return f"{n / MiB:.1f} MiB" if n >= MiB else f"{n} B"


class _S3Ops(_Ops):
    """S3 (and S3-compatible endpoints) through s3fs's aiobotocore client, with deadlines,
    bounded retries and conditional writes."""

    protocol = "s3"

    def __init__(self, fs: Any, bucket: str, opts: TransferOptions) -> None:
        self.fs = fs
        self.bucket = bucket
        self.opts = opts
        self.conditional = True
        self._sem: asyncio.Semaphore | None = None
        self._endpoint = ""

    # ------------------------------------------------------------------ plumbing
    def url_of(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}"

    def run(self, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args)`` on fsspec's I/O loop; anything but an OSError (or a pitstop
        error) that escapes it becomes an ObjectStoreError."""
        from fsspec.asyn import sync
        try:
            return sync(self.fs.loop, fn, *args, **kwargs)
        except (OSError, CheckpointError, _Conflict, _Unsupported):
            raise
        except Exception as e:  # noqa: BLE001 - e.g. "not fork-safe" from fsspec
            raise ObjectStoreError(self.url_of(""), f"{type(e).__name__}: {e}") from e

    def _limit(self) -> asyncio.Semaphore:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.opts.max_concurrency)
        return self._sem

    async def _call(self, op: str, key: str | None, action: str, *,
                    post: Callable[[dict[str, Any]], Awaitable[Any]] | None = None,
                    data: bool = False, **kw: Any) -> Any:
        """One request, with a deadline per attempt and bounded attempts; ``post`` (reading
        a body) runs inside the same deadline. ``data``: a bulk transfer, counted against
        ``max_concurrency``."""
        url = self.url_of(key or "")
        try:
            s3 = await self.fs.set_session()
            method = getattr(s3, op)
            args = {"Bucket": self.bucket, **({"Key": key} if key is not None else {}), **kw}
            kwargs = self.fs._get_s3_method_kwargs(method, **args)
            self._endpoint = str(getattr(getattr(s3, "_endpoint", None), "host", "") or "")
        except Exception as e:  # noqa: BLE001
            raise self._translate(e, url, action) from e
        attempts = self.opts.max_attempts
        last: BaseException | None = None
        for attempt in range(attempts):
            try:
                async with contextlib.AsyncExitStack() as stack:
                    if data:
                        await stack.enter_async_context(self._limit())
                    return await asyncio.wait_for(self._once(method, kwargs, post),
                                                  self.opts.request_timeout)
            except asyncio.TimeoutError as e:
                last = e
                log.debug("pitstop: %s: %s timed out (attempt %d of %d)", url, action,
                          attempt + 1, attempts)
            except Exception as e:  # noqa: BLE001 - translated below
                if not _transient(e) or attempt + 1 == attempts:
                    raise self._translate(e, url, action) from e
                last = e
                log.debug("pitstop: %s: %s failed (%s), retrying", url, action, e)
            if attempt + 1 < attempts:
                await asyncio.sleep(min(0.2 * 2 ** attempt, 5.0))
        if isinstance(last, asyncio.TimeoutError):
            endpoint = f" {self._endpoint}" if self._endpoint else ""
            raise ObjectStoreTimeout(
                url, f"{action} did not finish within {self.opts.request_timeout:g} s on any of "
                f"{attempts} attempt(s) (request_timeout={self.opts.request_timeout:g}, "
                f"max_attempts={attempts}): the endpoint{endpoint} stalls or is unreachable; "
                "check the network, or raise request_timeout in FsspecStorage(...)") from None
        assert last is not None
        raise self._translate(last, url, action) from last

    @staticmethod
    async def _once(method: Any, kwargs: dict[str, Any],
                    post: Callable[[dict[str, Any]], Awaitable[Any]] | None) -> Any:
        resp = await method(**kwargs)
        return await post(resp) if post is not None else resp

    def _translate(self, e: BaseException, url: str, action: str) -> BaseException:
        """An exception of botocore / aiohttp as an OSError a user can act on."""
        if isinstance(e, (ObjectStoreError, FileNotFoundError, FileExistsError, _Conflict,
                          _Unsupported, CheckpointError)):
            return e
        try:
            from botocore import exceptions as bx
        except ImportError:  # pragma: no cover - s3fs always brings botocore
            bx = None
        if bx is not None and isinstance(e, bx.ClientError):
            err = e.response.get("Error", {}) or {}
            code = str(err.get("Code", ""))
            message = str(err.get("Message", "") or e)
            status = (e.response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412:
                # (409 ConditionalRequestConflict: another conditional write of the same key
                # is under way; it wins or fails as this one would)
                return _Conflict(f"{url}: {message}")
            if code in ("NotImplemented", "501") or status == 501:
                return _Unsupported(f"{url}: {action}: {message}")
            if code == "NoSuchBucket":
                return ObjectStoreError(
                    url, f"bucket {self.bucket!r} does not exist (or these credentials cannot "
                    "see it); create it first: pitstop never creates buckets")
            if code in ("NoSuchKey", "404", "NotFound", "NoSuchUpload") or status == 404:
                return _not_found(url, f"no such object ({action})")
            if code in ("InvalidRange", "416"):
                return _not_found(url, "the range starts past the end of the object")
            if code in ("AccessDenied", "403", "Forbidden", "InvalidAccessKeyId",
                        "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                        "AllAccessDisabled") or status == 403:
                return ObjectStoreError(
                    url, f"{action}: access denied ({code}: {message}); the credentials "
                    "botocore found (AWS_ACCESS_KEY_ID / AWS_PROFILE / ~/.aws, or key=/secret= "
                    "storage options) may not do this here: check them and the bucket policy")
            return ObjectStoreError(url, f"{action} failed ({code or status}: {message})")
        if bx is not None and isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError)):
            return ObjectStoreError(
                url, f"{action}: no AWS credentials found ({e}); set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws/credentials, or pass key= and "
                "secret= (anon=True for a public bucket) to FsspecStorage")
        if bx is not None and isinstance(e, (bx.EndpointConnectionError, bx.ConnectTimeoutError)):
            return ObjectStoreError(
                url, f"{action}: cannot reach the endpoint ({e}); check AWS_ENDPOINT_URL / "
                "endpoint_url, the network and the region")
        if isinstance(e, asyncio.TimeoutError) or (bx is not None and isinstance(
                e, bx.ReadTimeoutError)):
            return ObjectStoreTimeout(
                url, f"{action} timed out ({type(e).__name__}: {e}); check the network, or "
                "raise read_timeout / request_timeout in FsspecStorage(...)")
        return ObjectStoreError(url, f"{action} failed ({type(e).__name__}: {e})")

    # ------------------------------------------------------------------ bucket
    def check(self, root: str) -> None:
        try:
            self.run(self._call, "head_bucket", None, "checking the bucket")
        except FileNotFoundError:
            raise ObjectStoreError(
                self.url_of(""), f"bucket {self.bucket!r} does not exist (or these credentials "
                "cannot see it); create it first: pitstop never creates buckets") from None

    # ------------------------------------------------------------------ objects
    def put(self, key: str, data: bytes, *, create_only: bool = False) -> str | None:
        return self.run(self._put, key, data, create_only)

    async def _put(self, key: str, data: bytes, create_only: bool) -> str | None:
        cond: dict[str, Any] = {"IfNoneMatch": "*"} if create_only and self.conditional else {}
        try:
            r = await self._call("put_object", key, f"writing {_human(len(data))}",
                                 Body=data, data=len(data) >= MIN_PART, **cond)
        except _Conflict:
            # ours already (an earlier attempt landed before its answer was lost) or not
            try:
                now = await self._get(key)
            except FileNotFoundError:
                now = None
            if now == data:
                return None
            raise FileExistsError(errno.EEXIST, "exists already (never overwritten)",
                                  self.url_of(key)) from None
        except _Unsupported:
            if not create_only:
                raise
            self._no_conditions()
            if await self._exists(key):
                raise FileExistsError(errno.EEXIST, "exists already (never overwritten)",
                                      self.url_of(key)) from None
            r = await self._call("put_object", key, f"writing {_human(len(data))}", Body=data)
        return str(r.get("ETag", "")) or None

    def _no_conditions(self) -> None:
        if self.conditional:
            self.conditional = False
            log.warning("pitstop: the S3 endpoint of s3://%s refuses conditional writes "
                        "(If-None-Match / If-Match): pitstop cannot keep a second writer out "
                        "of this bucket, nor make sure a checkpoint is never overwritten by "
                        "one. Use one writer per directory.", self.bucket)

    def get(self, key: str) -> bytes:
        return bytes(self.run(self._get, key))

    async def _get(self, key: str) -> bytes:
        async def body(r: dict[str, Any]) -> bytes:
            async with r["Body"] as stream:
                return bytes(await stream.read())
        return bytes(await self._call("get_object", key, "reading", post=body))

    def get_lease(self, key: str) -> tuple[bytes, str | None, float | None]:
        return self.run(self._get_lease, key)  # type: ignore[no-any-return]

    async def _get_lease(self, key: str) -> tuple[bytes, str | None, float | None]:
        async def body(r: dict[str, Any]) -> tuple[bytes, str | None, float | None]:
            async with r["Body"] as stream:
                data = bytes(await stream.read())
            age = None
            modified = r.get("LastModified")
            date = ((r.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}).get("date")
            if modified is not None and date:
                with contextlib.suppress(TypeError, ValueError):
                    # both are whole seconds: the true age may be up to 1 s less, never
                    # count it older than it can be
                    age = max(0.0, (email.utils.parsedate_to_datetime(date) - modified
                                    ).total_seconds() - 1.0)
            return data, r.get("ETag"), age
        return await self._call("get_object", key, "reading the lock",  # type: ignore[no-any-return]
                                post=body)

    def put_if_match(self, key: str, data: bytes, etag: str | None) -> str | None:
        return self.run(self._put_if_match, key, data, etag)

    async def _put_if_match(self, key: str, data: bytes, etag: str | None) -> str | None:
        if not self.conditional or etag is None:
            r = await self._call("put_object", key, "renewing the lock", Body=data)
            return str(r.get("ETag", "")) or None
        try:
            r = await self._call("put_object", key, "renewing the lock", Body=data, IfMatch=etag)
        except FileNotFoundError:
            raise _Conflict(f"{self.url_of(key)} was deleted") from None
        except _Unsupported:
            self._no_conditions()
            r = await self._call("put_object", key, "renewing the lock", Body=data)
        return str(r.get("ETag", "")) or None

    def delete_if_match(self, key: str, etag: str | None) -> None:
        self.run(self._delete_if_match, key, etag)

    async def _delete_if_match(self, key: str, etag: str | None) -> None:
        if self.conditional and etag is not None:
            try:
                await self._call("delete_object", key, "releasing the lock", IfMatch=etag)
                return
            except FileNotFoundError:
                return
            except (_Unsupported, ObjectStoreError) as e:
                if isinstance(e, ObjectStoreError) and "NotImplemented" not in str(e) and \
                        "InvalidArgument" not in str(e):
                    raise
            # conditional deletes unknown here: delete only when it is still ours
            try:
                _data, now, _age = await self._get_lease(key)
            except FileNotFoundError:
                return
            if now != etag:
                raise _Conflict(f"{self.url_of(key)} changed")
        await self._call("delete_object", key, "releasing the lock")

    async def _exists(self, key: str) -> bool:
        try:
            await self._call("head_object", key, "looking it up")
            return True
        except FileNotFoundError:
            return False

    def size(self, key: str) -> int:
        r = self.run(self._call, "head_object", key, "reading its size")
        return int(r["ContentLength"])

    def get_range_into(self, key: str, offset: int, view: memoryview) -> int:
        return int(self.run(self._get_range_into, key, offset, view))

    async def _get_range_into(self, key: str, offset: int, view: memoryview) -> int:
        n = len(view)
        if n == 0:
            return 0
        step = max(MiB, self.opts.part_size)
        spans = [(a, min(n, a + step)) for a in range(0, n, step)]

        async def one(a: int, b: int) -> int:
            async def body(r: dict[str, Any]) -> int:
                got = 0
                async with r["Body"] as stream:
                    while True:
                        chunk = await stream.read(b - a - got) if got < b - a else b""
                        if not chunk:
                            break
                        chunk = chunk[:b - a - got]
                        view[a + got:a + got + len(chunk)] = chunk
                        got += len(chunk)
                return got
            try:
                return int(await self._call(
                    "get_object", key, f"reading bytes {offset + a}-{offset + b - 1}",
                    post=body, data=True, Range=f"bytes={offset + a}-{offset + b - 1}"))
            except FileNotFoundError as e:
                if "past the end" in str(e.strerror):
                    return 0
                raise

        results = await asyncio.gather(*(one(a, b) for a, b in spans), return_exceptions=True)
        total = 0
        for (a, b), r in zip(spans, results, strict=True):
            if isinstance(r, BaseException):
                raise r
            total += r
            if r < b - a:
                break  # the object ends here
        return total

    def delete(self, keys: list[str]) -> None:
        if keys:
            self.run(self._delete, keys)

    async def _delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = keys[i:i + 1000]
            if len(batch) == 1:
                try:
                    await self._call("delete_object", batch[0], "deleting")
                except FileNotFoundError:
                    pass
                continue
            r = await self._call("delete_objects", None, f"deleting {len(batch)} objects",
                                 Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            errors = [e for e in r.get("Errors") or [] if e.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                raise ObjectStoreError(
                    self.url_of(str(first.get("Key", ""))),
                    f"deleting failed ({first.get('Code')}: {first.get('Message')}) "
                    f"({len(errors)} of {len(batch)} objects)")

    def list_prefix(self, prefix: str) -> dict[str, int]:
        return self.run(self._list, prefix)  # type: ignore[no-any-return]

    async def _list(self, prefix: str) -> dict[str, int]:
        out: dict[str, int] = {}
        token = None
        pre = f"{prefix}/" if prefix else ""
        while True:
            kw: dict[str, Any] = {"Prefix": pre}
            if token:
                kw["ContinuationToken"] = token
            r = await self._call("list_objects_v2", None, f"listing {self.url_of(pre)}", **kw)
            for obj in r.get("Contents") or []:
                out[str(obj["Key"])] = int(obj.get("Size", 0))
            if not r.get("IsTruncated"):
                return out
            token = r.get("NextContinuationToken")

    def copy(self, src: str, dst: str, size: int) -> None:
        self.run(self._copy, src, dst, size)

    async def _copy(self, src: str, dst: str, size: int) -> None:
        source = {"Bucket": self.bucket, "Key": src}
        if size <= MAX_PART:
            await self._call("copy_object", dst, f"copying {self.url_of(src)}",
                             CopySource=source, data=True)
            return
        r = await self._call("create_multipart_upload", dst, "starting a copy")
        uid = r["UploadId"]
        chunk = 1024 * MiB
        try:
            async def part(n: int, a: int) -> dict[str, Any]:
                b = min(size, a + chunk) - 1
                p = await self._call("upload_part_copy", dst, f"copying part {n}", data=True,
                                     CopySource=source, CopySourceRange=f"bytes={a}-{b}",
                                     UploadId=uid, PartNumber=n)
                return {"PartNumber": n, "ETag": p["CopyPartResult"]["ETag"]}
            parts = await asyncio.gather(*(part(i + 1, a) for i, a in
                                           enumerate(range(0, size, chunk))))
            await self._call("complete_multipart_upload", dst, "finishing a copy",
                             UploadId=uid, MultipartUpload={"Parts": list(parts)})
        except BaseException:
            with contextlib.suppress(Exception):
                await self._call("abort_multipart_upload", dst, "aborting a copy", UploadId=uid)
            raise

    def abort_uploads(self, prefix: str, keys: set[str]) -> list[str]:
        return self.run(self._abort_uploads, prefix, keys)  # type: ignore[no-any-return]

    async def _abort_uploads(self, prefix: str, keys: set[str]) -> list[str]:
        aborted = []
        for key, upload_id in await self._list_uploads(prefix):
            if key in keys:  # every upload of the key: a late-started one as well
                with contextlib.suppress(FileNotFoundError):
                    await self._call("abort_multipart_upload", key,
                                     "aborting an unfinished upload", UploadId=upload_id)
                if key not in aborted:
                    aborted.append(key)
        return aborted

    def list_uploads(self, prefix: str) -> set[str]:
        return {key for key, _ in self.run(self._list_uploads, prefix)}

    async def _list_uploads(self, prefix: str) -> list[tuple[str, str]]:
        """(key, upload id) of every unfinished multipart upload under ``prefix``."""
        out: list[tuple[str, str]] = []
        kw: dict[str, Any] = {"Prefix": prefix}
        while True:
            r = await self._call("list_multipart_uploads", None, "listing unfinished uploads",
                                 **kw)
            out += [(str(up["Key"]), str(up["UploadId"])) for up in r.get("Uploads") or []]
            if not r.get("IsTruncated"):
                return out
            kw = {"Prefix": prefix, "KeyMarker": r.get("NextKeyMarker"),
                  "UploadIdMarker": r.get("NextUploadIdMarker")}

    def open_writer(self, key: str, create_only: bool,
                    done: Callable[[str, str | None], None]) -> Writer:
        return _S3Writer(self, key, create_only, done)


def _transient(e: BaseException) -> bool:
    """A failure worth another attempt: the connection broke or a body read failed."""
    try:
        from botocore import exceptions as bx
        kinds: tuple[type[BaseException], ...] = (
            bx.ConnectionClosedError, bx.IncompleteReadError, bx.ReadTimeoutError,
            bx.EndpointConnectionError, bx.ResponseStreamingError)
    except (ImportError, AttributeError):  # pragma: no cover
        kinds = ()
    try:
        import aiohttp
        kinds += (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
                  aiohttp.ClientOSError)
    except ImportError:  # pragma: no cover
        pass
    return isinstance(e, kinds + (ConnectionError,))


class _S3Writer(Writer):
    """One object: a single PUT when it fits one part, else a multipart upload whose parts
    go up in parallel. ``write`` returns once its bytes are uploaded (it keeps no reference
    to the caller's buffer); ``close`` completes the upload (create-only) or raises."""

    direct = False

    def __init__(self, ops: _S3Ops, key: str, create_only: bool,
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


# ---------------------------------------------------------------------- any fsspec URL
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


# ====================================================================== the storage
def _check_segment(name: str, what: str) -> None:
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise PermissionError(f"{what} {name!r} is not a single path segment")


class FsspecStorage(Storage):
    """Checkpoints under an object-store URL: ``s3://bucket/prefix`` or any fsspec URL.

    ``storage_options`` go to the fsspec filesystem (for s3: ``endpoint_url``, ``key``,
    ``secret``, ``token``, ``profile``, ``anon``, ``client_kwargs``, ``config_kwargs``...).
    Credentials and the endpoint default to botocore's chain (``AWS_*`` environment
    variables, ``AWS_ENDPOINT_URL[_S3]``, ``~/.aws``). Pass the instance as the manager's
    directory: ``CheckpointManager(FsspecStorage("s3://b/run", endpoint_url=...))``.

    ``part_size`` (bytes, >= 5 MiB): multipart part size; ``max_concurrency``: requests in
    flight for data; ``connect_timeout`` / ``read_timeout``: botocore's socket timeouts;
    ``request_timeout``: the deadline of one request (one part, one range read), after which
    it is retried, ``max_attempts`` attempts in all; ``lock_ttl``: seconds after its last
    renewal that a writer's lock counts as abandoned. ``create`` and ``durable`` are
    accepted as :func:`open_storage` passes them: nothing needs creating on an object store
    (pitstop never creates a bucket), and an acknowledged write is durable (``durable`` is
    False for memory:// only). Constructing it makes no request.
    """

    atomic_rename = False

    def __init__(self, url: str, *, create: bool = True, durable: bool = True,
                 part_size: int = 8 * MiB, max_concurrency: int = 8,
                 connect_timeout: float = 10.0, read_timeout: float = 60.0,
                 request_timeout: float = 120.0, max_attempts: int = 4,
                 lock_ttl: float = 60.0, **storage_options: Any) -> None:
        if not isinstance(url, str) or "://" not in url:
            raise InvalidArgumentError(f"FsspecStorage needs a URL such as s3://bucket/prefix, "
                                       f"got {url!r}")
        self.opts = TransferOptions(part_size, max_concurrency, connect_timeout, read_timeout,
                                    request_timeout, max_attempts, lock_ttl)
        protocol, _, rest = url.partition("://")
        protocol = protocol.lower()
        if protocol in ("s3", "s3a") and rest.startswith("/"):
            raise InvalidArgumentError(f"{url}: name a bucket: s3://bucket/prefix")
        rest = rest.strip("/")
        self.protocol = protocol
        self.location = f"{protocol}://{rest}" if rest else f"{protocol}://"
        self.create = create
        self.storage_options = dict(storage_options)
        self._ops = self._make_ops(protocol, rest, storage_options)
        #: memory:// lives in this process only: nothing there outlives it
        self.durable = protocol != "memory"
        self._held: _Lease | None = None
        self._windows = threading.local()
        self._generation: dict[str, int] = {}
        self._gen_lock = threading.Lock()
        #: save markers this process could not clean after a failed save (retried at the
        #: next save of the same name)
        self._orphans: set[tuple[str, str]] = set()
        #: keys the open saves of this storage write (their uploads are this writer's own)
        self._writing: set[str] = set()

    def _make_ops(self, protocol: str, rest: str, options: dict[str, Any]) -> _Ops:
        try:
            import fsspec
        except ImportError:
            raise CheckpointError(
                f"{self.location}: object storage needs fsspec (and s3fs for s3://): "
                "pip install 'pitstop[s3]'") from None
        if protocol in ("s3", "s3a"):
            try:
                import s3fs
            except ImportError:
                raise CheckpointError(f"{self.location}: s3:// needs s3fs: pip install "
                                      "'pitstop[s3]'") from None
            bucket, _, prefix = rest.partition("/")
            if not bucket:
                raise InvalidArgumentError(f"{self.location}: name a bucket: "
                                           "s3://bucket/prefix")
            self.root = prefix.strip("/")
            opts = dict(options)
            config = dict(opts.pop("config_kwargs", None) or {})
            config.setdefault("connect_timeout", self.opts.connect_timeout)
            config.setdefault("read_timeout", self.opts.read_timeout)
            config.setdefault("retries", {"max_attempts": self.opts.max_attempts,
                                          "mode": "standard"})
            config.setdefault("max_pool_connections", self.opts.max_concurrency + 4)
            try:
                fs = s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs=config,
                                       use_listings_cache=False, **opts)
            except Exception as e:  # noqa: BLE001 - a bad option
                raise InvalidArgumentError(f"{self.location}: bad storage options for s3fs "
                                           f"({type(e).__name__}: {e})") from None
            return _S3Ops(fs, bucket, self.opts)
        try:
            cls = fsspec.get_filesystem_class(protocol)
        except (ValueError, ImportError) as e:
            raise CheckpointError(f"{self.location}: fsspec cannot open {protocol}:// ({e}); "
                                  "install the package it names, or use s3://, memory:// or a "
                                  "local path") from None
        try:
            fs = cls(skip_instance_cache=True, **options)
        except Exception as e:  # noqa: BLE001
            raise InvalidArgumentError(f"{self.location}: bad storage options for {protocol}:// "
                                       f"({type(e).__name__}: {e})") from None
        self.root = str(fs._strip_protocol(self.location)).rstrip("/")
        return _FsOps(fs, protocol)

    def __repr__(self) -> str:
        return f"FsspecStorage({self.location!r})"

    @property
    def supports_locking(self) -> bool:  # type: ignore[override]
        """True where the lock keeps every other writer out: S3 endpoints that honour
        conditional writes (known once the lock was taken), and memory://."""
        return (isinstance(self._ops, _S3Ops) and self._ops.conditional) or \
            self.protocol == "memory"

    def parent(self) -> FsspecStorage | None:
        """The directory that holds this one, on the same connection (no new session); None
        at the top of a bucket (or of the store)."""
        if not self.root or "/" not in self.location.partition("://")[2]:
            return None
        other = copy.copy(self)
        other.root = self.root.rpartition("/")[0]
        other.location = self.location.rpartition("/")[0]
        other._held = None
        other._windows = threading.local()
        other._generation = {}
        other._gen_lock = threading.Lock()
        other._orphans = set()
        other._writing = set()
        return other

    # ------------------------------------------------------------------ keys
    def _key(self, *parts: str) -> str:
        rel = "/".join(p for p in parts if p)
        if not self.root:
            return rel
        return f"{self.root}/{rel}" if rel else self.root

    def _rel(self, key: str) -> str:
        """A key relative to the directory."""
        return key[len(self.root) + 1:] if self.root else key

    def _safe(self, name: str, relpath: str) -> str:
        """The key of ``relpath`` in checkpoint ``name``; PermissionError (errno None, like
        LocalStorage) when it would lead outside the checkpoint."""
        try:
            _check_segment(name, "checkpoint name")
            segments = relpath.split("/")
            for s in segments:
                _check_segment(s, "path")
        except PermissionError:
            raise PermissionError(f"path {relpath!r} points outside checkpoint {name!r}") from None
        return self._key(name, relpath)

    def _bump(self, name: str) -> None:
        with self._gen_lock:
            self._generation[name] = self._generation.get(name, 0) + 1

    def check(self) -> None:
        """Raise an OSError naming the bucket when it cannot be used (missing, no access)."""
        self._ops.check(self.root)

    # ------------------------------------------------------------------ writes
    def join(self, name: str, token: str) -> Transaction:
        """Another rank's part of a save: its own marker and create-only data objects under
        the checkpoint's name; the leader's manifest commits them all."""
        return _ObjectTransaction(self, name, joined=token)

    def begin(self, name: str) -> Transaction:
        return _ObjectTransaction(self, name)

    def write_meta(self, relpath: str, data: bytes, *, durable: bool = True) -> None:
        self._ops.put(self._key(META_DIR, relpath), bytes(data))

    def read_meta(self, relpath: str) -> bytes | None:
        try:
            return self._ops.get(self._key(META_DIR, relpath))
        except FileNotFoundError:
            return None

    def _objects(self, name: str) -> dict[str, int]:
        """The objects of checkpoint ``name``: relpath -> size."""
        base = self._key(name)
        return {k[len(base) + 1:]: v for k, v in self._ops.list_prefix(base).items()}

    def _write_marker(self, marker: str, doc: dict[str, Any]) -> None:
        doc = {"kind": _MARKER_KIND, **doc}
        self._ops.put(self._key(marker), json.dumps(doc).encode())

    def delete(self, name: str) -> None:
        """Delete checkpoint ``name``: a deletion marker listing its objects, the manifest
        (it is then gone for readers), the rest, the marker."""
        _check_segment(name, "checkpoint name")
        objects = self._objects(name)
        if not objects:
            raise _not_found(self.path_of(name), "no such checkpoint")
        marker = tmp_name(name, uuid.uuid4().hex[:8], deleting=True)
        self._write_marker(marker, {"op": "delete", "name": name, "files": sorted(objects)})
        self._finish_delete(name, sorted(objects))
        self._ops.delete([self._key(marker)])

    def _finish_delete(self, name: str, relpaths: list[str]) -> list[str]:
        self._bump(name)
        keys = [self._key(name, r) for r in relpaths if r != MANIFEST]
        if MANIFEST in relpaths:
            self._ops.delete([self._key(name, MANIFEST)])  # first: un-commits it at once
        self._ops.delete(keys)
        return [f"{name}/{r}" for r in relpaths]

    def move_aside(self, name: str, reason: str) -> str:
        """Copy a checkpoint to its moved-aside name (server-side copies, manifest last),
        then delete it; returns the new name."""
        _check_segment(name, "checkpoint name")
        objects = self._objects(name)
        if not objects:
            raise _not_found(self.path_of(name), "no such checkpoint")
        new = aside_name(name, reason, int(time.time()), uuid.uuid4().hex[:4])
        order = sorted(r for r in objects if r != MANIFEST) + (
            [MANIFEST] if MANIFEST in objects else [])
        done: list[str] = []
        try:
            for rel in order:
                self._ops.copy(self._key(name, rel), self._key(new, rel), objects[rel])
                done.append(rel)
        except BaseException:
            with contextlib.suppress(Exception):
                self._ops.delete([self._key(new, r) for r in reversed(done)])
            raise
        self.delete(name)
        return new

    # ------------------------------------------------------------------ reads
    def list_checkpoints(self) -> list[str]:
        out = []
        for key in self._ops.list_prefix(self.root):
            rel = self._rel(key)
            name, _, rest = rel.partition("/")
            if rest == MANIFEST and not name.startswith("."):
                out.append(name)
        return out

    def read_bytes(self, name: str, relpath: str) -> bytes:
        key = self._safe(name, relpath)
        if relpath == MANIFEST:
            self._bump(name)  # a new reader: its windows start afresh
        return self._ops.get(key)

    def read_into(self, name: str, relpath: str, offset: int, out: Any) -> int:
        view = memoryview(out).cast("B")
        key = self._safe(name, relpath)
        n = len(view)
        if n == 0:
            return 0
        if n > SMALL_READ:
            return self._ops.get_range_into(key, offset, view)
        gen = self._generation.get(name, 0)
        w = getattr(self._windows, "w", None)
        now = time.monotonic()
        if not (w is not None and w[0] == (key, gen) and w[1] <= offset
                and offset + n <= w[1] + len(w[2]) and now < w[3]):
            buf = bytearray(WINDOW)
            got = self._ops.get_range_into(key, offset, memoryview(buf))
            del buf[got:]
            w = ((key, gen), offset, bytes(buf), now + WINDOW_TTL)
            self._windows.w = w
        a = offset - w[1]
        data = w[2][a:a + n]
        view[:len(data)] = data
        return len(data)

    def size(self, name: str, relpath: str) -> int:
        return self._ops.size(self._safe(name, relpath))

    # ------------------------------------------------------------------ cleanup
    def scan(self) -> ObjectListing:
        """Every object under the directory, grouped: checkpoint-level prefixes, top-level
        objects, and the files of ``.pitstop/`` (for ``pitstop ls`` and cleanup)."""
        listing = ObjectListing(self.location)
        for key, size in self._ops.list_prefix(self.root).items():
            rel = self._rel(key)
            head, sep, rest = rel.partition("/")
            if not sep:
                listing.files[head] = size
            elif head == META_DIR:
                listing.meta[rest] = size
            else:
                listing.dirs.setdefault(head, {})[rest] = size
        return listing

    def leftovers(self, naming: Naming = DEFAULT, listing: ObjectListing | None = None
                  ) -> list[Leftover]:
        """What interrupted saves and deletions of checkpoints named by ``naming`` left:
        exactly what :meth:`cleanup_incomplete` removes (nothing else pitstop did not make)."""
        listing = listing if listing is not None else self.scan()
        out: list[Leftover] = []
        for entry in sorted(listing.files):
            if naming.parse_tmp(entry) is None:
                continue
            item = self._leftover_of(entry, listing, naming.parse)
            if item is not None:
                out.append(item)
        for entry, files in sorted(listing.dirs.items()):
            if naming.parse_tmp(entry) is not None:  # a local save's temporary, copied here
                out.append(Leftover(f"{entry}/", entry, "tmpdir", sorted(files), []))
        for entry in sorted(listing.meta):
            if _is_tmp_meta(entry):
                out.append(Leftover(f"{META_DIR}/{entry}", "", "meta", [], []))
        return out + self._stray_uploads(naming, out)

    def _stray_uploads(self, naming: Naming, found: list[Leftover]) -> list[Leftover]:
        """Unfinished multipart uploads of objects ``<checkpoint>/<file>`` (a name of
        ``naming``, or a moved-aside one) that no save of this storage is writing and no
        leftover in ``found`` names: a request the store carried out late (a stalled
        server, a writer that lost its lock), or a save whose marker is gone."""
        named = {self._key(item.name, f) for item in found for f in item.uploads}
        with self._gen_lock:
            named |= self._writing
        out = []
        for key in sorted(self._ops.list_uploads(self._key() + "/" if self.root else "")):
            if key in named or (self.root and not key.startswith(self.root + "/")):
                continue
            name, sep, rel = self._rel(key).partition("/")
            if not sep or not rel or "/" in rel or rel in (".", ".."):
                continue
            if naming.parse(name) is None and naming.parse_aside(name) is None:
                continue
            out.append(Leftover(f"{name}/{rel}", name, "upload", [], [rel]))
        return out

    def _leftover_of(self, entry: str, listing: ObjectListing,
                     parse: Callable[[str], int | None]) -> Leftover | None:
        """The interrupted operation the marker object ``entry`` records, or None when it
        is no marker pitstop wrote (then it is not pitstop's to remove) or is gone."""
        try:
            doc = json.loads(self._ops.get(self._key(entry)))
        except FileNotFoundError:
            return None  # finished meanwhile
        except (ValueError, UnicodeDecodeError, RecursionError):
            return None
        if not (isinstance(doc, dict) and doc.get("kind") == _MARKER_KIND
                and isinstance(doc.get("name"), str) and isinstance(doc.get("files"), list)
                and entry.startswith(tmp_name(doc["name"], "",
                                              deleting=doc.get("op") == "delete"))
                and parse(doc["name"]) is not None):
            return None
        name = doc["name"]
        have = listing.dirs.get(name, {})
        files = [f for f in doc["files"] if isinstance(f, str) and "/" not in f
                 and f not in ("", ".", "..")]
        if doc.get("op") == "delete":
            objects = sorted(set(files) & set(have))
        elif MANIFEST in have:
            objects = []  # committed: only the marker was left behind
        else:
            objects = sorted(set(files) & set(have))
        return Leftover(entry, name, "delete" if doc.get("op") == "delete" else "save",
                        objects, [f for f in files if f != MANIFEST])

    def _clean_orphans(self, name: str) -> None:
        """Before a new save of ``name``: finish the cleanup a failed save of it in this
        process could not do (its marker names what it wrote)."""
        for marker, of in sorted(self._orphans):
            if of != name:
                continue
            try:
                listing = ObjectListing(self.location, dirs={name: self._objects(name)},
                                        files={marker: 0})
                item = self._leftover_of(marker, listing, lambda n: 0 if n == name else None)
                if item is not None:
                    self.remove_leftover(item)
            except OSError as e:
                log.debug("pitstop: cleanup of %s failed again: %s", marker, e)
                continue
            self._orphans.discard((marker, of))

    def cleanup_incomplete(self, naming: Naming = DEFAULT) -> list[str]:
        """Remove what interrupted saves and deletions left (see :meth:`leftovers`); returns
        what was removed, relative to the directory."""
        held = self._held
        if held is not None and not held.released and not held.forgotten:
            held.verify()  # (a writer that lost its lock cleans nothing: it is not the owner)
            return self._cleanup(naming)
        lease = self.lock()  # DirectoryLockedError while a live writer holds the directory
        try:
            return self._cleanup(naming)
        finally:
            lease.release()
            if self._held is lease:
                self._held = None

    def _cleanup(self, naming: Naming) -> list[str]:
        removed: list[str] = []
        for item in self.leftovers(naming):
            removed += self.remove_leftover(item)
        return removed

    def remove_leftover(self, item: Leftover) -> list[str]:
        """Remove one interrupted operation's objects (see :meth:`leftovers`): abort its
        unfinished uploads, delete what its marker names, then the marker; returns what was
        removed, relative to the directory."""
        if item.op == "tmpdir":
            base = self._key(item.entry.rstrip("/"))
            self._ops.delete(sorted(self._ops.list_prefix(base)))
            return [item.entry]
        if item.op == "meta":
            self._ops.delete([self._key(item.entry)])
            return [item.entry]
        if item.op == "upload":
            key = self._key(item.name, item.uploads[0])
            return [f"{self._rel(k)} (unfinished upload)" for k in
                    self._ops.abort_uploads(self._key(item.name) + "/", {key})]
        removed: list[str] = []
        if item.op == "delete":
            removed += self._finish_delete(item.name, item.objects)
        else:
            keys = {self._key(item.name, f) for f in item.uploads}
            if keys:
                removed += [f"{self._rel(k)} (unfinished upload)" for k in
                            self._ops.abort_uploads(self._key(item.name) + "/", keys)]
            if item.objects:
                self._bump(item.name)
                self._ops.delete([self._key(item.name, f) for f in item.objects])
                removed += [f"{item.name}/{f}" for f in item.objects]
        self._ops.delete([self._key(item.entry)])
        return [item.entry, *removed]

    # ------------------------------------------------------------------ lock
    def lock(self) -> Any:
        """Take the directory's writer lock (see the module's docstring)."""
        self.check()
        lease = _Lease.acquire(self)
        self._held = lease
        return lease

    def verify_held(self) -> None:
        """Raise DirectoryLockedError when this writer's lock is no longer its own (another
        writer took it over): nothing more is committed by this one."""
        lease = self._held
        if lease is not None:
            lease.verify()


@dataclass
class ObjectListing:
    """The objects under a directory URL, grouped by their first path segment."""

    location: str
    #: name -> {relpath: size} of every prefix ("directory") below the location
    dirs: dict[str, dict[str, int]] = field(default_factory=dict)
    #: objects right below the location (save and deletion markers among them)
    files: dict[str, int] = field(default_factory=dict)
    #: relpath -> size of the objects below .pitstop/
    meta: dict[str, int] = field(default_factory=dict)


@dataclass
class Leftover:
    """One interrupted operation: its marker (or temporary) ``entry``, the checkpoint
    ``name``, ``op`` ("save", "delete", "tmpdir", "meta", or "upload": an unfinished
    multipart upload no marker names, ``entry`` its object), the objects to delete and the
    ones whose unfinished multipart uploads to abort."""

    entry: str
    name: str
    op: str
    objects: list[str]
    uploads: list[str]

    def describe(self) -> list[str]:
        """The names ``pitstop gc`` prints for it."""
        if self.op == "upload":
            return [f"{self.entry} (unfinished upload)"]
        return [self.entry, *(f"{self.name}/{o}" for o in self.objects)]


def _is_tmp_meta(entry: str) -> bool:
    """A temporary of LocalStorage.write_meta (``<file>.tmp-<8 hex>``), copied here."""
    head, sep, tag = entry.rpartition(".tmp-")
    return bool(sep and head and "/" not in entry and len(tag) == 8
                and all(c in "0123456789abcdef" for c in tag))


class _ObjectTransaction(Transaction):
    """One save: marker first, data objects create-only, manifest last (the commit)."""

    def __init__(self, storage: FsspecStorage, name: str, joined: str | None = None) -> None:
        _check_segment(name, "checkpoint name")
        self.storage = storage
        self.name = name
        #: another rank's part of the leader's save (the leader's token); None: the leader's
        self.joined = joined
        self.location = storage.path_of(name)
        self.tag = uuid.uuid4().hex[:8]
        self.marker = tmp_name(name, self.tag)
        self.files: list[str] = []
        #: key -> etag of every object this save created (abort deletes exactly these)
        self.created: dict[str, str | None] = {}
        self._lock = threading.Lock()
        self.committed = False
        self.commit_tried = False
        self.manifest = b""
        self.token = self.tag
        ops = storage._ops
        storage._clean_orphans(name)
        if joined is None and ops.exists(storage._key(name, MANIFEST)):
            raise StepExistsError(
                f"{self.location} already exists (committed by another save of the same "
                "step); pitstop never overwrites a committed checkpoint")
        storage._write_marker(self.marker, {"op": "save", "name": name, "files": [],
                                            "host": socket.gethostname(), "pid": os.getpid(),
                                            "started_unix": time.time()})

    def open_write(self, relpath: str, direct: bool = False) -> Writer:
        key = self.storage._safe(self.name, relpath)
        with self.storage._gen_lock:
            self.storage._writing.add(key)
        with self._lock:
            self.files.append(relpath)
            # recorded before a byte of it is written: cleanup then knows it is ours
            self.storage._write_marker(self.marker, {"op": "save", "name": self.name,
                                                     "files": sorted(self.files)})
        return self.storage._ops.open_writer(key, True, self._created)

    def _settled(self) -> None:
        """This save writes nothing more: its keys are no longer this writer's uploads."""
        keys = {self.storage._key(self.name, f) for f in self.files}
        with self.storage._gen_lock:
            self.storage._writing -= keys

    def _created(self, key: str, etag: str | None) -> None:
        with self._lock:
            self.created[key] = etag

    def done(self) -> None:
        """Another rank's part, after the leader committed: its marker goes (its objects
        belong to the committed checkpoint now)."""
        self._settled()
        try:
            self.storage._ops.delete([self.storage._key(self.marker)])
        except OSError as e:  # cleanup removes a marker of a committed checkpoint later
            log.debug("pitstop: the marker %s stays (%s)", self.marker, e)

    def commit(self, manifest: bytes) -> None:
        if self.joined is not None:
            raise RuntimeError("only the leader's transaction commits")
        storage = self.storage
        key = storage._key(self.name, MANIFEST)
        self.manifest = bytes(manifest)
        self.commit_tried = True
        try:
            storage._ops.put(key, self.manifest, create_only=True)
        except FileExistsError:
            raise StepExistsError(
                f"{self.location} already exists (committed by another save of the same "
                "step meanwhile); pitstop never overwrites a committed checkpoint") from None
        self.committed = True
        self._settled()
        storage._bump(self.name)
        try:
            storage._ops.delete([storage._key(self.marker)])
        except OSError as e:  # committed all the same: cleanup removes the marker later
            log.debug("pitstop: %s committed, its marker stays (%s)", self.location, e)

    def abort(self) -> None:
        """Remove what this save wrote; never raises (what it cannot remove stays with its
        marker, for the next cleanup)."""
        if self.committed:
            return
        self._settled()
        storage, ops = self.storage, self.storage._ops
        try:
            if self.commit_tried:
                mkey = storage._key(self.name, MANIFEST)
                try:
                    now = ops.get(mkey)
                except FileNotFoundError:
                    now = None
                if now is not None and now != self.manifest:
                    return  # another writer's checkpoint: nothing here is ours to touch
                if now is not None:
                    try:
                        ops.delete([mkey])  # it landed after all: un-commit before data goes
                    except Exception:  # noqa: BLE001
                        # then it stays committed, whole (its data was complete)
                        log.warning("pitstop: %s was committed after all (its manifest "
                                    "landed though the request failed); it stays",
                                    self.location)
                        ops.delete([storage._key(self.marker)])
                        return
            storage._bump(self.name)
            if ops.conditional:
                doomed = sorted(self.created)  # created-only: these and no others are ours
            else:
                doomed = [storage._key(self.name, f) for f in self.files]
            ops.delete(doomed)
            ops.delete([storage._key(self.marker)])
        except Exception as e:  # noqa: BLE001 - the marker stays: cleanup finishes it
            storage._orphans.add((self.marker, self.name))
            log.warning("pitstop: could not remove the objects of the failed save %s (%s: %s); "
                        "the next save of this step, the next writer on this directory or "
                        "`pitstop gc` removes them", self.location, type(e).__name__, e)


# ====================================================================== the lock
_leases: weakref.WeakSet[_Lease] = weakref.WeakSet()
#: locations locked by this process (memory:// and every store without conditional writes)
_local_locks: dict[str, _Lease] = {}
_local_guard = threading.Lock()
_warned: set[str] = set()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, another user's
    return True


class _Lease:
    """The writer lock of one directory: ``release()`` and ``_forget()`` as LocalStorage's.

    On S3 it is the object ``.pitstop/lock``, renewed by a daemon thread; elsewhere it is
    held in this process (exact for memory://, which no other process can see)."""

    def __init__(self, storage: FsspecStorage, token: str, etag: str | None,
                 shared: bool) -> None:
        self.storage = storage
        self.key = storage._key(META_DIR, LOCK)
        self.url = storage._ops.url_of(self.key)
        self.token = token
        self.etag = etag
        #: the lock is an object in the store (S3); False: held in this process only
        self.shared = shared
        self.lost: str | None = None
        self.released = False
        self.forgotten = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._since = time.time()
        _leases.add(self)

    def body(self, probe: bool = False) -> bytes:
        doc = {"token": self.token, "host": socket.gethostname(), "pid": os.getpid(),
               "boot_id": boot_id(), "since": self._since, "renewed": time.time(),
               "ttl_s": self.storage.opts.lock_ttl}
        if probe:
            doc["probe"] = True  # differs from what is there: a store that took it ignored
        return json.dumps(doc).encode()

    # ------------------------------------------------------------------ taking it
    @classmethod
    def acquire(cls, storage: FsspecStorage) -> _Lease:
        if not isinstance(storage._ops, _S3Ops):
            return cls._acquire_local(storage)
        ops = storage._ops
        lease = cls(storage, uuid.uuid4().hex, None, shared=True)
        for _ in range(5):
            try:
                lease.etag = ops.put(lease.key, lease.body(), create_only=True)
            except FileExistsError:
                try:
                    data, etag, age = ops.get_lease(lease.key)
                except FileNotFoundError:
                    continue  # released meanwhile: try again
                why = cls._stale(data, age, storage.opts.lock_ttl)
                if why is None:
                    raise DirectoryLockedError(cls._busy(storage, data, age)) from None
                try:
                    lease.etag = ops.put_if_match(lease.key, lease.body(), etag)
                except _Conflict:
                    continue  # someone else was quicker
                log.warning("pitstop: took over the writer lock of %s: %s", storage.location,
                            why)
            break
        else:
            raise DirectoryLockedError(
                f"checkpoint directory {storage.location}: could not take the writer lock "
                f"({lease.url}); other writers keep taking it. Use one CheckpointManager per "
                "directory, or open it with read_only=True to only restore.")
        if ops.conditional:
            # does this endpoint honour If-None-Match? A second create must be refused
            try:
                again = ops.put(lease.key, lease.body(probe=True), create_only=True)
            except FileExistsError:
                pass
            else:
                lease.etag = again
                ops._no_conditions()
        lease._start()
        return lease

    @classmethod
    def _acquire_local(cls, storage: FsspecStorage) -> _Lease:
        with _local_guard:
            held = _local_locks.get(storage.location)
            if held is not None and not held.released and not held.forgotten:
                raise DirectoryLockedError(
                    f"checkpoint directory {storage.location} is in use by another writer "
                    f"(this process, pid {os.getpid()}). Use one CheckpointManager per "
                    "directory, or open it with read_only=True to only restore.")
            lease = cls(storage, uuid.uuid4().hex, None, shared=False)
            _local_locks[storage.location] = lease
        if storage.protocol != "memory" and storage.protocol not in _warned:
            _warned.add(storage.protocol)
            log.warning("pitstop: %s:// offers no conditional writes through fsspec, so "
                        "pitstop cannot keep a writer in another process out of %s; use one "
                        "writer per directory", storage.protocol, storage.location)
        return lease

    @staticmethod
    def _stale(data: bytes, age: float | None, ttl: float) -> str | None:
        """Why the lock in ``data`` may be taken over, or None while its holder may live."""
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            doc = None
        if not isinstance(doc, dict):
            doc = {}
        host, pid, boot = doc.get("host"), doc.get("pid"), doc.get("boot_id")
        if host == socket.gethostname() and boot and boot == boot_id() and \
                isinstance(pid, int) and not isinstance(pid, bool):
            if not _pid_alive(pid):
                return f"its holder, pid {pid} on this host, is dead"
            if pid == os.getpid() and not any(
                    lease.token == doc.get("token") and not lease.released and not
                    lease.forgotten for lease in list(_leases)):
                return "its holder was an earlier writer of this process that is gone"
        recorded = doc.get("ttl_s")
        limit = max(float(recorded) if isinstance(recorded, (int, float)) else ttl, 1.0)
        if age is not None and age >= limit:
            return f"not renewed for {age:.0f} s (its holder renews it every {limit / 4:.0f} s)"
        return None

    @staticmethod
    def _busy(storage: FsspecStorage, data: bytes, age: float | None) -> str:
        try:
            doc = json.loads(data)
            holder = f"pid {doc.get('pid')} on {doc.get('host')}"
            ttl = float(doc.get("ttl_s") or storage.opts.lock_ttl)
        except (ValueError, TypeError, AttributeError, UnicodeDecodeError, RecursionError):
            holder, ttl = "an unknown holder", storage.opts.lock_ttl
        renewed = f", renewed {age:.0f} s ago" if age is not None else ""
        return (f"checkpoint directory {storage.location} is in use by another writer "
                f"({holder}{renewed}). Use one CheckpointManager per directory, or open it "
                "with read_only=True to only restore. If that writer is gone, its lock "
                f"({storage.location}/{META_DIR}/{LOCK}) is taken over at once on its own host, "
                f"and anywhere {ttl:.0f} s after its last renewal.")

    # ------------------------------------------------------------------ holding it
    def _start(self) -> None:
        self._thread = threading.Thread(target=self._renew, name="pitstop-lock", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        ops = self.storage._ops
        interval = self.storage.opts.lock_ttl / 4
        failing = False
        while not self._stop.wait(interval):
            try:
                self.etag = ops.put_if_match(self.key, self.body(), self.etag)
            except _Conflict:
                self.lost = (f"checkpoint directory {self.storage.location}: another writer "
                             f"took over its lock ({self.url}) after this one could not renew "
                             "it in time; nothing more is committed by this manager")
                log.error("pitstop: %s", self.lost)
                return
            except Exception as e:  # noqa: BLE001 - retried; verify() decides at commit
                if not failing:
                    log.warning("pitstop: could not renew the writer lock %s (%s); retrying",
                                self.url, e)
                failing = True
                continue
            if failing:
                log.info("pitstop: renewed the writer lock %s again", self.url)
            failing = False

    def verify(self) -> None:
        """Raise DirectoryLockedError unless the store still names this writer the holder."""
        if self.released or self.forgotten or not self.shared:
            return
        if self.lost is not None:
            raise DirectoryLockedError(self.lost)
        try:
            data = self.storage._ops.get(self.key)
        except FileNotFoundError:
            raise DirectoryLockedError(
                f"checkpoint directory {self.storage.location}: its lock {self.url} was "
                "deleted while this writer held it; nothing more is committed by this "
                "manager") from None
        try:
            token = json.loads(data).get("token")
        except (ValueError, AttributeError, UnicodeDecodeError, RecursionError):
            token = None
        if token != self.token:
            self.lost = (f"checkpoint directory {self.storage.location}: another writer holds "
                         f"its lock now ({self.url}); nothing more is committed by this "
                         "manager, so it cannot mix with that writer's checkpoints")
            raise DirectoryLockedError(self.lost)

    def release(self) -> None:
        """Stop renewing and delete the lock object if it is still this writer's."""
        if self.released or self.forgotten:
            return
        self.released = True
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)  # a renewal under way; it cannot take the lock back
        if not self.shared:
            with _local_guard:
                if _local_locks.get(self.storage.location) is self:
                    del _local_locks[self.storage.location]
            return
        if self.lost is None:
            try:
                self.storage._ops.delete_if_match(self.key, self.etag)
            except _Conflict:
                pass  # another writer's now
            except Exception as e:  # noqa: BLE001 - it expires by itself
                log.warning("pitstop: could not release the writer lock %s (%s); it expires "
                            "%.0f s after its last renewal", self.url, e,
                            self.storage.opts.lock_ttl)

    def _forget(self) -> None:
        # in a forked child: the lock is the parent's; never renew or delete it from here
        self.forgotten = True


def _after_fork_in_child() -> None:
    for lease in list(_leases):
        lease._forget()


os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["FsspecStorage", "ObjectStoreError", "ObjectStoreTimeout", "ObjectListing",
           "Leftover", "TransferOptions"]
