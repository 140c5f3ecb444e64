"""The checks of a manifest's array entries (an untrusted input): where each array's bytes
lie, of which dtype and shape, with which codec; a sharded array's shards cover it exactly.
A checkpoint of many small tensors has as many entries, so the common one takes a fast path.
"""

from __future__ import annotations

import math
import re
from typing import Any

from pitstop.core.errors import CorruptCheckpointError
from pitstop.core.format.decoding import _brief
from pitstop.core.format.dtypes import decode_dtype
from pitstop.core.format.schema import MAX_BYTES, MAX_ELEMENTS, MAX_NDIM, ArrayEntry

_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")

_CODEC = re.compile(r"^(none|zstd|zstd\+shuffle[1-9][0-9]{0,2}|aes-256-gcm|"
                    r"zstd(\+shuffle[1-9][0-9]{0,2})?\+aes-256-gcm)$")


def _object(v: Any, what: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ValueError(f"{what} is {_brief(v)}, not an object")
    return v


def _shape(shape: Any, key: str) -> list[int]:
    if type(shape) is not list or len(shape) > MAX_NDIM:
        raise ValueError(f"array {key!r}: shape {_brief(shape)} is not a list of at most "
                         f"{MAX_NDIM} integers")
    for s in shape:  # (a loop: the cost of this check is per array, on every restore)
        if type(s) is not int or s < 0:
            raise ValueError(f"array {key!r}: shape {_brief(shape)} is not a list of "
                             "non-negative integers")
    if len(shape) > 1 and math.prod(s or 1 for s in shape) > MAX_ELEMENTS:
        # (a 0 among the sizes does not make the others sane: numpy refuses an array whose
        # other dimensions overflow, [0, 2**40, 2**40, ...], as "too big")
        raise ValueError(f"array {key!r}: shape {_brief(shape)} has more than 2**56 elements")
    if len(shape) == 1 and shape[0] > MAX_ELEMENTS:
        raise ValueError(f"array {key!r}: shape {shape} has more than 2**56 elements")
    return list(shape)


def _count(v: Any, what: str, key: str) -> int:
    """A byte count or offset the manifest declares: a plain, non-negative, sane int."""
    if type(v) is not int or not 0 <= v <= MAX_BYTES:
        raise ValueError(f"array {key!r}: {what} {_brief(v)} is not an integer from 0 to "
                         "2**60")
    return v


def _dtype(descr: Any, key: str) -> Any:
    """The numpy dtype a manifest declares (ValueError for anything numpy or pitstop would
    not read back: unknown, object-holding, or of absurd size)."""
    if not isinstance(descr, (str, list)):
        raise ValueError(f"array {key!r}: dtype {_brief(descr)} is not a dtype descriptor")
    try:
        dt = decode_dtype(descr)
    except Exception as e:  # noqa: BLE001 - numpy raises many kinds for a bad descriptor
        raise ValueError(f"array {key!r}: dtype {_brief(descr)} is not one pitstop reads "
                         f"({type(e).__name__}: {e})") from None
    if dt.itemsize > MAX_BYTES >> 20:
        raise ValueError(f"array {key!r}: dtype {_brief(descr)} has absurd itemsize")
    return dt


def _stored(e: dict[str, Any], key: str, where: str, files: dict[str, int], dtype: Any,
            shape: list[int], refs: dict[str, dict[str, int]] | None = None) -> ArrayEntry:
    """One stored run of bytes: a whole array, or (with ``index``) one shard of ``shape``;
    with ``ref``, held by that older checkpoint (its files as ``refs`` lists them)."""
    index = None
    ref = e.get("ref")
    if ref is not None:
        if not isinstance(ref, str) or ref not in (refs or {}):
            raise CorruptCheckpointError(
                f"{where}: array {key!r} references {_brief(ref)}, which the manifest's refs "
                "do not list", checkpoint=where, key=key, file="manifest.json")
        files = (refs or {})[ref]
    if "index" in e:
        index = e["index"]
        if not isinstance(index, list) or len(index) != len(shape) or not all(
                isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r)
                and 0 <= r[0] <= r[1] <= n for r, n in zip(index, shape, strict=False)):
            raise CorruptCheckpointError(
                f"{where}: array {key!r} has a shard index {str(index)[:100]} that does not lie "
                f"inside its shape {shape}", checkpoint=where, key=key, file="manifest.json")
        shape = [b - a for a, b in index]
    if not isinstance(e["file"], str) or not isinstance(e["hash"], str) or \
            not isinstance(e.get("codec", "none"), str):
        raise ValueError(f"array {key!r}: its file, hash and codec must be strings")
    entry = ArrayEntry(dtype=dtype, shape=shape, file=e["file"],
                       offset=_count(e["offset"], "offset", key),
                       length=_count(e["length"], "length", key), hash=e["hash"],
                       codec=e.get("codec", "none"), index=index, ref=ref)
    if not _CODEC.fullmatch(entry.codec):
        raise ValueError(f"array {key!r}: unknown codec {_brief(entry.codec)}")
    if entry.file not in files:
        raise CorruptCheckpointError(
            f"{where}: array {key!r} points to file {entry.file!r}, which the checkpoint "
            f"{'' if ref is None else f'{ref} (referenced) '}does not list",
            checkpoint=where, key=key, file=entry.file)
    if entry.offset + entry.length > files[entry.file]:
        raise CorruptCheckpointError(
            f"{where}: array {key!r} ends past the end of {entry.file}",
            checkpoint=where, key=key, file=entry.file)
    dt = _dtype(entry.dtype, key)
    if math.prod(entry.shape) * dt.itemsize > MAX_BYTES:
        raise ValueError(f"array {key!r}: shape {entry.shape} of {dt} needs more than 2**60 "
                         "bytes")
    if entry.codec == "none" and entry.length != math.prod(entry.shape) * dt.itemsize:
        raise CorruptCheckpointError(
            f"{where}: array {key!r} has {entry.length} bytes, its shape and dtype need "
            f"{math.prod(entry.shape) * dt.itemsize}", checkpoint=where, key=key)
    return entry


