"""Arrays read from a checkpoint's data files, every byte hash-verified: whole, sharded,
compressed, encrypted, many small ones in runs of one file, or only the region a sharded
target needs."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zstandard

from pitstop.core.errors import CheckpointError, CorruptCheckpointError
from pitstop.core.format import codecs
from pitstop.core.format.dtypes import decode_dtype
from pitstop.core.format.hashing import digest_of, new_hasher
from pitstop.core.format.schema import ArrayEntry
from pitstop.core.restore.files import SMALL, WINDOW, CheckpointFiles, _shown

READ_CHUNK = 16 << 20
#: a data file holding at least this many small plain arrays has them read in runs of at
#: most RUN_MAX (see CheckpointReader.plain_runs)
RUN_MIN = 64
RUN_MAX = 4096


class ArrayReader(CheckpointFiles):
    """Reads the arrays of one checkpoint (the base of
    :class:`~pitstop.core.restore.read.CheckpointReader`)."""

    #: decrypts the arrays of an encrypted checkpoint
    _cipher: Any
    #: verify(progress=...): called with the bytes of each plain chunk read
    _on_bytes: Callable[[int], None] | None

    # ------------------------------------------------------------------ arrays
    def read_array(self, key: str, entry: ArrayEntry, out: np.ndarray | None = None) -> np.ndarray:
        """Read one array (into ``out`` when given: C-contiguous, right shape and dtype); a
        sharded one is assembled shard by shard."""
        dtype = decode_dtype(entry.dtype)
        payload = None
        if entry.codec != "none" and entry.shards is None and self._cipher is None:
            # (encrypted entries stream through _read_encrypted, authenticated segment by
            # segment) the stored bytes first (bounded by the real file), then their decoded size
            # from the frame header: nothing of the declared size is made before that holds
            payload = self._payload(key, entry)
        if out is None:
            out = np.empty(entry.shape, dtype)
        if entry.shards is not None:
            for shard in entry.shards:
                region = out[_slices(shard.index)]
                if region.flags.c_contiguous:
                    self.read_array(key, shard, region)  # straight in: sharded on the first axis
                else:
                    region[...] = self.read_array(key, shard)
            return out
        raw = out.reshape(-1).view(np.uint8) if out.size else np.empty(0, np.uint8)
        h = new_hasher(self.manifest.hash_algorithm)
        if self._cipher is not None:
            self._read_encrypted(key, entry, raw, h)
            return out
        if entry.codec == "none":
            for pos in range(0, entry.length, READ_CHUNK):
                chunk = raw[pos:pos + READ_CHUNK]
                got = self._read(entry, entry.offset + pos, chunk)
                if got != len(chunk):
                    raise self._corrupt(key, entry, "the data file ends early (truncated)")
                h.update(chunk)
                if self._on_bytes is not None:
                    self._on_bytes(len(chunk))
        else:
            assert payload is not None
            try:
                codecs.decode_into(entry.codec, payload.data, raw)
            except Exception as e:  # noqa: BLE001
                raise self._corrupt(key, entry, f"cannot decode: {e}") from None
            return out
        if h.hexdigest() != entry.hash:
            raise self._corrupt(key, entry, f"hash mismatch: expected {entry.hash}, found "
                                f"{h.hexdigest()} (the bytes on disk changed)")
        return out

    def plain_runs(self, items: list[tuple[str, ArrayEntry]]
                   ) -> tuple[list[list[tuple[str, ArrayEntry]]], list[tuple[str, ArrayEntry]]]:
        """``(runs, rest)``: the small arrays stored plain (whole, uncompressed, unencrypted)
        in runs of one data file, in ascending offsets, where a file holds at least
        :data:`RUN_MIN` of them (for :meth:`read_plain_run`; the data file of the checkpoint
        itself or of the one an entry references); every other item in ``rest``,
        in the order given."""
        if self._cipher is not None or len(items) < RUN_MIN:
            return [], items
        # (by file *and* ref: an incremental checkpoint's own data-000.bin and the one of
        # the older checkpoint it references share a name, not their bytes)
        by_file: dict[tuple[str, str], list[tuple[str, ArrayEntry]]] = {}
        rest = []
        for key, e in items:
            if e.codec == "none" and e.shards is None and e.length <= SMALL:
                by_file.setdefault(e.origin, []).append((key, e))
            else:
                rest.append((key, e))
        runs: list[list[tuple[str, ArrayEntry]]] = []
        for run in by_file.values():
            if len(run) < RUN_MIN:
                rest.extend(run)
                continue
            run.sort(key=lambda t: t[1].offset)
            runs.extend(run[a:a + RUN_MAX] for a in range(0, len(run), RUN_MAX))
        return runs, rest

    def read_plain_run(self, items: Sequence[tuple[str, ArrayEntry, np.ndarray | None]],
                       written: Callable[[list[str]], None]) -> None:
        """Many small arrays of one data file into their targets, as :meth:`read_array`
        reads each, at a fraction of its cost per array: one read per window of them, then
        each copied in from the window and its hash checked. ``items``: ``(key, entry,
        out)`` in ascending offsets, each stored whole and plain (uncompressed,
        unencrypted, at most :data:`SMALL` bytes) into ``out``, C-contiguous of exactly its
        bytes, or None to check the hash only; ``written(keys)`` is told, once per window,
        which targets were written to (a failed check's own included, as a caller of
        ``read_array`` counts a target that a failed read partly wrote)."""
        digest = digest_of(self.manifest.hash_algorithm)
        window = np.empty(0, np.uint8)
        i, n = 0, len(items)
        while i < n:
            first = items[i][1]
            start = end = first.offset
            j = i
            while j < n:
                e = items[j][1]
                stop = e.offset + e.length
                if e.offset < start or stop - start > WINDOW:
                    break
                end = max(end, stop)
                j += 1
            if window.size < end - start:
                window = np.empty(WINDOW, np.uint8)
            buf = window[:end - start]
            try:
                got = self._read(first, start, buf)
            except CheckpointError:
                if items[i][2] is not None:
                    written([items[i][0]])  # as read_array's caller: the entry being read
                raise
            # (a memoryview's slice and copy hold the GIL for 1 KiB, where numpy's give it
            # up and take it back, which two reading threads then queue for)
            view = memoryview(buf)
            touched: list[str] = []
            try:
                for key, entry, out in items[i:j]:
                    a = entry.offset - start
                    if a + entry.length > got:
                        raise self._corrupt(key, entry, "the data file ends early (truncated)")
                    chunk = view[a:a + entry.length]
                    if out is not None:
                        touched.append(key)
                        _copy_in(out, chunk)
                    if digest(chunk) != entry.hash:
                        raise self._corrupt(key, entry, f"hash mismatch: expected {entry.hash}, "
                                            f"found {digest(chunk)} (the bytes on disk changed)")
            finally:
                if touched:
                    written(touched)
            i = j

    def _read_encrypted(self, key: str, entry: ArrayEntry, raw: np.ndarray, h: Any) -> None:
        """Decrypt one stored array segment by segment (straight into ``raw`` when it is not
        compressed), then check the stored bytes' hash (see :mod:`.crypto`)."""
        from pitstop.core.format.crypto import split
        base, _enc = split(entry.codec)
        cipher = self._cipher
        plain = cipher.plain_length(entry.length)
        if plain is None or (base == "none" and plain != raw.size):
            raise self._corrupt(key, entry, f"{entry.length} stored bytes are not the "
                                "encrypted segments of its shape and dtype")
        target = raw if base == "none" else np.empty(plain, np.uint8)

        def read(pos: int, buf: np.ndarray) -> None:
            if self._read(entry, pos, buf) != buf.size:
                raise self._corrupt(key, entry, "the data file ends early (truncated)")

        try:
            cipher.decrypt(entry.file, entry.offset, entry.length, read, target, h)
        except ValueError as e:
            raise self._corrupt(key, entry, str(e)) from None
        if h.hexdigest() != entry.hash:
            raise self._corrupt(key, entry, f"hash mismatch: expected {entry.hash}, found "
                                f"{h.hexdigest()} (the bytes on disk changed)")
        if base != "none":
            try:
                codecs.decode_into(base, target.data, raw)
            except Exception as e:  # noqa: BLE001
                raise self._corrupt(key, entry, f"cannot decode: {e}") from None

    def _payload(self, key: str, entry: ArrayEntry) -> np.ndarray:
        """The stored (encoded) bytes of a compressed entry, hash-verified, whose frame says
        they decode to exactly the bytes the entry's shape and dtype need."""
        payload = np.empty(entry.length, np.uint8)
        if self._read(entry, entry.offset, payload) != entry.length:
            raise self._corrupt(key, entry, "the data file ends early (truncated)")
        h = new_hasher(self.manifest.hash_algorithm)
        h.update(payload)
        if h.hexdigest() != entry.hash:
            raise self._corrupt(key, entry, "hash mismatch (the bytes on disk changed)")
        self._check_decoded_size(key, entry, payload[:_FRAME_HEADER])
        return payload

    def _check_decoded_size(self, key: str, entry: ArrayEntry, head: np.ndarray) -> None:
        """A zstd frame records how many bytes it decodes to: refuse an entry whose shape
        and dtype declare another size (an edited manifest) before anything that size is
        allocated."""
        if not entry.codec.startswith("zstd") or getattr(self.manifest, "encryption", None):
            return  # (encrypted bytes: their own read path authenticates them first)
        need = nbytes_of(entry)
        try:
            size = zstandard.frame_content_size(head.tobytes())
        except zstandard.ZstdError as e:
            raise self._corrupt(key, entry, f"not a zstd frame ({e})") from None
        if size >= 0 and size != need:
            raise self._corrupt(key, entry, f"decodes to {size} bytes, but its shape "
                                f"{entry.shape} and dtype need {need}")

    def _corrupt(self, key: str, entry: ArrayEntry, what: str) -> CorruptCheckpointError:
        held = "" if entry.ref is None else \
            f" (referenced: {entry.ref} holds the bytes of this incremental checkpoint)"
        return CorruptCheckpointError(
            f"{self.where}: array {key!r} in {_shown(entry.ref or '', entry.file)} at offset "
            f"{entry.offset}: {what}{held}", checkpoint=self.where, key=key, file=entry.file)

    def region_reader(self, key: str, entry: ArrayEntry
                      ) -> Callable[[tuple[tuple[int, int], ...]], np.ndarray]:
        """``read(index)``: the values of array ``key`` inside ``index`` (``(start, stop)`` per
        dimension), reading only the shards that overlap it, each once and hash-verified."""
        cache: dict[int, np.ndarray] = {}
        parts = entry.parts

        def read(index: tuple[tuple[int, int], ...]) -> np.ndarray:
            if entry.shards is None:
                if 0 not in cache:
                    cache[0] = self.read_array(key, entry)
                return cache[0][_slices(index)]
            out = np.empty([b - a for a, b in index], decode_dtype(entry.dtype))
            for i, shard in enumerate(parts):
                assert shard.index is not None
                common = [(max(a, c), min(b, d)) for (a, b), (c, d)
                          in zip(index, shard.index, strict=True)]
                if any(lo >= hi for lo, hi in common) and out.size:
                    continue
                if i not in cache:
                    cache[i] = self.read_array(key, shard)
                src = tuple(slice(lo - c, hi - c) for (lo, hi), (c, _d)
                            in zip(common, shard.index, strict=True))
                dst = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _b)
                            in zip(common, index, strict=True))
                out[dst] = cache[i][src]
            return out

        return read

    def check_frames(self, keys: list[str] | None = None) -> None:
        """Every compressed array of ``keys`` (all by default) decodes to the bytes its
        shape and dtype declare, as its stored frame header says: an edited manifest
        claiming more is corruption, found with one small read per array."""
        whole = self.manifest.arrays
        if keys is None:  # (every entry: the plain ones, most of them, skipped cheaply)
            items = [(k, p) for k, e in whole.items() if e.codec != "none" or e.shards
                     for p in e.parts if p.codec != "none"]
        else:
            items = [(k, p) for k in keys if k in whole
                     for p in whole[k].parts if p.codec != "none"]
        if not items:
            return

        def check(item: tuple[str, ArrayEntry]) -> None:
            key, entry = item
            head = np.empty(min(_FRAME_HEADER, entry.length), np.uint8)
            got = self._read(entry, entry.offset, head)
            self._check_decoded_size(key, entry, head[:got])

        self.per_file(sorted(items, key=lambda kv: kv[1].start), check)


def _slices(index: Any) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in index)


def nbytes_of(entry: ArrayEntry) -> int:
    return math.prod(entry.shape) * decode_dtype(entry.dtype).itemsize


#: the longest zstd frame header (magic, descriptor, window, dictionary id, content size)
_FRAME_HEADER = 18


def _copy_in(out: np.ndarray, chunk: memoryview) -> None:
    """A small array's bytes into ``out`` (C-contiguous, of exactly those bytes)."""
    try:
        memoryview(out).cast("B")[:] = chunk
    except (TypeError, ValueError, NotImplementedError, BufferError):
        # a dtype the buffer protocol cannot carry (bfloat16, datetime64), or a read-only
        # target: numpy copies, or says what is wrong as before
        (out.reshape(-1).view(np.uint8) if out.size else np.empty(0, np.uint8))[:] = chunk
