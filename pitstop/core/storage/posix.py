"""POSIX file helpers of the local storage: modes and directories pitstop creates, full reads,
what a checkpoint's files may be (no links, the owner's), fsync of a directory."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from typing import Any

from pitstop.core.directory.names import tmp_name

#: the directory mode pitstop gives what it creates unless told otherwise (owner only); its
#: files get the same without the execute bits (0o600)
OWNER_ONLY = 0o700


def file_mode(permissions: int | None) -> int:
    """The mode a new file is created with: the directory mode without execute bits, or
    0o644 (less the umask, as before) when ``permissions`` is None."""
    return 0o644 if permissions is None else permissions & 0o666


def make_dirs(path: str, permissions: int | None) -> None:
    """Create ``path`` and its missing parents, each with mode ``permissions`` exactly (the
    umask may only have narrowed it); directories that exist already are left as they are,
    never chmod-ed. ``None``: the umask decides, as ``os.makedirs`` does."""
    if permissions is None:
        os.makedirs(path, exist_ok=True)
        return
    if os.path.lexists(path) and not os.path.isdir(path):
        raise FileExistsError(errno.EEXIST, "not a directory", path)  # as os.makedirs
    missing = []
    while not os.path.lexists(path):  # (under a file: mkdir raises NotADirectoryError)
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, permissions)
        except FileExistsError:
            if not os.path.isdir(d):
                raise
            continue  # made by someone else meanwhile: theirs, left alone
        os.chmod(d, permissions)


def _widen(fd: int, mode: int) -> None:
    """Give a file just created with ``mode`` the bits the umask took off. Also for the
    default 0o600: a umask with the owner's write bit (0o277) made it 0o400, and the next
    manager could not open its own lock (EACCES)."""
    os.fchmod(fd, mode)

#: how a manifest is opened to hold (or test) its read lease: never blocking on a FIFO put
#: in its place (the reader then refuses it as not a regular file)
_LEASE_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK


def pread_full(fd: int, out: Any, offset: int) -> int:
    """Fill the writable, contiguous buffer ``out`` from ``offset`` (fewer bytes only at EOF)."""
    view = memoryview(out).cast("B")
    total = 0
    while total < len(view):
        got = os.preadv(fd, [view[total:]], offset + total)
        if got == 0:
            break
        total += got
    return total


def _is(path: str, kind: Any) -> bool:
    """``kind(mode)`` of ``path`` itself (never following a symlink); False if it is gone."""
    try:
        return bool(kind(os.lstat(path).st_mode))
    except OSError:
        return False


_DELETING = tmp_name("x", "0" * 8, deleting=True).split("x")[0]  # ".tmp-deleting-"


def _remove_trash(path: str) -> None:
    """Remove a deletion's (or save's) leftover: a directory with its contents; a checkpoint
    that was a symlink (a step moved to another disk) only as the link, never through it."""
    if _is(path, stat.S_ISLNK):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    shutil.rmtree(path, ignore_errors=True)


def _kind(mode: int) -> str:
    """What a non-regular file is, for messages."""
    for test, what in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return what
    return "not a regular file"


class LinkedFileError(PermissionError):
    """A checkpoint's file has a second name (a hard link): refused, but not corrupt (a
    backup made with ``cp -al`` or ``rsync --link-dest`` links every file of a live run),
    so restore() leaves the checkpoint in place."""


def _check_own(st: os.stat_result, name: str, relpath: str) -> None:
    """A checkpoint's file is read only when it is a regular file of its own: not a FIFO,
    a device or a directory, and not a hard link (a second name of a file elsewhere, which
    can change under it while the checkpoint does not: a symlink is refused for the same
    reason). pitstop never links files, between checkpoints either (an incremental one
    names the older checkpoint that holds the bytes), so every file it wrote has one name."""
    if not stat.S_ISREG(st.st_mode):
        raise PermissionError(f"{relpath!r} in checkpoint {name!r} is {_kind(st.st_mode)}, "
                              "not a regular file")
    if st.st_nlink > 1:
        raise LinkedFileError(
            f"{relpath!r} in checkpoint {name!r} has {st.st_nlink} names (a hard link to a "
            "file that is also elsewhere, not one pitstop wrote there): not read. A copy made "
            "with cp -al or rsync --link-dest links files; copy with cp -a (or rsync without "
            "--link-dest) to read it")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