def _check_cover(shards: list[ArrayEntry], shape: list[int], key: str, where: str) -> None:
    """The shards of a sharded array cover it exactly once: no gap, no overlap."""
    total = 0
    boxes = []
    for s in shards:
        assert s.index is not None
        total += math.prod(s.shape)
        if math.prod(s.shape):
            boxes.append(s.index)
    overlap = False
    if len(boxes) <= 4096:
        # sweep along the dimension the shards split most (sorted by their start there, no
        # box after one that starts at or past a's end can overlap a): shards split on a
        # later axis, all sharing the first dimension, are not compared all with all
        axis = max(range(len(shape)), key=lambda d: len({b[d][0] for b in boxes}),
                   default=-1)
        if axis >= 0:
            boxes.sort(key=lambda b: b[axis][0])
        for i, a in enumerate(boxes):
            for j in range(i + 1, len(boxes)):
                b = boxes[j]
                if axis >= 0 and b[axis][0] >= a[axis][1]:
                    break
                if all(x[0] < y[1] and y[0] < x[1] for x, y in zip(a, b, strict=True)):
                    overlap = True
                    break
            if overlap:
                break
    else:
        overlap = True  # more shards than pitstop writes: refuse rather than check for long
    if overlap or total != math.prod(shape):
        raise CorruptCheckpointError(
            f"{where}: the shards of array {key!r} do not cover its shape {shape} exactly "
            f"once ({len(shards)} shards)", checkpoint=where, key=key, file="manifest.json")


