"""The snapshot: the copy of every array leaf into a staging buffer on the caller's thread
(the whole stall of an asynchronous save), on several threads for a large state, and the
start of a lazy copy (see :mod:`pitstop.core.save.lazy`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from concurrent.futures import wait as wait_all
from functools import partial
from typing import Any

import numpy as np

from pitstop.core.errors import CheckpointError, UnsupportedStateError
from pitstop.core.format.hashing import new_hasher
from pitstop.core.format.schema import piece_key
from pitstop.core.save.lazy import LAZY_MIN_BYTES, LazyCopy
from pitstop.core.save.snapshot import Layout, StagingBuffer, StagingPool
from pitstop.core.save.threads import Workers
from pitstop.core.tree import ArrayLeaf, FlatState, NumpyLeaf

log = logging.getLogger("pitstop")


#: states at least this big are copied on several threads during the snapshot
PARALLEL_COPY_MIN = 32 << 20
COPY_CHUNK = 16 << 20

#: leaves smaller than this are copied in one plain loop on the caller's thread
SMALL_COPY = 64 << 10

#: host arrays at least this big are hashed while they are copied (see copy_hashing)
HASH_IN_COPY_MIN = 1 << 20
#: the piece copied, then hashed while it is still in the CPU's cache
HASH_COPY_PIECE = 1 << 20
#: algorithms fast enough to run inside the stall (sha256 would triple it)
FAST_HASHES = frozenset({"xxh3-128", "xxh3-64"})


class Snapshots:
    """The engine's snapshot half (see :class:`pitstop.core.save.engine.Engine`)."""

    coordinator: Any
    writer_threads: int
    pool: StagingPool
    tier: Any
    hooks: dict[str, Callable[..., Any]]
    lazy: bool
    hash_algorithm: str
    #: hash large host arrays in the snapshot copy (set by the engine: a fast algorithm, and
    #: the raw bytes' hashes are wanted)
    hash_in_copy: bool
    copy_threads: int
    _copier: Workers
    _deferred: dict[int, LazyCopy]
    _last_sig: list[Any] | None
    _last_layout: Layout | None

    def _layout_of(self, flat: FlatState) -> tuple[dict[str, ArrayLeaf], Layout]:
        arrays = flat.arrays if not flat.sharded else pieces_of(flat, self.coordinator is None)
        sig = [(k, leaf.shape, leaf.dtype) for k, leaf in arrays.items()]
        if sig == self._last_sig and self._last_layout is not None:
            return arrays, self._last_layout  # same keys, shapes, dtypes: allocate nothing
        layout = Layout.of(arrays, self.writer_threads)
        self._last_sig, self._last_layout = sig, layout
        return arrays, layout

    def prepare_staging(self, flat: FlatState) -> bool:
        """Start making the staging buffer ``flat`` will be copied into, off the caller's
        thread (see :meth:`StagingPool.prepare`); False when one exists or is being made."""
        return self.pool.prepare(self._layout_of(flat)[1])

    def snapshot(self, flat: FlatState, step: int, block: bool) -> StagingBuffer | None:
        """Copy every array of ``flat`` into a staging buffer; None when none is free and
        ``block`` is False. This is the whole stall of an asynchronous save."""
        arrays, layout = self._layout_of(flat)
        buf = self.pool.acquire(layout, block)
        if buf is None:
            return None
        key = None
        try:
            hook = self.hooks.get("before_snapshot")
            if hook is not None:
                hook(step)
            if self.tier is not None and buf.shm_path is not None:
                self.tier.invalidate(buf)
            fences = []
            deferred: list[tuple[str, ArrayLeaf, np.ndarray]] = []
            if self.lazy:
                # copied now: what the next forward pass may write (buffers), numpy arrays,
                # small arrays; the rest after save() returns (see pitstop.core.save.lazy)
                eager: list[tuple[str, ArrayLeaf, np.ndarray]] = []
                for k, leaf, view in zip(arrays, arrays.values(), buf.view_list, strict=True):
                    later = leaf.lazy_safe and leaf.lazy_guard is not None and \
                        leaf.nbytes >= LAZY_MIN_BYTES
                    (deferred if later else eager).append((k, leaf, view))
                leaves: Iterable[ArrayLeaf] = [leaf for _k, leaf, _v in eager]
                views: Iterable[np.ndarray] = [v for _k, _leaf, v in eager]
                keys: Iterable[str] = [k for k, _leaf, _v in eager]
                now = sum(leaf.nbytes for _k, leaf, _v in eager)
            else:
                leaves, views, keys = arrays.values(), buf.view_list, arrays
                now = buf.layout.total
            buf.known_hashes = {}
            known = buf.known_hashes if self.hash_in_copy else None
            if now >= PARALLEL_COPY_MIN and self.copy_threads > 1:
                self._copy_parallel(keys, leaves, views, known)
            else:
                for key, leaf, view in zip(keys, leaves, views, strict=True):  # noqa: B007
                    if known is None or leaf.nbytes < HASH_IN_COPY_MIN or \
                            not self._copied_hashing(key, leaf, view, known):
                        leaf.snapshot_into(view)
                key = None
            for leaf in leaves:
                fence = leaf.snapshot_fence
                if fence is not None and fence not in fences:
                    fences.append(fence)
            for fence in fences:
                fence()
            if deferred:
                self._start_lazy(step, deferred, buf)
        except UnsupportedStateError as e:
            self.pool.release(buf)
            if key is None or str(e).startswith("state entry "):
                raise
            raise UnsupportedStateError(f"state entry {key!r}: {e}") from e
        except CheckpointError:
            self.pool.release(buf)
            raise
        except Exception as e:
            self.pool.release(buf)
            where = f" of {key!r}" if key is not None else ""
            raise CheckpointError(
                f"the snapshot{where} for step {step} failed: {type(e).__name__}: {e}. Nothing "
                "was saved; committed checkpoints are intact.") from e
        except BaseException:
            self.pool.release(buf)
            raise
        buf.step = step
        return buf

    def _copied_hashing(self, key: str, leaf: ArrayLeaf, view: np.ndarray,
                        known: dict[str, str]) -> bool:
        """Copy ``leaf`` (at least :data:`HASH_IN_COPY_MIN` bytes) into ``view`` hashing it
        (see :func:`copy_hashing`) when it is a host array; False, nothing done, when it is
        not one. A failure steps aside: the caller copies it, and the persist hashes it."""
        try:
            src = leaf.host_view()
            if src is None or src.dtype != view.dtype or src.nbytes != view.nbytes:
                return False
            known[key] = copy_hashing(src, view, self.hash_algorithm)
            return True
        except Exception:  # noqa: BLE001 - an optimisation never fails a save
            known.pop(key, None)
            return False

    def _copy_parallel(self, keys: Iterable[str], leaves: Iterable[ArrayLeaf],
                       views: Iterable[np.ndarray], known: dict[str, str] | None) -> None:
        """The snapshot copy on ``copy_threads`` threads (this one included): large contiguous
        numpy arrays are cut into chunks, everything else is copied whole. numpy and the
        frameworks release the GIL while copying, so the stall drops below one memcpy.
        With ``known``, a host array no larger than one thread's share is copied whole and
        hashed as it is copied (its digest put in ``known``); larger ones, chunked across
        threads, are hashed by the persist."""
        tasks: list[tuple[int, Callable[[], None]]] = []
        keys, leaves, views = list(keys), list(leaves), list(views)
        big = [i for i, leaf in enumerate(leaves) if leaf.nbytes >= SMALL_COPY]
        share = sum(leaves[i].nbytes for i in big) / self.copy_threads
        for i in big:  # the small ones: see copy_small
            leaf, view = leaves[i], views[i]
            if known is not None and HASH_IN_COPY_MIN <= leaf.nbytes <= share:
                tasks.append((leaf.nbytes, partial(self._hashing_task, keys[i], leaf, view,
                                                   known)))
                continue
            src = getattr(leaf, "array", None)
            if (type(leaf) is NumpyLeaf and leaf.nbytes > COPY_CHUNK and src is not None
                    and src.flags.c_contiguous and src.dtype == view.dtype):
                flat_src, flat_dst = src.reshape(-1), view.reshape(-1)
                n = max(1, COPY_CHUNK // src.dtype.itemsize)
                for a in range(0, flat_src.size, n):
                    tasks.append((n * src.dtype.itemsize, partial(
                        np.copyto, flat_dst[a:a + n], flat_src[a:a + n])))
            else:
                tasks.append((leaf.nbytes, partial(leaf.snapshot_into, view)))
        k = self.copy_threads
        buckets: list[list[Callable[[], None]]] = [[] for _ in range(k)]
        loads = [0] * k
        for size, task in sorted(tasks, key=lambda t: -t[0]):
            i = loads.index(min(loads))
            buckets[i].append(task)
            loads[i] += size

        def run(bucket: list[Callable[[], None]]) -> None:
            for task in bucket:
                task()

        futures = [self._copier.submit(run, b) for b in buckets[1:]]
        try:
            run(buckets[0])
            if len(big) < len(leaves):
                copy_small(leaves, views)
        finally:
            wait_all(futures)
        for f in futures:
            f.result()

    def _hashing_task(self, key: str, leaf: ArrayLeaf, view: np.ndarray,
                      known: dict[str, str]) -> None:
        if not self._copied_hashing(key, leaf, view, known):
            leaf.snapshot_into(view)

    def _start_lazy(self, step: int, deferred: list[tuple[str, ArrayLeaf, np.ndarray]],
                    buf: StagingBuffer) -> None:
        """Start the copy of ``deferred`` on the copy threads (see :mod:`pitstop.core.save.lazy`):
        contiguous host arrays in chunks, so several threads (and a fence that finds the copy
        unfinished) share one large tensor; each adapter's guard installs its fence."""
        tasks: list[Callable[[], None]] = []
        for key, leaf, view in deferred:
            src = leaf.host_view()
            if src is not None and leaf.nbytes > COPY_CHUNK and src.dtype == view.dtype:
                flat_src, flat_dst = src.reshape(-1), view.reshape(-1)
                n = max(1, COPY_CHUNK // src.dtype.itemsize)
                for a in range(0, flat_src.size, n):
                    tasks.append(partial(_lazy_task, key, step, np.copyto,
                                         flat_dst[a:a + n], flat_src[a:a + n]))
            else:
                tasks.append(partial(_lazy_task, key, step, leaf.snapshot_into, view))
        guards: list[Callable[[], None]] = []
        for _k, leaf, _v in deferred:
            guard = leaf.lazy_guard
            if guard is not None and guard not in guards:
                guards.append(guard)
        try:
            for guard in guards:
                guard()  # before the copy starts: the next mutation waits for it
        except Exception as e:  # noqa: BLE001 - an optimisation never fails a save
            if self.lazy:
                self.lazy = False
                log.warning("pitstop: snapshot='lazy' steps aside: its fence could not be "
                            "installed (%s: %s); this manager copies the whole state inside "
                            "save() (snapshot='eager' silences this)", type(e).__name__, e)
            for _k, leaf, view in deferred:
                leaf.snapshot_into(view)
            for leaf in {id(leaf): leaf for _k, leaf, _v in deferred}.values():
                if leaf.snapshot_fence is not None:
                    leaf.snapshot_fence()
            return
        copy = LazyCopy(step, tasks, [leaf for _k, leaf, _v in deferred],
                        [k for k, _leaf, _v in deferred], hooks=self.hooks)
        copy.register()
        self._deferred[id(buf)] = copy  # launched by submit()

    def release_snapshot(self, buf: StagingBuffer) -> None:
        """Give back a snapshot that will not be submitted (its lazy copy finished first)."""
        copy = self._deferred.pop(id(buf), None)
        if copy is not None:
            copy.started.set()  # never launched: this thread copies (a test hook or not)
            copy.fence()
            copy.retire()
        self.pool.release(buf)



def _lazy_task(key: str, step: int, fn: Callable[..., None], *args: Any) -> None:
    """One piece of a lazy copy; a failure names the array."""
    try:
        fn(*args)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(
            f"the background (snapshot='lazy') copy of {key!r} for step {step} failed: "
            f"{type(e).__name__}: {e}") from e



def copy_hashing(src: np.ndarray, dst: np.ndarray, algorithm: str) -> str:
    """Copy the C-contiguous ``src`` into ``dst`` (same dtype and size) piece by piece,
    hashing each piece of ``dst`` just after it is written, while it is in the CPU's cache:
    the digest of the staged bytes for about a tenth more stall than the copy alone, where
    the persist would read them from memory again beside the next training steps."""
    s = src.reshape(-1).view(np.uint8)
    d = dst.reshape(-1).view(np.uint8)
    h = new_hasher(algorithm)
    for at in range(0, d.size, HASH_COPY_PIECE):
        piece = d[at:at + HASH_COPY_PIECE]
        np.copyto(piece, s[at:at + HASH_COPY_PIECE])
        h.update(piece)
    return str(h.hexdigest())


def copy_small(leaves: list[ArrayLeaf], views: list[np.ndarray]) -> None:
    """Copy the leaves under :data:`SMALL_COPY` bytes into their staging views: one loop
    on this thread (a copy of a few KiB costs less than handing it to another thread, which
    would wait for the GIL anyway), a numpy leaf by plain assignment (the cheapest numpy
    copy call; it swaps a big-endian source to the view's little-endian order, as
    ``snapshot_into`` does)."""
    numpy_leaf = NumpyLeaf
    for leaf, view in zip(leaves, views, strict=True):
        if leaf.nbytes >= SMALL_COPY:
            continue
        if type(leaf) is numpy_leaf:
            view[...] = leaf.array  # type: ignore[attr-defined]
        else:
            leaf.snapshot_into(view)



def pieces_of(flat: FlatState, whole: bool = True) -> dict[str, ArrayLeaf]:
    """``flat.arrays`` with every sharded leaf replaced by its distinct shards (piece keys).
    ``whole``: one process saves alone, so its shards must be all of each array."""
    out: dict[str, ArrayLeaf] = {}
    for key, leaf in flat.arrays.items():
        if not leaf.sharded:
            out[key] = leaf
            continue
        pieces = leaf.pieces()
        if whole:
            held = sum(math.prod(b - a for a, b in index) for index, _p in pieces)
            if held != math.prod(leaf.shape):
                raise UnsupportedStateError(
                    f"state entry {key!r}: this process holds {held} of its "
                    f"{math.prod(leaf.shape)} elements (global shape {list(leaf.shape)}); the "
                    "rest is on other ranks. Save it with every rank together (a "
                    "CheckpointManager made on every rank, distributed='auto'), or gather it "
                    "first (DTensor.full_tensor(), process_allgather)")
        for index, piece in pieces:
            out[piece_key(key, index)] = piece
    return out

