"""Reading a committed checkpoint: streamed into live arrays, every byte hash-verified."""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from . import codecs
from .dtypes import decode_dtype
from .errors import CheckpointError, CorruptCheckpointError, IncompatibleTargetError
from .hashing import new_hasher
from .manifest import ArrayEntry, Manifest, parse
from .storage.local import MANIFEST, pread_full
from .tree import FlatState, decode_value, encode_value, join, split, unflatten

READ_CHUNK = 16 << 20
SMALL = 1 << 20
WINDOW = 8 << 20


class ReadableStorage(Protocol):
    """What a reader needs of its storage: any :class:`Storage`, or the memory-tier buffer
    the manager verifies on recovery. ``open_reader(name, relpath) -> fd`` is optional."""

    def path_of(self, name: str, relpath: str = "") -> str: ...

    def read_bytes(self, name: str, relpath: str) -> bytes: ...

    def size(self, name: str, relpath: str) -> int: ...

    def read_into(self, name: str, relpath: str, offset: int, out: Any) -> int: ...


@dataclass
class RestoreReport:
    """Keys that did not match, as ``load_state_dict`` reports them."""

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    mismatched_keys: list[str] = field(default_factory=list)
    #: mismatched key -> what differs (for the error message)
    details: dict[str, str] = field(default_factory=dict)


class RestoredStep(int):
    """The restored step (an int), carrying what did not match under ``strict=False``."""

    missing_keys: list[str]
    unexpected_keys: list[str]
    mismatched_keys: list[str]

    def __new__(cls, step: int, report: RestoreReport | None = None) -> RestoredStep:
        obj = super().__new__(cls, step)
        report = report or RestoreReport()
        obj.missing_keys = report.missing_keys
        obj.unexpected_keys = report.unexpected_keys
        obj.mismatched_keys = report.mismatched_keys
        return obj


