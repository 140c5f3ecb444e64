"""Local POSIX storage: temporary directory, fsync every file, manifest last, atomic rename."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import stat
import time
import uuid
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

from pitstop.core.directory.names import DEFAULT, Naming, aside_name, tmp_name
from pitstop.core.errors import DirectoryLockedError, StepExistsError
from pitstop.core.storage.base import Storage, Transaction, Writer
from pitstop.core.storage.posix import (
    _DELETING,
    _LEASE_FLAGS,
    OWNER_ONLY,
    _check_own,
    _is,
    _kind,
    _remove_trash,
    _widen,
    file_mode,
    fsync_dir,
    make_dirs,
    pread_full,
)

#: what write_meta names its temporaries inside META_DIR (begin() and delete() name theirs
#: by names.tmp_name): cleanup removes these only, never anything else a user keeps there
_TMP_META = re.compile(r"^.+\.tmp-[0-9a-f]{8}$")
META_DIR = ".pitstop"
MANIFEST = "manifest.json"
#: one POSIX_FADV_WILLNEED call per this many bytes: the kernel reads ahead at most its
#: read-ahead window (often 128 KiB to 8 MiB) per call, so one call for a whole file warms little
WARM_CHUNK = 4 << 20
class _FileWriter(Writer):
    """Writes one file; with ``direct`` it tries O_DIRECT (DMA from the caller's page-aligned
    buffer, no page-cache copy) and falls back to buffered I/O where that is refused."""

    __slots__ = ("fd", "durable", "direct")

    def __init__(self, path: str, durable: bool, direct: bool = False,
                 mode: int | None = None) -> None:
        """``mode``: the file's exact mode; None: 0o644 less the umask."""
        exact = mode is not None
        mode = 0o644 if mode is None else mode
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        self.direct = False
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, mode)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
        if not self.direct:
            try:
                self.fd = os.open(path, flags, mode)
            except FileExistsError:
                if not direct:
                    raise
                # Linux checks O_DIRECT only after O_CREAT made the file (tmpfs before 6.6,
                # some FUSE file systems): the refused open left it, empty. It is ours: an
                # older file would have failed that open with EEXIST, before the EINVAL
                self.fd = os.open(path, (flags & ~os.O_EXCL) | os.O_TRUNC, mode)
        self.durable = durable
        if exact:
            _widen(self.fd, mode)

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while view:
            try:
                n = os.write(self.fd, view)
            except OSError as e:
                if not self.direct or e.errno != errno.EINVAL:
                    raise
                # the file system or this buffer's alignment refuses O_DIRECT: go buffered
                fcntl.fcntl(self.fd, fcntl.F_SETFL,
                            fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self.direct = False
                continue
            view = view[n:]

    def close(self) -> None:
        try:
            if self.durable:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)


class _LocalTransaction(Transaction):
    def __init__(self, storage: LocalStorage, name: str, token: str | None = None) -> None:
        self.storage = storage
        self.name = name
        #: None: the leader's (it made the directory); else another rank's part of it
        self.joined = token
        self.token = token or uuid.uuid4().hex[:8]
        self.tmp = os.path.join(storage.location, tmp_name(name, self.token))
        if token is None:
            perm = storage.permissions
            os.mkdir(self.tmp, 0o777 if perm is None else perm)
            if perm is not None:
                os.chmod(self.tmp, perm)  # exactly: the umask may have narrowed it
        elif not os.path.isdir(self.tmp):
            raise FileNotFoundError(errno.ENOENT, "the leader's temporary checkpoint is gone "
                                    "(aborted, or another file system than the leader's)",
                                    self.tmp)
        self.location = os.path.join(storage.location, name)
        self.written: list[str] = []

    def open_write(self, relpath: str, direct: bool = False) -> Writer:
        path = os.path.join(self.tmp, relpath)
        w = _FileWriter(path, self.storage.durable, direct and self.storage.direct_io,
                        self.storage.exact_file_mode)
        self.written.append(path)
        return w

    def commit(self, manifest: bytes) -> None:
        if self.joined is not None:
            raise RuntimeError("only the leader's transaction commits")
        w = _FileWriter(os.path.join(self.tmp, MANIFEST), self.storage.durable,
                        mode=self.storage.exact_file_mode)
        try:
            w.write(manifest)
        finally:
            w.close()
        if self.storage.durable:
            fsync_dir(self.tmp)
        # rename() refuses a non-empty target, so a committed checkpoint is never replaced.
        try:
            os.rename(self.tmp, self.location)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise StepExistsError(
                f"{self.location} already exists (committed by another save of the same "
                "step); pitstop never overwrites a committed checkpoint") from None
        if self.storage.durable:
            fsync_dir(self.storage.location)

    def abort(self) -> None:
        if self.joined is None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        for path in self.written:
            with contextlib.suppress(OSError):
                os.unlink(path)


