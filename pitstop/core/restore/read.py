"""Reading a committed checkpoint: streamed into live arrays, every byte hash-verified."""

from __future__ import annotations

import errno
import math
import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import zstandard

from pitstop.core.directory.names import DEFAULT, Naming
from pitstop.core.errors import (
    CheckpointError,
    CorruptCheckpointError,
    EncryptionKeyError,
    IncompatibleTargetError,
)
from pitstop.core.format import codecs
from pitstop.core.format.decoding import PARSE_FRAMES, deeper_than, load_json, on_fresh_stack
from pitstop.core.format.dtypes import decode_dtype
from pitstop.core.format.hashing import new_hasher
from pitstop.core.format.schema import ArrayEntry, Manifest
from pitstop.core.format.validate import parse
from pitstop.core.restore.plan import RestoredStep, RestorePlan, RestoreReport
from pitstop.core.storage.local import MANIFEST, pread_full
from pitstop.core.tree import FlatState, decode_value, join, unflatten

READ_CHUNK = 16 << 20
SMALL = 1 << 20
WINDOW = 8 << 20
#: a data file holding at least this many small plain arrays has them read in runs of at
#: most RUN_MAX (see CheckpointReader.plain_runs)
RUN_MIN = 64
RUN_MAX = 4096


def _nothing(key: str) -> None:
    """``written`` of a read into new arrays (nothing live is written)."""


class ReadableStorage(Protocol):
    """What a reader needs of its storage: any :class:`Storage`, or the memory-tier buffer
    the manager verifies on recovery. ``open_reader(name, relpath) -> fd`` is optional."""

    def path_of(self, name: str, relpath: str = "") -> str: ...

    def read_bytes(self, name: str, relpath: str) -> bytes: ...

    def size(self, name: str, relpath: str) -> int: ...

    def read_into(self, name: str, relpath: str, offset: int, out: Any) -> int: ...


def _directory_key_id(storage: Any) -> str | None:
    """The key id the directory's identity records (None: none, or unreadable)."""
    try:
        doc = load_json(storage.read_meta("directory.json") or b"null")
        return str(doc["encryption"]["key_id"])
    except Exception:  # noqa: BLE001 - no identity, no such method, malformed: no key id
        return None


def _key_id_of(data: bytes) -> str:
    """The key id an encrypted manifest names, for a message (at most 32 characters)."""
    try:
        return str(load_json(data)["encryption"]["key_id"])[:32]
    except Exception:  # noqa: BLE001
        return "?"


