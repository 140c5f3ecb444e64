"""Files in shared memory (``/dev/shm``, which every user of the machine shares): made
owner-only and never through a symlink, trusted only when this user owns them. Below both
the staging buffers (:mod:`pitstop.core.save.snapshot`) and the memory tier that describes them.
"""

from __future__ import annotations

import errno
import os
import stat

#: how the tier opens the files it creates: never through a symlink, never an existing file
CREATE_FLAGS = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def owner_name(uid: int) -> str:
    try:
        import pwd
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def untrusted_file(st: os.stat_result) -> str | None:
    """Why a tier file with this (``lstat`` / ``fstat``) status must not be trusted, or None:
    it must be a regular file this process's user owns that no one else may write."""
    if stat.S_ISLNK(st.st_mode):
        return "it is a symlink"
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid != os.geteuid():
        return f"it is owned by {owner_name(st.st_uid)}, not by this process's user"
    if st.st_mode & 0o022:
        return f"it is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def create_owned(path: str, flags: int) -> int:
    """Open a new tier file owner-only with ``O_EXCL | O_NOFOLLOW`` (plus ``flags``). A
    leftover of this user's at ``path`` (a regular file) is replaced; anything else there
    (another user's file, a symlink) raises OSError and is left alone."""
    for _ in range(2):
        try:
            fd = os.open(path, flags | CREATE_FLAGS, 0o600)
        except FileExistsError:
            st = os.lstat(path)
            why = untrusted_file(st)
            if why is not None and not (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()):
                raise OSError(errno.EEXIST, f"memory-tier file {path} is in the way and not "
                              f"pitstop's to replace ({why})", path) from None
            os.unlink(path)
            continue
        os.fchmod(fd, 0o600)  # exactly: a umask of 0o277 would leave it 0o400 (unattachable)
        return fd
    raise OSError(errno.EEXIST, f"memory-tier file {path} keeps coming back", path)
