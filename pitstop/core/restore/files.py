"""A checkpoint's data files: each read through one descriptor with a read-ahead window,
checked against the lengths the manifest records (those of older checkpoints an incremental
one references, its holder files, too), and every OSError turned into a CheckpointError
that names the file."""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from pitstop.core.errors import CheckpointError, CorruptCheckpointError
from pitstop.core.format.schema import ArrayEntry, Manifest
from pitstop.core.storage.local import pread_full

SMALL = 1 << 20
WINDOW = 8 << 20
#: the first read-ahead window after a jump: small reads that follow one another in the file
#: double it up to WINDOW, so one small array between large ones (a torch optimizer's
#: ``step`` between its moments) reads this much, not WINDOW it throws away
WINDOW_MIN = 256 << 10


class CheckpointFiles:
    """The data files of one committed checkpoint (the base of
    :class:`~pitstop.core.restore.read.CheckpointReader`, which opens the manifest and sets
    what is declared here)."""

    storage: Any
    name: str
    where: str
    threads: int
    manifest: Manifest
    _sources: dict[tuple[str, str], _FileSource]

    # ------------------------------------------------------------------ checks
    def check_files(self) -> None:
        """Cheap structural check: every data file exists with the recorded length (those
        of older checkpoints an incremental one references too)."""
        files = [("", f, n) for f, n in self.manifest.files.items()]
        files += [(h, f, n) for h, held in self.manifest.refs.items() for f, n in held.items()]
        for holder, fname, length in files:
            try:
                actual = self.storage.size(holder or self.name, fname)
            except FileNotFoundError:
                raise self._missing(holder, fname) from None
            except OSError as e:
                raise _os_error(self.where, _shown(holder, fname), e) from None
            if actual != length:
                raise CorruptCheckpointError(
                    f"{self.where}: data file {_shown(holder, fname)} has {actual} bytes, the "
                    f"manifest recorded {length} (truncated or overwritten)"
                    f"{self._held_in(fname, holder)}", checkpoint=self.where, file=fname)

    def _missing(self, holder: str, fname: str) -> CorruptCheckpointError:
        """A data file that is not there; for a referenced one, says whose it is."""
        if not holder:
            return CorruptCheckpointError(
                f"{self.where}: data file {fname} is missing{self._held_in(fname)}",
                checkpoint=self.where, file=fname)
        return CorruptCheckpointError(
            f"{self.where}: data file {fname} of checkpoint {holder} is missing"
            f"{self._held_in(fname, holder)}: this incremental checkpoint references those "
            f"arrays' bytes in {holder}, which was deleted or moved aside (or lost that file). "
            "It cannot be restored; restore() falls back to an older checkpoint. Never delete "
            "a checkpoint by hand that a kept one references (pitstop ls shows which)",
            checkpoint=self.where, file=fname)

    def _held_in(self, fname: str, holder: str = "") -> str:
        """Which arrays a damaged data file holds, for its error: what the user lost."""
        keys = [k for k, e in self.manifest.arrays.items()
                if any(p.file == fname and (p.ref or "") == holder for p in e.parts)]
        if not keys:
            return ""
        more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
        return f"; it holds array(s) {', '.join(repr(k) for k in keys[:5])}{more}"

    def _read(self, entry: ArrayEntry, offset: int, out: np.ndarray) -> int:
        src = self._sources.get((entry.ref or "", entry.file))
        try:
            if src is not None:
                return src.read_into(offset, out)
            # (an incremental entry's bytes: in the older checkpoint it references)
            return self.storage.read_into(entry.ref or self.name, entry.file, offset, out)
        except FileNotFoundError:
            raise self._missing(entry.ref or "", entry.file) from None
        except OSError as e:
            raise _os_error(self.where, _shown(entry.ref or "", entry.file), e) from None

    def per_file(self, items: list[Any], fn: Any) -> None:
        """Run ``fn`` over items (sorted by file, then offset), one thread per data file, so
        each file is read sequentially while reading and hash checks overlap across files."""
        by_file: dict[tuple[str, str], list[Any]] = {}
        for item in items:
            by_file.setdefault(item[-1].origin, []).append(item)
        runs = list(by_file.values())
        for origin in by_file:
            if origin not in self._sources:
                self._sources[origin] = _FileSource(self, *origin)
        try:
            if len(runs) <= 1 or self.threads <= 1:
                for item in items:
                    fn(item)
                return
            with ThreadPoolExecutor(min(self.threads, len(runs)),
                                    thread_name_prefix="pitstop-read") as ex:
                for _ in ex.map(lambda run: [fn(i) for i in run], runs):
                    pass
        finally:
            for src in self._sources.values():
                src.close()
            self._sources.clear()


