"""S3 and S3-compatible endpoints through s3fs's aiobotocore client: every request under a
deadline, bounded retries, conditional writes, errors a user can act on."""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import errno
from collections.abc import Awaitable, Callable
from typing import Any

from pitstop.core.errors import CheckpointError
from pitstop.core.storage.base import Writer
from pitstop.core.storage.objectstore.ops import (
    MAX_PART,
    MIN_PART,
    MiB,
    ObjectStoreError,
    ObjectStoreTimeout,
    TransferOptions,
    _Conflict,
    _human,
    _not_found,
    _Ops,
    _Unsupported,
    log,
)
from pitstop.core.storage.objectstore.upload import _S3Writer


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
