"""Staging buffers (one reusable host copy of the state) and the in-memory tier.

A snapshot copies every array leaf into one contiguous staging buffer at aligned offsets.
Buffers are allocated once per layout (keys, shapes, dtypes) and reused while it stays the
same, so the steady state allocates nothing. With the memory tier on, the buffer is a file
in ``/dev/shm``: the same copy then outlives a crashed process, and a restart can restore
from it and finish persisting it (see :mod:`pitstop.core.save.memtier`).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pitstop.core.errors import CheckpointError
from pitstop.core.format.dtypes import encode_dtype
from pitstop.core.format.schema import SHARD_MARK
from pitstop.core.save.shmfiles import create_owned, untrusted_file
from pitstop.core.tree import ArrayLeaf

log = logging.getLogger("pitstop")

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
#: madvise(MADV_POPULATE_WRITE) (Linux 5.14): maps every page in bulk like MAP_POPULATE, but
#: called through ctypes, which lets go of Python's lock (mmap() with MAP_POPULATE, and
#: mmap.madvise, hold it for the whole population: seconds for a GiB on a virtual machine,
#: during which a staging buffer made ahead on its own thread would stall training)
MADV_POPULATE_WRITE = 23


#: transparent huge pages for the anonymous staging buffer (where the kernel grants them,
#: e.g. /sys/kernel/mm/transparent_hugepage/enabled = madvise): the O_DIRECT writes pin
#: 512x fewer pages (background CPU of a persist: 0.035 -> 0.015 s/GiB) and the copy into
#: it takes fewer TLB misses
MADV_HUGEPAGE = 14


def _populate(m: mmap.mmap, size: int, huge: bool = False) -> bool:
    """Map every page of ``m`` now without holding Python's lock; False where it cannot.
    ``huge``: ask for transparent huge pages first (anonymous memory; refused quietly)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        view = np.frombuffer(m, np.uint8)
        addr = view.ctypes.data
        del view
        if huge:
            libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(size), MADV_HUGEPAGE)
        return libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(size),
                            MADV_POPULATE_WRITE) == 0
    except (OSError, AttributeError, ValueError):
        return False


def _mapped(fd: int, size: int, flags: int) -> mmap.mmap:
    """``size`` bytes mapped from ``fd`` (-1: anonymous), every page present."""
    m = mmap.mmap(fd, size, flags=flags)
    if _populate(m, size, huge=fd == -1):
        return m
    m.close()  # an older kernel (EINVAL): map it again the old way
    return mmap.mmap(fd, size, flags=flags | _POPULATE)