class CheckpointReader:
    """One committed checkpoint ``name`` in ``storage``."""

    def __init__(self, storage: ReadableStorage, name: str, *,
                 threads: int | None = None) -> None:
        self.storage = storage
        self.name = name
        self.threads = threads if threads is not None else min(4, os.cpu_count() or 1)
        self._sources: dict[str, _FileSource] = {}
        self.where = storage.path_of(name)
        try:
            data = storage.read_bytes(name, MANIFEST)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.where}: manifest.json is missing",
                                         checkpoint=self.where) from None
        except PermissionError as e:  # e.g. a manifest.json symlinked to outside the checkpoint
            raise CorruptCheckpointError(f"{self.where}: {e}", checkpoint=self.where) from None
        self.manifest: Manifest = parse(data, self.where)

    # ------------------------------------------------------------------ checks
    def check_files(self) -> None:
        """Cheap structural check: every data file exists with the recorded length."""
        for fname, length in self.manifest.files.items():
            try:
                actual = self.storage.size(self.name, fname)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{self.where}: data file {fname} is missing",
                                             checkpoint=self.where, file=fname) from None
            except PermissionError as e:
                raise CorruptCheckpointError(f"{self.where}: {e}", checkpoint=self.where,
                                             file=fname) from None
            if actual != length:
                raise CorruptCheckpointError(
                    f"{self.where}: data file {fname} has {actual} bytes, the manifest recorded "
                    f"{length} (truncated or overwritten)", checkpoint=self.where, file=fname)

    def verify(self) -> None:
        """Read every array and check its hash (``pitstop verify``)."""
        self.check_files()
        for key, entry in self.manifest.arrays.items():
            self.read_array(key, entry)

    # ------------------------------------------------------------------ arrays
    def read_array(self, key: str, entry: ArrayEntry, out: np.ndarray | None = None) -> np.ndarray:
        """Read one array (into ``out`` when given: C-contiguous, right shape and dtype)."""
        dtype = decode_dtype(entry.dtype)
        if out is None:
            out = np.empty(entry.shape, dtype)
        raw = out.reshape(-1).view(np.uint8) if out.size else np.empty(0, np.uint8)
        h = new_hasher(self.manifest.hash_algorithm)
        if entry.codec == "none":
            for pos in range(0, entry.length, READ_CHUNK):
                chunk = raw[pos:pos + READ_CHUNK]
                got = self._read(entry, entry.offset + pos, chunk)
                if got != len(chunk):
                    raise self._corrupt(key, entry, "the data file ends early (truncated)")
                h.update(chunk)
        else:
            payload = np.empty(entry.length, np.uint8)
            if self._read(entry, entry.offset, payload) != entry.length:
                raise self._corrupt(key, entry, "the data file ends early (truncated)")
            h.update(payload)
            if h.hexdigest() != entry.hash:
                raise self._corrupt(key, entry, "hash mismatch (the bytes on disk changed)")
            try:
                codecs.decode_into(entry.codec, payload.data, raw)
            except Exception as e:  # noqa: BLE001
                raise self._corrupt(key, entry, f"cannot decode: {e}") from None
            return out
        if h.hexdigest() != entry.hash:
            raise self._corrupt(key, entry, f"hash mismatch: expected {entry.hash}, found "
                                f"{h.hexdigest()} (the bytes on disk changed)")
        return out

    def _read(self, entry: ArrayEntry, offset: int, out: np.ndarray) -> int:
        src = self._sources.get(entry.file)
        try:
            if src is not None:
                return src.read_into(offset, out)
            return self.storage.read_into(self.name, entry.file, offset, out)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.where}: data file {entry.file} is missing",
                                         checkpoint=self.where, file=entry.file) from None
        except PermissionError as e:
            raise CorruptCheckpointError(f"{self.where}: {e}", checkpoint=self.where,
                                         file=entry.file) from None

    def _corrupt(self, key: str, entry: ArrayEntry, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.where}: array {key!r} in {entry.file} at offset {entry.offset}: {what}",
            checkpoint=self.where, key=key, file=entry.file)

    # ------------------------------------------------------------------ whole checkpoint
    def load(self) -> Any:
        """A fresh nested structure of numpy arrays and values."""
        m = self.manifest
        leaves: dict[str, Any] = {}

        def load_one(item: tuple[str, ArrayEntry]) -> None:
            leaves[item[0]] = self.read_array(item[0], item[1])

        self._per_file(sorted(m.arrays.items(), key=lambda kv: (kv[1].file, kv[1].offset)),
                       load_one)
        leaves.update({k: decode_value(v) for k, v in m.values.items()})
        if m.structure is None:
            return leaves
        return unflatten(m.structure, leaves)

    def restore_into(self, flat: FlatState, strict: bool = True) -> RestoreReport:
        """Stream arrays into the live leaves of ``flat`` and replace its values in place.

        Everything is checked against the manifest before a byte is read; mismatches raise
        :class:`IncompatibleTargetError` (``strict``) or are skipped and reported.
        """
        m = self.manifest
        report = RestoreReport()
        ck_keys = set(m.arrays) | set(m.values)
        # a target value whose path prefixes checkpoint entries (e.g. an optimizer's empty
        # state before its first step) is rebuilt whole from the checkpoint
        rebuilt: dict[str, Any] = {}
        for key in flat.values:
            if key not in ck_keys and any(k.startswith(key + "/") for k in ck_keys):
                rebuilt[key] = self._subtree(key)
        covered = {k for k in ck_keys for p in rebuilt if k.startswith(p + "/")}
        bad: set[str] = set()
        resized: set[str] = set()

        def mismatch(key: str, what: str) -> None:
            report.mismatched_keys.append(key)
            report.details[key] = what
            bad.add(key)

        for key, leaf in flat.arrays.items():
            e = m.arrays.get(key)
            if e is None:
                if key not in m.values:
                    report.missing_keys.append(key)
                else:
                    mismatch(key, "array in the target, value in the checkpoint")
                continue
            dtype = decode_dtype(e.dtype)
            if (key in flat.scalars and dtype != leaf.dtype and dtype.kind == leaf.dtype.kind
                    and dtype.kind in "US" and not e.shape):
                resized.add(key)  # np.str_ / np.bytes_ of another length: replaced anyway
            elif tuple(e.shape) != tuple(leaf.shape) or dtype != leaf.dtype:
                mismatch(key, f"checkpoint {dtype}{list(e.shape)}, "
                              f"target {leaf.dtype}{list(leaf.shape)}")
        for key in flat.values:
            if key in m.arrays and key not in m.values:
                mismatch(key, "value in the target, array in the checkpoint")
            elif key not in m.values and key not in rebuilt:
                report.missing_keys.append(key)
        # a value or numpy scalar held in a tuple cannot be replaced in place: fine when the
        # checkpoint holds the same value, a mismatch otherwise (never a silent stale value)
        in_tuple: set[str] = set()
        for key, (container, k) in [*flat.parents.items(), *flat.scalars.items()]:
            if not isinstance(container, tuple) or key in bad:
                continue
            in_tuple.add(key)
            if key in rebuilt:
                new = rebuilt[key]
            elif key in flat.scalars and key in m.arrays:
                new = self.read_array(key, m.arrays[key])[()]
            elif key in m.values:
                new = decode_value(m.values[key])
            else:
                continue
            if not _same(container[k], new):
                mismatch(key, f"held in a tuple, which cannot be changed in place: checkpoint "
                              f"{new!r:.60}, target {container[k]!r:.60}. Use a list, or load()")
        report.unexpected_keys = sorted(
            k for k in ck_keys - set(flat.arrays) - set(flat.values) - covered)
        if strict and (report.missing_keys or report.unexpected_keys or report.mismatched_keys):
            raise IncompatibleTargetError(
                _describe(self.where, report), missing=report.missing_keys,
                unexpected=report.unexpected_keys, mismatched=report.mismatched_keys)
        self.check_files()
        # arrays, in file order so reads stay sequential
        todo = [(k, leaf, m.arrays[k]) for k, leaf in flat.arrays.items()
                if k in m.arrays and k not in bad and k not in resized]
        todo.sort(key=lambda t: (t[2].file, t[2].offset))

        def restore_one(item: tuple[str, Any, ArrayEntry]) -> None:
            key, leaf, entry = item
            view = leaf.host_view()
            if view is not None:
                self.read_array(key, entry, view)
            else:
                leaf.assign(self.read_array(key, entry))

        self._per_file(todo, restore_one)
        for key, (container, k) in flat.scalars.items():
            if key in m.arrays and key not in bad and key not in in_tuple:
                container[k] = (self.read_array(key, m.arrays[key])[()] if key in resized else
                                flat.arrays[key].array[()])  # type: ignore[attr-defined]
        for key in flat.values:
            if key in rebuilt:
                new = rebuilt[key]
            elif key in m.values:
                new = decode_value(m.values[key])
            else:
                continue
            parent = flat.parents.get(key)
            if parent is not None and key not in in_tuple and key not in bad:
                container, k = parent
                container[k] = new
        return report

    def _per_file(self, items: list[Any], fn: Any) -> None:
        """Run ``fn`` over items (sorted by file, then offset), one thread per data file, so
        each file is read sequentially while reading and hash checks overlap across files."""
        by_file: dict[str, list[Any]] = {}
        for item in items:
            by_file.setdefault(item[-1].file, []).append(item)
        runs = list(by_file.values())
        for fname in by_file:
            if fname not in self._sources:
                self._sources[fname] = _FileSource(self, fname)
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

    def _subtree(self, prefix: str) -> Any:
        """Rebuild the checkpoint's subtree at ``prefix`` (fresh arrays)."""
        m = self.manifest
        node = m.structure
        for comp in split(prefix):
            node = _child(node, comp)
            if node is None:
                break
        leaves: dict[str, Any] = {}
        for k, e in m.arrays.items():
            if k.startswith(prefix + "/"):
                leaves[k] = self.read_array(k, e)
        for k, v in m.values.items():
            if k.startswith(prefix + "/"):
                leaves[k] = decode_value(v)
        if node is None:
            return leaves
        return unflatten(node, leaves, prefix)


