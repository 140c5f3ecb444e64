"""FsspecStorage: checkpoints under an object-store URL (see the package's docstring),
and the listings and leftovers its cleanup works on."""

from __future__ import annotations

import contextlib
import copy
import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pitstop.core.directory.names import DEFAULT, Naming, aside_name, tmp_name
from pitstop.core.errors import CheckpointError, InvalidArgumentError
from pitstop.core.storage.base import Storage, Transaction
from pitstop.core.storage.objectstore.generic import _FsOps
from pitstop.core.storage.objectstore.lease import _Lease
from pitstop.core.storage.objectstore.ops import (
    _MARKER_KIND,
    MANIFEST,
    META_DIR,
    SMALL_READ,
    WINDOW,
    WINDOW_TTL,
    MiB,
    TransferOptions,
    _check_segment,
    _not_found,
    _Ops,
    log,
)
from pitstop.core.storage.objectstore.s3 import _S3Ops
from pitstop.core.storage.objectstore.transaction import _ObjectTransaction


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