SMALL_ALIGN = 64
LARGE_ALIGN = 4096
LARGE = 1 << 20


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Layout:
    """Where each array sits inside a staging buffer."""

    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    offsets: tuple[int, ...]
    nbytes: tuple[int, ...]
    total: int
    #: index of the first array of each write group (one data file each); every group
    #: starts page-aligned so it can be written with O_DIRECT straight from the buffer
    group_starts: tuple[int, ...] = (0,)
    #: some keys are shards of one array (piece keys): the manifest groups them; found once
    #: per layout (however it was made) rather than at every save
    sharded: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sharded", any(SHARD_MARK in k for k in self.keys))

    @classmethod
    def of(cls, arrays: dict[str, ArrayLeaf], groups: int = 1) -> Layout:
        keys, shapes, dtypes, offsets, sizes = [], [], [], [], []
        total_bytes = sum(leaf.nbytes for leaf in arrays.values())
        target = max(1, -(-total_bytes // max(1, groups)))
        starts = [0]
        acc = 0
        pos = 0
        for i, (key, leaf) in enumerate(arrays.items()):
            n = leaf.nbytes
            if acc >= target and len(starts) < groups:
                starts.append(i)
                acc = 0
                pos = _align(pos, LARGE_ALIGN)
            acc += n
            pos = _align(pos, LARGE_ALIGN if n >= LARGE else SMALL_ALIGN)
            keys.append(key)
            shapes.append(tuple(leaf.shape))
            dtypes.append(leaf.dtype)
            offsets.append(pos)
            sizes.append(n)
            pos += n
        return cls(tuple(keys), tuple(shapes), tuple(dtypes), tuple(offsets), tuple(sizes),
                   _align(pos, LARGE_ALIGN), tuple(starts) if keys else ())

    def groups(self) -> list[list[int]]:
        """Array indices per write group, in order."""
        bounds = list(self.group_starts) + [len(self.keys)]
        return [list(range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]

    def to_json(self) -> dict[str, Any]:
        return {"total": self.total, "group_starts": list(self.group_starts), "arrays": [
            [k, encode_dtype(d), list(s), o, n]
            for k, s, d, o, n in zip(self.keys, self.shapes, self.dtypes, self.offsets, self.nbytes,
                                     strict=True)]}


class StagingBuffer:
    """One host copy of the state: a byte buffer plus a typed view per array."""

    def __init__(self, layout: Layout, shm_path: str | None = None, *,
                 attach: bool = False) -> None:
        self.layout = layout
        self.shm_path = shm_path
        #: only the process that made the buffer removes its memory-tier file
        self.owner_pid = os.getpid()
        self._mmap: mmap.mmap | None = None
        size = max(layout.total, 1)
        if shm_path is not None:
            # a memory-tier file in a directory every user shares (/dev/shm): made new,
            # owner-only, never through a symlink; attached only when this user owns it
            if attach:
                fd = os.open(shm_path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            else:
                fd = create_owned(shm_path, os.O_RDWR)
            try:
                if attach:
                    why = untrusted_file(os.fstat(fd))
                    if why is not None:
                        raise PermissionError(f"memory-tier buffer {shm_path} is not trusted: "
                                              f"{why}")
                else:
                    os.ftruncate(fd, size)
                    # reserve tmpfs pages now: a full /dev/shm fails here with ENOSPC, not
                    # with SIGBUS in the middle of a snapshot
                    os.posix_fallocate(fd, 0, size)
                self._mmap = _mapped(fd, size, mmap.MAP_SHARED)
            except BaseException:
                if not attach:
                    _unlink(shm_path)
                raise
            finally:
                os.close(fd)
            self.buf = np.frombuffer(self._mmap, np.uint8)
        else:
            # anonymous mmap: page-aligned (O_DIRECT writes need it), zero-filled, every
            # page mapped now, in bulk (about twice as fast as faulting them in one by one
            # during the first snapshot)
            self._mmap = _mapped(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.buf = np.frombuffer(self._mmap, np.uint8)
            if not _POPULATE:
                self.buf[::4096] = 0
        self.views: dict[str, np.ndarray] = {}
        for k, shape, dt, off, n in zip(layout.keys, layout.shapes, layout.dtypes,
                                        layout.offsets, layout.nbytes, strict=True):
            self.views[k] = self.buf[off:off + n].view(dt).reshape(shape)
        self.view_list = list(self.views.values())
        #: digests (the engine's hash algorithm) of arrays hashed as they were copied in,
        #: by key: the persist hashes only the others (see copying.copy_hashing)
        self.known_hashes: dict[str, str] = {}
        self.step: int | None = None
        self.busy = False
        #: busy only for a reader (:meth:`StagingPool.hold`): free again once that read ends
        self.held = False
        #: how many times the pool has handed this buffer out: a reader of its bytes checks
        #: that no save has taken it since (see :meth:`StagingPool.hold`)
        self.generation = 0

    @classmethod
    def attach(cls, layout: Layout, shm_path: str) -> StagingBuffer:
        """Map an existing memory-tier buffer as it is (recovery after a crash)."""
        return cls(layout, shm_path, attach=True)

    def bytes_of(self, key: str) -> np.ndarray:
        i = self.layout.keys.index(key)
        off = self.layout.offsets[i]
        return self.buf[off:off + self.layout.nbytes[i]]

    def pin(self, hooks: list[Any]) -> None:
        for hook in hooks:
            hook(self.buf)

    def close(self, unlink: bool = True) -> None:
        self.views.clear()
        self.view_list = []
        self.buf = np.empty(0, np.uint8)
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # a view still references it; the mapping goes with the last reference
            self._mmap = None
        if unlink and self.shm_path is not None and os.getpid() == self.owner_pid:
            _unlink(self.shm_path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass



class StagingPool:
    """At most ``capacity`` staging buffers, reused while the layout stays the same.

    ``acquire`` returns a free buffer (allocating on first use or after a layout change) or,
    when all are busy, waits for one (``block=True``) or returns None; a buffer busy only for
    a restore reading it (:meth:`hold`) is waited for either way: that read is short, and a
    read-side optimisation must never be why a save is skipped.
    """

    def __init__(self, capacity: int, shm_prefix: str | None = None,
                 pin_hooks: list[Any] | None = None,
                 on_tier_failure: Callable[[OSError, int], None] | None = None) -> None:
        self.capacity = max(1, capacity)
        self.shm_prefix = shm_prefix
        self.pin_hooks = pin_hooks if pin_hooks is not None else []
        #: called when a memory-tier buffer cannot be made (the save stages privately)
        self.on_tier_failure = on_tier_failure
        self.buffers: list[StagingBuffer] = []
        self.cond = threading.Condition()
        #: the thread allocating a buffer ahead of the first save (:meth:`prepare`)
        self._preparing: threading.Thread | None = None
        self._closed = False
        self._acquired = False
        #: how the first buffer came to be: "prepared" (ahead of the save, off its thread),
        #: or why the save had to allocate it itself
        self.first_allocation: str | None = None
        self.first_allocation_told = False

    def can_acquire(self) -> bool:
        """True when :meth:`acquire` would not wait now (and will not until this thread
        acquires: only it takes buffers, the engine only gives them back)."""
        with self.cond:
            return len(self.buffers) < self.capacity or \
                any(not b.busy or b.held for b in self.buffers)

    def prepare(self, layout: Layout) -> bool:
        """Allocate (and fault in) the first buffer for ``layout`` on a thread of its own, so
        the first save copies into memory that is ready instead of paying for it inside its
        stall (seconds for a GiB on a virtual machine that hands pages back to its host).
        False when there is nothing to prepare: a buffer exists or is being made."""
        with self.cond:
            if self.buffers or self._preparing_now() or self._closed:
                return False
            thread = threading.Thread(target=self._prepare, args=(layout,), daemon=True,
                                      name="pitstop-staging")
            self._preparing = thread
            thread.start()
            return True

    def _preparing_now(self) -> bool:
        # a thread of this process still allocating (in a forked child it is not alive)
        return self._preparing is not None and self._preparing.is_alive()

    def _prepare(self, layout: Layout) -> None:
        buf = None
        try:
            buf = self._allocate(layout)
        except Exception as e:  # noqa: BLE001 - the first save allocates then, and says why
            why = f"preparing it ahead failed ({e})"
        else:
            why = "prepared"
        with self.cond:
            if buf is not None and self._closed:
                buf.close()
            elif buf is not None:
                self.buffers.append(buf)
            if not self._acquired:
                self.first_allocation = why
            self._preparing = None
            self.cond.notify_all()

    def acquire(self, layout: Layout, block: bool) -> StagingBuffer | None:
        with self.cond:
            while True:
                if self._preparing_now():
                    # the first buffer is being made: waiting for it never costs more than
                    # allocating another (and a save is never skipped for it)
                    self.cond.wait(0.1)
                    continue
                free = [b for b in self.buffers if not b.busy]
                same = [b for b in free if b.layout == layout]
                if same:
                    buf = same[0]
                    break
                if len(self.buffers) < self.capacity or free:
                    if free:  # layout changed: drop an idle buffer of the old layout
                        old = free[0]
                        self.buffers.remove(old)
                        old.close()
                    if not self._acquired and self.first_allocation in (None, "prepared"):
                        self.first_allocation = (
                            "the state's arrays changed since it was prepared" if free else
                            "no step() or restore() saw the state before this save")
                    buf = self._allocate(layout)
                    self.buffers.append(buf)
                    break
                if not block and not any(b.held for b in self.buffers):
                    return None
                self.cond.wait(0.1)  # in slices: lets the main thread run signal handlers
            buf.busy = True
            buf.generation += 1
            self._acquired = True
            return buf

    def hold(self, buf: StagingBuffer, generation: int) -> bool:
        """Mark ``buf`` busy for a reader when it still holds what it held at ``generation``
        (no save has taken it since, and it was not dropped); give it back with
        :meth:`release`."""
        with self.cond:
            if buf.busy or buf.generation != generation or \
                    not any(b is buf for b in self.buffers):
                return False
            buf.busy = buf.held = True
            return True

    def _allocate(self, layout: Layout) -> StagingBuffer:
        used = {b.shm_path for b in self.buffers}
        path = None
        if self.shm_prefix is not None:
            for slot in range(self.capacity):
                candidate = f"{self.shm_prefix}-{slot}.buf"
                if candidate not in used:
                    path = candidate
                    break
        buf = None
        if path is not None:
            try:
                buf = StagingBuffer(layout, path)
            except OSError as e:
                # the memory tier is an optimisation, never the reason a save fails: this
                # save stages in private memory and is persisted as usual
                if self.on_tier_failure is not None:
                    self.on_tier_failure(e, layout.total)
        if buf is None:
            try:
                buf = StagingBuffer(layout)
            except (OSError, ValueError, OverflowError) as e:
                raise CheckpointError(
                    f"cannot allocate a {layout.total / 2**20:.1f} MiB staging buffer for the "
                    f"snapshot ({e}); free memory, or save a smaller state. Nothing was "
                    "saved; committed checkpoints are intact.") from e
        buf.pin(self.pin_hooks)
        return buf

    def adopt(self, buf: StagingBuffer) -> None:
        """Take over a buffer recovered from the memory tier (it is busy until released)."""
        with self.cond:
            buf.busy = True
            self.buffers.append(buf)

    def release(self, buf: StagingBuffer) -> None:
        with self.cond:
            buf.busy = buf.held = False
            self.cond.notify_all()

    def idle(self) -> bool:
        with self.cond:
            return not any(b.busy for b in self.buffers)

    def close(self, unlink: bool = True) -> None:
        with self.cond:
            self._closed = True
            preparing = self._preparing if self._preparing_now() else None
        if preparing is not None and preparing is not threading.current_thread():
            preparing.join()  # it closes what it made (a memory-tier file is removed)
        with self.cond:
            for b in self.buffers:
                b.close(unlink=unlink)
            self.buffers.clear()