class LocalStorage(Storage):
    """A checkpoint directory on a local (POSIX) file system.

    ``permissions`` is the mode of every directory it creates (the run directory and its
    missing parents, ``.pitstop``, each checkpoint's directory); the files it creates get the
    same without the execute bits. Owner-only (0o700 / 0o600) by default; ``None`` lets the
    umask decide, as before. A directory that exists already is never chmod-ed."""

    atomic_rename = True
    supports_locking = True

    def __init__(self, location: str, *, durable: bool = True, create: bool = True,
                 direct_io: bool = True, permissions: int | None = OWNER_ONLY) -> None:
        self.location = os.path.abspath(os.fspath(location))
        self.durable = durable
        self.direct_io = direct_io
        self.permissions = permissions
        self.file_mode = file_mode(permissions)
        #: the mode new files get exactly, or None where the umask decides
        self.exact_file_mode = None if permissions is None else self.file_mode
        if create:
            make_dirs(os.path.join(self.location, META_DIR), permissions)

    # ------------------------------------------------------------------ writes
    def begin(self, name: str) -> Transaction:
        return _LocalTransaction(self, name)

    def join(self, name: str, token: str) -> Transaction:
        if not isinstance(token, str) or not re.fullmatch(r"[0-9a-f]{8}", token):
            raise ValueError(f"not a transaction token of this storage: {token!r}")
        return _LocalTransaction(self, name, token)

    def file_stamp(self, name: str, relpath: str) -> tuple[int, int, int, int]:
        """What changes when one of a checkpoint's files is replaced or written to (inode,
        size, modification and change times): a copy of it elsewhere (the staging buffer)
        stands for it only while this stays the same."""
        st = os.stat(self._safe(name, relpath), follow_symlinks=False)
        return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def warm_cache(self, name: str, files: Iterable[str]) -> None:
        """Ask the kernel to read a just-committed checkpoint's data files back into the page
        cache, in the background (``POSIX_FADV_WILLNEED``, one read-ahead window per call).

        Data files are written with O_DIRECT, which leaves nothing in the page cache; without
        this, the commonest restart of all (Ctrl+C, fix, run again on the same machine) would
        read from disk, where ``torch.load`` of a file written a minute ago reads from memory.
        Costs a few syscalls and a disk read the kernel does asynchronously; best effort."""
        advise = getattr(os, "posix_fadvise", None)
        if advise is None:
            return
        for relpath in files:
            try:
                fd = self._open(name, relpath)
            except OSError:
                return  # deleted already (retention, another process): nothing to warm
            try:
                size = os.fstat(fd).st_size
                for off in range(0, size, WARM_CHUNK):
                    advise(fd, off, WARM_CHUNK, os.POSIX_FADV_WILLNEED)
            except OSError:
                return
            finally:
                os.close(fd)

    def delete(self, name: str) -> None:
        path = os.path.join(self.location, name)
        # Rename first so a crash mid-delete leaves a leftover that cleanup removes, never a
        # half-deleted directory that looks committed.
        trash = os.path.join(self.location, tmp_name(name, uuid.uuid4().hex[:8], deleting=True))
        os.rename(path, trash)
        _remove_trash(trash)

    def delete_if_unread(self, name: str) -> bool:
        """Delete ``name`` unless a reader (any process) holds its read lease."""
        path = os.path.join(self.location, name, MANIFEST)
        try:
            fd = os.open(path, _LEASE_FLAGS)
        except FileNotFoundError:
            self.delete(name)
            return True
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False
            self.delete(name)
            return True
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def read_lease(self, name: str) -> Iterator[None]:
        """Hold a shared lock on a checkpoint while reading it, so retention skips it."""
        try:
            fd = os.open(os.path.join(self.location, name, MANIFEST), _LEASE_FLAGS)
        except FileNotFoundError:
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)

    def move_aside(self, name: str, reason: str, wait_s: float = 30.0) -> str:
        """Move a checkpoint aside (kept for inspection, no longer listed); waits up to
        ``wait_s`` for readers holding its read lease (``pitstop verify``) to finish."""
        new = aside_name(name, reason, int(time.time()), uuid.uuid4().hex[:4])
        try:
            fd = os.open(os.path.join(self.location, name, MANIFEST), _LEASE_FLAGS)
        except OSError:
            fd = None  # no readable manifest (a corrupt checkpoint): nobody can lease it
        try:
            if fd is not None:
                deadline = time.monotonic() + wait_s
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except OSError:
                        if time.monotonic() >= deadline:
                            break  # a reader that never ends must not block training
                        time.sleep(0.05)
            os.rename(os.path.join(self.location, name), os.path.join(self.location, new))
        finally:
            if fd is not None:
                os.close(fd)
        if self.durable:
            fsync_dir(self.location)
        return new

    def cleanup_incomplete(self, naming: Naming = DEFAULT) -> list[str]:
        """Remove what interrupted saves, deletions and index writes left; only entries whose
        name and type pitstop makes (a directory ``.tmp-<checkpoint name of naming>-…``, a
        file ``.pitstop/….tmp-…``), and only those really removed are returned."""
        removed = []
        for entry in os.listdir(self.location):
            path = os.path.join(self.location, entry)
            if naming.parse_tmp(entry) is None:
                continue
            if _is(path, stat.S_ISDIR) or (entry.startswith(_DELETING)
                                           and _is(path, stat.S_ISLNK)):
                _remove_trash(path)
                if not os.path.lexists(path):
                    removed.append(entry)
        meta = os.path.join(self.location, META_DIR)
        for entry in os.listdir(meta) if _is(meta, stat.S_ISDIR) else []:
            path = os.path.join(meta, entry)
            if _TMP_META.match(entry) and _is(path, stat.S_ISREG):  # an interrupted write_meta
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                removed.append(f"{META_DIR}/{entry}")
        return removed

    def write_meta(self, relpath: str, data: bytes, *, durable: bool = True) -> None:
        path = os.path.join(self.location, META_DIR, relpath)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        mode = 0o666 if self.permissions is None else self.file_mode
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
            if self.permissions is not None:
                _widen(fd, mode)
            with open(fd, "wb") as f:
                f.write(data)
                if self.durable and durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            # a full disk: the temporary must not stay and take the space the next write needs
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if self.durable and durable:
            fsync_dir(os.path.dirname(path))

    # ------------------------------------------------------------------ reads
    def list_checkpoints(self) -> list[str]:
        """Committed checkpoints: entries with a manifest. A listing during which an entry
        disappeared (retention renamed it away, maybe after committing one this listing's
        entries were read too early to hold) is made again, so it never comes back short
        of both the old checkpoint and the new one."""
        for _ in range(3):
            out, torn = [], False
            for e in self._entries():
                if e.startswith("."):
                    continue
                path = os.path.join(self.location, e)
                if os.path.isfile(os.path.join(path, MANIFEST)):
                    out.append(e)
                elif not os.path.lexists(path):
                    torn = True
            if not torn:
                break
        return out

    def _entries(self) -> list[str]:
        try:
            return os.listdir(self.location)
        except FileNotFoundError:
            return []

    def _safe(self, name: str, relpath: str) -> str:
        base = os.path.realpath(os.path.join(self.location, name))
        path = os.path.realpath(os.path.join(base, relpath))
        if os.path.commonpath([base, path]) != base or path == base:
            raise PermissionError(f"path {relpath!r} points outside checkpoint {name!r}")
        return path

    def _open(self, name: str, relpath: str) -> int:
        """A descriptor of one of the checkpoint's own files, for reading: never through a
        symlink that leaves the checkpoint, and only a regular file (a FIFO, a device or a
        directory in its place is refused at once, without blocking on it)."""
        path = self._safe(name, relpath)
        # O_NOFOLLOW: the checked path cannot be swapped for a symlink before the open;
        # O_NONBLOCK: opening a FIFO with no writer returns at once (it has no effect on
        # the reads of a regular file)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            _check_own(os.fstat(fd), name, relpath)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read_bytes(self, name: str, relpath: str) -> bytes:
        with os.fdopen(self._open(name, relpath), "rb") as f:
            return f.read()

    def read_into(self, name: str, relpath: str, offset: int, out: Any) -> int:
        fd = self._open(name, relpath)
        try:
            return pread_full(fd, out, offset)
        finally:
            os.close(fd)

    def open_reader(self, name: str, relpath: str) -> int:
        return self._open(name, relpath)

    def size(self, name: str, relpath: str) -> int:
        st = os.stat(self._safe(name, relpath))
        _check_own(st, name, relpath)
        return st.st_size

    def read_meta(self, relpath: str) -> bytes | None:
        path = os.path.join(self.location, META_DIR, relpath)
        try:
            # O_NONBLOCK: a FIFO in the file's place (a buggy tool, or whoever else can write
            # .pitstop) must be refused at once, not block the manager or the CLI forever
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise OSError(errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL,
                              f"{META_DIR}/{relpath} is {_kind(mode)}, not pitstop's file",
                              path)
            return f.read()

    # ------------------------------------------------------------------ lock
    def lock(self) -> Any:
        """Take the directory's writer lock (flock: released by the kernel if the holder dies)."""
        path = os.path.join(self.location, META_DIR, "lock")
        # O_NOFOLLOW: the lock is truncated and written below, so a symlink planted in its
        # place (by whoever can write .pitstop, e.g. another user who made the run
        # directory in /tmp) must never lead that write to a file of the victim's
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                         | os.O_NOFOLLOW, self.file_mode)
            if self.permissions is not None:
                _widen(fd, self.file_mode)  # new: the mode asked for, exactly
        except FileExistsError:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
                             | os.O_NONBLOCK, self.file_mode)
            except OSError as e:
                if e.errno != errno.ELOOP:
                    raise
                raise OSError(errno.ELOOP, f"the lock file {path} is a symlink, not "
                              "pitstop's; remove it (pitstop never writes through it)",
                              path) from None
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise OSError(errno.EINVAL, f"the lock file {path} is {_kind(mode)}, not "
                          "pitstop's; remove it", path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = ""
            try:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            finally:
                os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise DirectoryLockedError(
                    f"checkpoint directory {self.location} is in use by another writer "
                    f"({holder or 'unknown holder'}). Use one CheckpointManager per directory, "
                    "or open it with read_only=True to only restore."
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
        self._held = _Lock(fd, path)
        return self._held

    def verify_held(self) -> None:
        """Raise when the lock this storage holds is no longer the directory's lock: the
        directory was deleted or replaced under it (another writer may own the path now)."""
        held = getattr(self, "_held", None)
        if held is None or held.fd is None:
            return
        try:
            now = os.stat(held.path)
            mine = os.fstat(held.fd)
        except OSError as e:
            raise DirectoryLockedError(
                f"checkpoint directory {self.location} was deleted or replaced while this "
                f"writer held it ({e}); nothing more is saved there by this manager") from None
        if (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
            raise DirectoryLockedError(
                f"checkpoint directory {self.location} was deleted or replaced while this "
                "writer held it (its lock file is another one now); nothing more is saved "
                "there by this manager, so it cannot mix with another run's checkpoints")


class _Lock:
    def __init__(self, fd: int, path: str = "") -> None:
        self.fd: int | None = fd
        self.path = path
        _held.add(self)

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def _forget(self) -> None:
        # in a forked child: the flock belongs to the parent. Closing our copy of the fd
        # keeps a child that outlives a killed parent (a data-loader worker) from holding
        # the directory; never LOCK_UN here, that would release the parent's lock too.
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


_held: weakref.WeakSet[_Lock] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for lock in list(_held):
        lock._forget()


os.register_at_fork(after_in_child=_after_fork_in_child)
