"""The seam between :class:`FsspecStorage` and a store: names, limits, errors, transfer
options and the calls a store provides (:class:`_Ops`)."""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from dataclasses import dataclass

from pitstop.core.errors import InvalidArgumentError
from pitstop.core.storage.base import Writer

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


def _human(n: int) -> str:
    return f"{n / MiB:.1f} MiB" if n >= MiB else f"{n} B"


def _check_segment(name: str, what: str) -> None:
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise PermissionError(f"{what} {name!r} is not a single path segment")