def _file_lengths(v: Any, what: str, where: str, kind: str) -> dict[str, int]:
    """A ``{file name: {"length": n}}`` section (the checkpoint's own files, or those of a
    checkpoint it references): plain file names only, lengths within bounds."""
    out: dict[str, int] = {}
    for name, info in _object(v, what).items():
        if not _FILE_NAME.fullmatch(name):
            raise CorruptCheckpointError(
                f"{where}: {kind} name {name!r} is not a plain file name inside the checkpoint",
                checkpoint=where, file=name)
        length = _object(info, f"{what}[{name!r}]")["length"]
        if type(length) is not int or not 0 <= length <= MAX_BYTES:
            raise ValueError(f"{kind} {name}: bad length {_brief(length)}")
        out[name] = length
    return out


#: the keys of an array stored whole, uncompressed and unencrypted, as pitstop writes it
_PLAIN_KEYS = frozenset(("dtype", "shape", "file", "offset", "length", "hash"))


def _entries(raw: dict[str, Any], where: str, files: dict[str, int],
             refs: dict[str, dict[str, int]] | None = None) -> dict[str, ArrayEntry]:
    """Every array entry of a manifest, checked as :func:`_entry` checks it.

    A checkpoint of many small tensors has as many entries, so the common kind (a whole
    array, uncompressed, unencrypted: exactly :data:`_PLAIN_KEYS`) takes a fast path with
    the same checks inlined and dtypes checked once per descriptor; an entry of any other
    kind, or one that fails a check there, goes through :func:`_entry`, which raises the
    exact error (so every message stays the one the full check gives)."""
    out: dict[str, ArrayEntry] = {}
    itemsizes: dict[str, int] = {}  # dtype descriptor -> itemsize, once checked by _dtype
    plain = _PLAIN_KEYS
    new = ArrayEntry
    for key, e in raw.items():
        if type(e) is dict and len(e) == 6 and e.keys() == plain:
            shape, descr, fname = e["shape"], e["dtype"], e["file"]
            offset, length, digest = e["offset"], e["length"], e["hash"]
            n = -1  # the number of elements, when the shape is a sane one of 0 to 2 sizes
            if type(shape) is list:
                nd = len(shape)
                if nd == 1:
                    n = shape[0]
                    if type(n) is not int or n > MAX_ELEMENTS:
                        n = -1
                elif nd == 2:
                    a, b = shape
                    # (as _shape bounds it: a 0 among the sizes does not make the other sane)
                    if type(a) is int and type(b) is int and a >= 0 and b >= 0 and \
                            (a or 1) * (b or 1) <= MAX_ELEMENTS:
                        n = a * b
                elif nd == 0:
                    n = 1
            if (n >= 0 and type(descr) is str and type(fname) is str and type(digest) is str
                    and type(offset) is int and type(length) is int
                    and 0 <= offset <= MAX_BYTES and 0 <= length <= MAX_BYTES):
                itemsize = itemsizes.get(descr)
                if itemsize is None:
                    try:
                        itemsize = itemsizes[descr] = _dtype(descr, key).itemsize
                    except ValueError:
                        itemsize = -1
                size = files.get(fname, -1)
                if itemsize >= 0 and n * itemsize == length and 0 <= offset + length <= size:
                    out[key] = new(descr, list(shape), fname, offset, length, digest)
                    continue
        out[key] = _entry(_object(e, f"array {key!r}"), key, where, files, refs)
    return out


def _entry(e: dict[str, Any], key: str, where: str, files: dict[str, int],
           refs: dict[str, dict[str, int]] | None = None) -> ArrayEntry:
    """One array's entry: stored whole, or sharded (its shards must cover it exactly)."""
    shape = _shape(e["shape"], key)
    if "shards" in e:
        _dtype(e["dtype"], key)
        if not isinstance(e["shards"], list) or not e["shards"]:
            raise ValueError(f"array {key!r}: shards is not a non-empty list")
        shards = [_stored(s, key, where, files, e["dtype"], shape, refs) for s in e["shards"]]
        _check_cover(shards, shape, key, where)
        return ArrayEntry(dtype=e["dtype"], shape=shape, file="", offset=0, length=0,
                          hash="", shards=shards)
    return _stored(e, key, where, files, e["dtype"], shape, refs)