class CheckpointReader:
    """One committed checkpoint ``name`` in ``storage``, a directory whose checkpoints are
    named by ``naming`` (its manifest must be of the step the name holds).

    ``encryption``: the key of an encrypted checkpoint (:class:`~pitstop.Encryption`); given,
    a plaintext checkpoint is refused as corrupt (it is not authenticated: an encrypted
    directory never holds one), unless ``plaintext_ok`` (the CLI reads both kinds).
    ``directory_id``: the directory's id; an encrypted checkpoint whose sealed manifest
    names another one (copied in from another run with the same key) is refused as
    corrupt."""

    def __init__(self, storage: ReadableStorage, name: str, *,
                 threads: int | None = None, naming: Naming = DEFAULT,
                 encryption: Any = None, plaintext_ok: bool = False,
                 directory_id: str | None = None) -> None:
        self.storage = storage
        self.name = name
        self.threads = threads if threads is not None else min(4, os.cpu_count() or 1)
        self._sources: dict[tuple[str, str], _FileSource] = {}
        self.where = storage.path_of(name)
        try:
            data = storage.read_bytes(name, MANIFEST)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.where}: manifest.json is missing",
                                         checkpoint=self.where) from None
        except OSError as e:
            raise _os_error(self.where, MANIFEST, e) from None
        try:
            self.manifest: Manifest = parse(data, self.where, encryption, naming)
        except EncryptionKeyError:
            if encryption is None or _directory_key_id(storage) != encryption.key_id:
                raise
            # the directory's own key (its identity says so; writers use no other): a
            # manifest naming another key was not written here, or was changed (a rotted
            # key id): unauthenticated, like any corrupt checkpoint, so restore() falls back
            raise CorruptCheckpointError(
                f"{self.where}: its manifest names another key id ({_key_id_of(data)}) than "
                f"this directory's, {encryption.key_id} (the key given): it was copied in from "
                "elsewhere or its manifest was changed, so it is not authenticated",
                checkpoint=self.where, file=MANIFEST) from None
        #: decrypts the arrays of an encrypted checkpoint
        self._cipher: Any = None
        #: verify(progress=...): called with the bytes of each plain chunk read (see verify)
        self._on_bytes: Callable[[int], None] | None = None
        if self.manifest.encryption is not None:
            if directory_id and self.manifest.directory_id != directory_id:
                # (the id is under the manifest's MAC and in every segment's associated
                # data: only a checkpoint written for another directory names another one)
                raise CorruptCheckpointError(
                    f"{self.where}: an encrypted checkpoint of another directory (its sealed "
                    f"manifest names directory id {str(self.manifest.directory_id)[:64]}, "
                    f"this directory's is {directory_id}): copied in from another run with "
                    "the same key, so not this run's state. Read it from the run it came "
                    "from, or re-save it here (load() it and save() it)",
                    checkpoint=self.where, file=MANIFEST)
            self._cipher = encryption.cipher(self.manifest.encryption,
                                             self.manifest.directory_id, self.manifest.step)
        elif encryption is not None and not plaintext_ok:
            raise CorruptCheckpointError(
                f"{self.where}: not encrypted, but this manager encrypts (key id "
                f"{encryption.key_id}): an unencrypted checkpoint is not authenticated, so it "
                "is not trusted here (copied in or replaced). Read it without encryption= if "
                "you know where it came from", checkpoint=self.where, file=MANIFEST)
        named = naming.parse(name)
        if named is not None and named != self.manifest.step:
            # a checkpoint renamed or copied in under another step: never restore it as that
            raise CorruptCheckpointError(
                f"{self.where}: its manifest is of step {self.manifest.step}, but the "
                f"directory is named for step {named} (renamed, swapped or copied in); move "
                "it to the name of its own step", checkpoint=self.where, file=MANIFEST)

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

    def verify(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Read every array and check its hash (``pitstop verify``): every rank's part of a
        checkpoint that several ranks wrote. ``progress(done, total)`` (array bytes) is
        called as the reading goes on (a progress bar's): per chunk of a large array, per
        window of small ones."""
        self.check_files()
        runs, rest = self.plain_runs(list(self.manifest.arrays.items()))
        done = {(p.file, p.offset) for e in self.manifest.arrays.values() for p in e.parts
                if p.ref is None}
        extra = [(key, entry) for view in self.manifest.ranks
                 for key, entry in view.arrays.items()
                 if any((p.file, p.offset) not in done for p in entry.parts)]
        seen = [0]
        total = sum(e.length for run in runs for _, e in run) + sum(
            nbytes_of(e) for _, e in rest + extra)
        if progress is not None:
            def count(n: int) -> None:
                seen[0] += n
                progress(seen[0], total)
            progress(0, total)
        for run in runs:  # hashed straight from each window: nothing is made per array
            self.read_plain_run([(k, e, None) for k, e in run], _nothing)
            if progress is not None:
                count(sum(e.length for _, e in run))
        for key, entry in rest + extra:
            if progress is None:
                self.read_array(key, entry)
                continue
            before = seen[0]
            self._on_bytes = count
            try:
                self.read_array(key, entry)
            finally:
                self._on_bytes = None
            count(max(0, nbytes_of(entry) - (seen[0] - before)))  # compressed, encrypted

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
                       written: Callable[[str], None]) -> None:
        """Many small arrays of one data file into their targets, as :meth:`read_array`
        reads each, at a fraction of its cost per array: one read per window of them, then
        each copied in from the window and its hash checked. ``items``: ``(key, entry,
        out)`` in ascending offsets, each stored whole and plain (uncompressed,
        unencrypted, at most :data:`SMALL` bytes) into ``out``, C-contiguous of exactly its
        bytes, or None to check the hash only; ``written(key)`` is called as each target is
        written to (before its check, as a caller of ``read_array`` counts a target that a
        failed read partly wrote)."""
        make = new_hasher(self.manifest.hash_algorithm).__class__
        empty = np.empty(0, np.uint8)
        window = empty
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
                written(items[i][0])  # as read_array's caller: the entry being read
                raise
            for key, entry, out in items[i:j]:
                a = entry.offset - start
                if out is not None:
                    written(key)
                if a + entry.length > got:
                    raise self._corrupt(key, entry, "the data file ends early (truncated)")
                chunk = buf[a:a + entry.length]
                if out is not None:
                    (out.reshape(-1).view(np.uint8) if out.size else empty)[:] = chunk
                h = make()
                h.update(chunk)
                if h.hexdigest() != entry.hash:
                    raise self._corrupt(key, entry, f"hash mismatch: expected {entry.hash}, "
                                        f"found {h.hexdigest()} (the bytes on disk changed)")
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

    # ------------------------------------------------------------------ whole checkpoint
    def load(self) -> Any:
        """A fresh nested structure of numpy arrays and values: the data files are checked
        and the memory the new arrays need is known to be there before any is made."""
        m = self.manifest
        self.check_files()
        self.check_memory()
        leaves: dict[str, Any] = {}

        def load_one(item: tuple[str, ArrayEntry]) -> None:
            key, entry = item
            try:
                leaves[key] = self.read_array(key, entry)
            except (ValueError, OverflowError) as e:  # e.g. an absurd shape
                raise CorruptCheckpointError(
                    f"{self.where}: array {key!r} cannot be made ({type(e).__name__}: {e})",
                    checkpoint=self.where, key=key, file=MANIFEST) from None
            except MemoryError:
                raise CheckpointError(
                    f"{self.where}: no memory left for array {key!r} ({nbytes_of(entry)} "
                    "bytes); restore() into existing arrays needs none") from None

        runs, rest = self.plain_runs(list(m.arrays.items()))

        def load(item: Any) -> None:
            if type(item[0]) is not list:
                load_one(item)
                return
            outs = []
            for key, entry in item[0]:  # small and valid (parse checked): np.empty cannot fail
                leaves[key] = out = np.empty(entry.shape, decode_dtype(entry.dtype))
                outs.append((key, entry, out))
            self.read_plain_run(outs, _nothing)

        jobs: list[Any] = [*rest, *((run, run[0][1]) for run in runs)]
        self.per_file(sorted(jobs, key=lambda kv: kv[-1].start), load)

        def rebuild() -> Any:
            leaves.update({k: decode_value(v) for k, v in m.values.items()})
            if m.structure is None:
                return leaves
            return unflatten(m.structure, leaves)

        try:
            if deeper_than(sys.getrecursionlimit() - PARSE_FRAMES):
                return on_fresh_stack(rebuild)  # (a deep caller: as in manifest.parse)
            return rebuild()
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise CorruptCheckpointError(
                f"{self.where}: its structure or values in manifest.json are malformed "
                f"({type(e).__name__}: {e})", checkpoint=self.where, file=MANIFEST) from None

    def check_memory(self) -> None:
        """Refuse a load whose new arrays need more memory than the machine has available
        (saying how much), rather than fail inside numpy. A compressed entry declaring more
        than its stored frame decodes to is corruption, found here without reading it."""
        need = sum(nbytes_of(e) for e in self.manifest.arrays.values())
        have = available_memory()
        if have is None or need <= have:
            return
        self.check_frames()
        raise CheckpointError(
            f"{self.where}: loading it needs {need} bytes ({_gib(need)}) for new arrays, but "
            f"this machine has {have} bytes ({_gib(have)}) available. Restore into existing "
            "arrays with restore(), or load on a machine with more memory.")

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

    def restore_into(self, flat: FlatState, strict: bool = True,
                     checked: Callable[[CheckpointError | None], None] | None = None
                     ) -> RestoreReport:
        """Put this checkpoint back into the live objects of ``flat``: checked against the
        manifest and every adapter before a byte is written, then streamed into the live
        buffers (hash-verified), then values and adapters applied (see :mod:`.restore`).

        Mismatches raise :class:`IncompatibleTargetError` (``strict``) or are skipped and
        reported; the target is then unchanged. ``checked(error)`` is called once the
        checks are done (a multi-rank restore agrees there before any rank writes).
        """
        plan = RestorePlan(self, flat, strict)
        try:
            self.check_files()  # a manifest that lies about its files is corrupt, not a mismatch
            try:
                plan.plan()
            except IncompatibleTargetError as e:
                self.check_frames(e.mismatched_keys)
                raise
            # every compressed array, restored or not: a frame header that contradicts its
            # entry is corruption found before a byte of the target is written
            self.check_frames()
            plan.check()
        except CheckpointError as e:
            if checked is not None:
                checked(e)  # the other ranks of a job learn it before they write anything
            raise
        if checked is not None:
            checked(None)  # raises when another rank refused: nothing is written then
        plan.read()
        plan.apply()
        return plan.report

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
    read ahead in one call, so thousands of small tensors cost a few large reads."""

    def __init__(self, reader: CheckpointReader, holder: str, fname: str) -> None:
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
            size = max(0, min(WINDOW, self.length - offset))
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
        from pitstop.core.storage.local import LinkedFileError
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


def _slices(index: Any) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in index)


def nbytes_of(entry: ArrayEntry) -> int:
    return math.prod(entry.shape) * decode_dtype(entry.dtype).itemsize


#: the longest zstd frame header (magic, descriptor, window, dictionary id, content size)
_FRAME_HEADER = 18


def available_memory() -> int | None:
    """Bytes of memory this process could still get (MemAvailable plus free swap, at most a
    cgroup's limit), or None when it cannot tell."""
    have: int | None = None
    try:
        with open("/proc/meminfo", "rb") as f:
            info = {line.split(b":")[0]: int(line.split()[1]) * 1024
                    for line in f if line.split()[1:2] and line.split()[1].isdigit()}
        if b"MemAvailable" in info:
            have = info[b"MemAvailable"] + info.get(b"SwapFree", 0)
    except (OSError, ValueError, IndexError):
        pass
    if have is None:
        try:
            have = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            return None
    # a cgroup's limit caps it (its usage is not subtracted: much of it is page cache,
    # which the kernel reclaims; a false refusal would be worse than numpy's own error)
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            have = min(have, int(text))
        break
    return have


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.3g} GiB"


__all__ = ["CheckpointReader", "RestoreReport", "RestoredStep", "join"]