class _FileSource:
    """Reads one data file through one descriptor; small reads are served from a window
    read ahead in one call, so thousands of small tensors cost a few large reads."""

    def __init__(self, reader: CheckpointReader, fname: str) -> None:
        self.reader = reader
        self.fname = fname
        self.length = reader.manifest.files.get(fname, 0)
        opener = getattr(reader.storage, "open_reader", None)
        self.fd: int | None = None
        if opener is not None:
            try:
                self.fd = opener(reader.name, fname)
            except (FileNotFoundError, PermissionError):
                self.fd = None  # the plain path below reports it as corruption
        self.window = np.empty(0, np.uint8)
        self.w_start = self.w_end = 0

    def read_into(self, offset: int, out: np.ndarray) -> int:
        n = out.nbytes
        if self.fd is None:
            return self.reader.storage.read_into(self.reader.name, self.fname, offset, out)
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


def _child(node: Any, comp: str) -> Any:
    """The structure node of one path component below ``node`` (None if absent)."""
    while isinstance(node, dict) and "$o" in node:
        node = node["$o"]
    if not isinstance(node, dict):
        return None
    if "$d" in node:
        for k, sub in node["$d"]:
            if str(k) == comp:
                return sub
        return None
    seq = node.get("$l", node.get("$t"))
    if seq is not None and comp.isdigit() and int(comp) < len(seq):
        return seq[int(comp)]
    return None


def _describe(where: str, r: RestoreReport) -> str:
    def some(keys: list[str]) -> str:
        return ", ".join(keys[:20]) + (f" (+{len(keys) - 20} more)" if len(keys) > 20 else "")
    parts = [f"cannot restore {where} into this state:"]
    if r.missing_keys:
        parts.append(f"missing in the checkpoint: {some(r.missing_keys)}")
    if r.unexpected_keys:
        parts.append(f"in the checkpoint but not in the target: {some(r.unexpected_keys)}")
    if r.mismatched_keys:
        parts.append("mismatched: " + some(
            [f"{k} ({r.details[k]})" if k in r.details else k for k in r.mismatched_keys]))
    parts.append("Pass strict=False to restore what matches.")
    return " ".join(parts)


def _same(a: Any, b: Any) -> bool:
    """True when a live value equals a restored one, bit for bit (NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.generic):
        return bool(np.asarray(a).tobytes() == np.asarray(b).tobytes())
    try:
        return bool(encode_value(a) == encode_value(b))
    except CheckpointError:
        return False


def nbytes_of(entry: ArrayEntry) -> int:
    return math.prod(entry.shape) * decode_dtype(entry.dtype).itemsize


__all__ = ["CheckpointReader", "RestoreReport", "RestoredStep", "join"]
