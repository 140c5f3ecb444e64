"""The data files of a save: each byte-balanced group of arrays written as one file (plain,
compressed or encrypted), hashed before or while it is written.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pitstop.core.format import codecs
from pitstop.core.format.dtypes import encode_dtype, is_inexact
from pitstop.core.format.hashing import new_hasher
from pitstop.core.format.schema import ArrayEntry
from pitstop.core.save.snapshot import Layout, StagingBuffer

HASH_CHUNK = 8 << 20
WRITE_CHUNK = 32 << 20
ALIGN = 4096


class DataFiles:
    """The engine's hashing and writing of data files (see :class:`pitstop.core.save.persist.Persist`)."""

    hash_algorithm: str
    compression: str | None
    encryption: Any
    tier: Any
    incremental: bool

    def _hash_group(self, buf: StagingBuffer, group: list[int], check_finite: bool,
                    raw_hashes: bool = False) -> tuple[dict[str, str], bool]:
        layout = buf.layout
        out: dict[str, str] = {}
        finite = True
        for i in group:
            off, n = layout.offsets[i], layout.nbytes[i]
            raw = buf.buf[off:off + n]
            # the raw bytes' hash: the manifest's when uncompressed (compressed payloads are
            # hashed while writing), and always the memory tier's seal and what incremental
            # saves compare
            if raw_hashes or self.tier is not None or self.incremental or (
                    self.compression in (None, "none") and self.encryption is None):
                k = layout.keys[i]
                known = buf.known_hashes.get(k)
                out[k] = known if known is not None else hash_chunks(self.hash_algorithm, raw)
            # the non-finite guard holds with or without compression
            if check_finite and finite:
                v = buf.views[layout.keys[i]]
                if is_inexact(v.dtype) and v.size and not np.isfinite(v).all():
                    finite = False
        return out, finite

    def _write_group(self, txn: Any, buf: StagingBuffer, index: int, group: list[int],
                     hashes: dict[str, str], prefix: str = "", cipher: Any = None,
                     hash_while_writing: bool = False
                     ) -> tuple[str | None, int, dict[str, ArrayEntry]]:
        """Write the arrays ``group`` (indices into the layout, ascending) as one data file;
        a multi-rank save passes the part of a group this rank writes (``prefix``: its
        rank, so the ranks' file names never collide). ``cipher``: encrypt each array's
        (compressed) bytes segment by segment (see :mod:`pitstop.core.format.crypto`).
        ``hash_while_writing``: plain bytes whose hashes are not in ``hashes`` yet: each
        chunk is hashed just before it is written."""
        if not group:
            return None, 0, {}
        layout = buf.layout
        fname = f"data-{prefix}{index:03d}.bin"
        entries: dict[str, ArrayEntry] = {}
        raw = self.compression in (None, "none") and cipher is None
        runs = runs_of(group)
        w = txn.open_write(fname, direct=(raw and len(runs) == 1) or cipher is not None)
        try:
            if raw:
                # each run of consecutive arrays is one contiguous, page-aligned region of
                # the staging buffer: written as is (a whole group with O_DIRECT where the
                # file system allows: no page-cache copy on the CPU; the region then ends
                # on a page boundary, so the file carries a few bytes of padding)
                pos = 0
                for run in runs:
                    start = layout.offsets[run[0]]
                    end = layout.offsets[run[-1]] + layout.nbytes[run[-1]]
                    if getattr(w, "direct", False):
                        end = min(-(-end // ALIGN) * ALIGN, buf.buf.size)
                    region = buf.buf[start:end]
                    digests = _RunHasher(self.hash_algorithm, layout, run,
                                         buf.known_hashes) if hash_while_writing else None
                    for at in range(0, end - start, WRITE_CHUNK):
                        if digests is not None:
                            digests.update(start + at, start + at + WRITE_CHUNK, buf.buf)
                        w.write(region[at:at + WRITE_CHUNK])
                    if digests is not None:
                        digests.update(end, 1 << 62, buf.buf)  # arrays of no bytes at the end
                        hashes = digests.done
                    for i in run:
                        k = layout.keys[i]
                        entries[k] = ArrayEntry(
                            dtype=encode_dtype(layout.dtypes[i]), shape=list(layout.shapes[i]),
                            file=fname, offset=pos + layout.offsets[i] - start,
                            length=layout.nbytes[i], hash=hashes[k])
                    pos += end - start
                length = pos
            elif cipher is not None:
                # compressed first (when on), then encrypted segment by segment into one
                # page-aligned buffer, written in whole pages (O_DIRECT where allowed)
                from pitstop.core.format.crypto import OVERHEAD, Sink, codec_of
                # the largest segment of these arrays (compressed ones may grow a little)
                most = cipher.segment if self.compression not in (None, "none") else \
                    min(cipher.segment, max(layout.nbytes[i] for i in group))
                sink = Sink(w, most + OVERHEAD)
                pos = 0
                for i in group:
                    k = layout.keys[i]
                    off, n = layout.offsets[i], layout.nbytes[i]
                    base = codecs.codec_name(self.compression, layout.dtypes[i].itemsize)
                    payload = codecs.encode(base, buf.buf[off:off + n])
                    h = new_hasher(self.hash_algorithm)
                    size = cipher.encrypt(payload, fname, pos, sink.reserve, h)
                    entries[k] = ArrayEntry(
                        dtype=encode_dtype(layout.dtypes[i]), shape=list(layout.shapes[i]),
                        file=fname, offset=pos, length=size, hash=str(h.hexdigest()),
                        codec=codec_of(base))
                    pos += size
                length = pos + sink.close()
            else:
                pos = 0
                for i in group:
                    k = layout.keys[i]
                    off, n = layout.offsets[i], layout.nbytes[i]
                    codec = codecs.codec_name(self.compression, layout.dtypes[i].itemsize)
                    payload = codecs.encode(codec, buf.buf[off:off + n])
                    digest = hash_chunks(self.hash_algorithm, payload)
                    w.write(payload)
                    size = payload.nbytes
                    entries[k] = ArrayEntry(
                        dtype=encode_dtype(layout.dtypes[i]), shape=list(layout.shapes[i]),
                        file=fname, offset=pos, length=size, hash=digest, codec=codec)
                    pos += size
                length = pos
        finally:
            w.close()
        return fname, length, entries



class _RunHasher:
    """Hashes the arrays of a run (consecutive layout indices) as the byte ranges of the
    staging buffer that hold them are fed in order; ``done`` maps each key to its digest."""

    def __init__(self, algorithm: str, layout: Layout, run: list[int],
                 known: dict[str, str] | None = None) -> None:
        self.algorithm = algorithm
        self.layout = layout
        self.run = run
        #: digests already made (in the snapshot copy): taken, those bytes not hashed again
        self.known = known or {}
        self.next = 0  # position in run of the first array not finished
        self.hasher: Any = None
        self.done: dict[str, str] = {}

    def update(self, lo: int, hi: int, data: np.ndarray) -> None:
        """Feed the buffer's bytes ``[lo, hi)`` (each byte exactly once, in order)."""
        layout, run = self.layout, self.run
        while self.next < len(run):
            i = run[self.next]
            a, n = layout.offsets[i], layout.nbytes[i]
            known = self.known.get(layout.keys[i]) if self.hasher is None else None
            if known is not None:
                self.done[layout.keys[i]] = known
                self.next += 1
                continue
            if a >= hi:
                return
            if self.hasher is None:
                self.hasher = new_hasher(self.algorithm)
            for at in range(max(a, lo), min(a + n, hi), HASH_CHUNK):
                self.hasher.update(data[at:min(at + HASH_CHUNK, a + n, hi)])
            if a + n > hi:
                return  # the array goes on in the next chunk
            self.done[layout.keys[i]] = str(self.hasher.hexdigest())
            self.hasher = None
            self.next += 1



def runs_of(group: list[int]) -> list[list[int]]:
    """Ascending indices cut into runs of consecutive ones."""
    if group[-1] - group[0] == len(group) - 1:
        return [group]  # a whole layout group (every one-process save): one run
    runs: list[list[int]] = []
    for i in group:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs



def hash_chunks(algorithm: str, data: Any) -> str:
    """Hash a buffer in chunks so no single call holds the GIL for long."""
    h = new_hasher(algorithm)
    view = memoryview(data).cast("B")
    for pos in range(0, len(view), HASH_CHUNK):
        h.update(view[pos:pos + HASH_CHUNK])
    return str(h.hexdigest())