class _FileSource:
    """Reads one data file through one descriptor; small reads are served from a window
    read ahead in one call, so thousands of small tensors cost a few large reads. The window
    grows as the kernel's read-ahead does: from WINDOW_MIN after a jump, doubled each time a
    small read continues where the last window ended, up to WINDOW."""

    def __init__(self, reader: CheckpointFiles, holder: str, fname: str) -> None:
        self.reader = reader
        #: the checkpoint whose file this is (an incremental one's referenced data)
        self.holder = holder or reader.name
        self.fname = fname
        self.length = reader.manifest.refs[holder].get(fname, 0) if holder else \
            reader.manifest.files.get(fname, 0)
        opener = getattr(reader.storage, "open_reader", None)
        self.fd: int | None = None
        if opener is not None:
            try:
                self.fd = opener(self.holder, fname)
            except OSError:
                self.fd = None  # the plain path below reports it
        self.window = np.empty(0, np.uint8)
        self.w_start = self.w_end = 0
        #: the size of the next window read
        self.span = WINDOW_MIN
        #: one reader at a time: the shards of a sharded array may lie in several data files,
        #: so a file's source can be read by another file's thread too
        self.lock = threading.Lock()

    def read_into(self, offset: int, out: np.ndarray) -> int:
        with self.lock:
            return self._read_into(offset, out)

    def _read_into(self, offset: int, out: np.ndarray) -> int:
        n = out.nbytes
        if self.fd is None:
            return self.reader.storage.read_into(self.holder, self.fname, offset, out)
        if n <= SMALL and not (self.w_start <= offset and offset + n <= self.w_end):
            # (sequential: it starts in the last window or within an alignment page after it)
            sequential = self.w_start < self.w_end and \
                self.w_start <= offset < self.w_end + 4096
            self.span = min(WINDOW, 2 * self.span) if sequential else WINDOW_MIN
            size = max(0, min(max(self.span, n), self.length - offset))
            if self.window.size < WINDOW:
                self.window = np.empty(WINDOW, np.uint8)
            got = _pread(self.fd, self.window[:size], offset)
            self.w_start, self.w_end = offset, offset + got
        if self.w_start <= offset and offset + n <= self.w_end:
            a = offset - self.w_start
            out.reshape(-1).view(np.uint8)[:] = self.window[a:a + n]
            return n
        return _pread(self.fd, out, offset)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _pread(fd: int, out: np.ndarray, offset: int) -> int:
    if not out.flags.c_contiguous:
        raise ValueError("reads go into C-contiguous buffers only")
    return pread_full(fd, out.reshape(-1).view(np.uint8).data if out.size else bytearray(), offset)


#: errors that say the checkpoint's own files are not what the manifest describes (moved
#: aside as corrupt); any other OSError (an I/O error, a full cache) is a read failure
_STRUCTURAL = (errno.ENOENT, errno.EISDIR, errno.ENOTDIR, errno.ELOOP, errno.EACCES,
               errno.EPERM)


def _os_error(where: str, fname: str, e: OSError) -> CheckpointError:
    """A CheckpointError for an OSError met while reading ``fname`` of a checkpoint."""
    if isinstance(e, PermissionError) and e.errno is None:
        # LocalStorage refusing a path that leads outside the checkpoint (a symlink), or a
        # file with a second name: that one stays in place (``linked``)
        err = CorruptCheckpointError(f"{where}: {e}", checkpoint=where, file=fname)
        from pitstop.core.storage.posix import LinkedFileError
        err.linked = isinstance(e, LinkedFileError)
        return err
    if e.errno in _STRUCTURAL:
        return CorruptCheckpointError(
            f"{where}: {fname} cannot be read ({e.strerror or e}): not the file the "
            "manifest describes", checkpoint=where, file=fname)
    return CheckpointError(f"{where}: reading {fname} failed ({type(e).__name__}: {e}); the "
                           "checkpoint may be intact: retry, or check the storage")


def _shown(holder: str, fname: str) -> str:
    """A data file as errors name it: ``../step_0000000003/data-000.bin`` when an
    incremental checkpoint references it in an older checkpoint."""
    return f"../{holder}/{fname}" if holder else fname
