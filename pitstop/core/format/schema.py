"""The manifest as data: one checkpoint's arrays (where each one's bytes live), values,
structure and rank views, and the limits a manifest's sizes keep. ``docs/format.md`` is the
specification; :mod:`pitstop.core.format.encode` writes it, :mod:`~pitstop.core.format.validate`
reads it back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pitstop.core.format.dtypes import decode_dtype
from pitstop.core.format.encode import FORMAT_VERSION, encode

#: separates a key path from a shard's index in the engine's piece keys; ``~`` is always
#: escaped inside key paths (tree.escape), so ``~s`` never occurs in one
SHARD_MARK = "~s"

#: the most dimensions an array may declare (numpy's own limit)
MAX_NDIM = 64

#: the most elements, and the most bytes, an array or a file may declare: far beyond any
#: real checkpoint, small enough that no size computed from them overflows a C integer
MAX_ELEMENTS = 1 << 56
MAX_BYTES = 1 << 60


@dataclass(slots=True)
class ArrayEntry:
    """Where one array's bytes live and how to check them."""

    dtype: Any
    shape: list[int]
    file: str
    offset: int
    length: int
    hash: str
    codec: str = "none"
    #: a shard: its ``[start, stop)`` per dimension inside the array it belongs to
    index: list[list[int]] | None = None
    #: a sharded array (``shape`` is the global one): its distinct shards, which cover it
    #: exactly; the entry's own file, offset, length and hash are then unused
    shards: list[ArrayEntry] | None = None
    #: an incremental checkpoint's unchanged array: the name of the older checkpoint of the
    #: same directory whose ``file`` holds the bytes (None: this checkpoint holds them)
    ref: str | None = None

    def to_json(self) -> dict[str, Any]:
        if self.shards is not None:
            return {"dtype": self.dtype, "shape": self.shape,
                    "shards": [s.to_json() for s in self.shards]}
        d: dict[str, Any] = {"dtype": self.dtype, "shape": self.shape, "file": self.file,
                             "offset": self.offset, "length": self.length, "hash": self.hash}
        if self.index is not None:
            d = {"index": self.index, **d}
            del d["shape"], d["dtype"]
        if self.codec != "none":
            d["codec"] = self.codec
        if self.ref is not None:
            d["ref"] = self.ref
        return d

    @property
    def origin(self) -> tuple[str, str]:
        """Which file holds the (first) bytes: ``(holder, file)``; holder "" is this
        checkpoint, else the older checkpoint an incremental entry references."""
        first = self.shards[0] if self.shards else self
        return first.ref or "", first.file

    @property
    def start(self) -> tuple[str, int]:
        """Where the bytes start (the first shard's, for a sharded array): reading arrays in
        this order goes through each file front to back."""
        first = self.shards[0] if self.shards else self
        return first.file, first.offset

    @property
    def parts(self) -> list[ArrayEntry]:
        """The stored pieces of this array: its shards, or itself."""
        return self.shards if self.shards is not None else [self]


def piece_key(key: str, index: tuple[tuple[int, int], ...]) -> str:
    """The engine's key for one shard of the array ``key`` (see :data:`SHARD_MARK`)."""
    return key + SHARD_MARK + ",".join(f"{a}:{b}" for a, b in index)


def group_pieces(entries: dict[str, ArrayEntry]) -> dict[str, ArrayEntry]:
    """Entries keyed by piece keys turned into one sharded entry per array (in first-piece
    order); its global shape is where its shards end (they cover it)."""
    out: dict[str, ArrayEntry] = {}
    for k, e in entries.items():
        base, mark, text = k.partition(SHARD_MARK)
        if not mark:
            out[k] = e
            continue
        index = [[int(a), int(b)] for a, b in (p.split(":") for p in text.split(","))] \
            if text else []
        shard = ArrayEntry(dtype=e.dtype, shape=[b - a for a, b in index], file=e.file,
                           offset=e.offset, length=e.length, hash=e.hash, codec=e.codec,
                           index=index, ref=e.ref)
        whole = out.get(base)
        if whole is None:
            whole = out[base] = ArrayEntry(dtype=e.dtype, shape=[0] * len(index), file="",
                                           offset=0, length=0, hash="", shards=[])
        assert whole.shards is not None
        whole.shards.append(shard)
        whole.shape = [max(n, b) for n, (_a, b) in zip(whole.shape, index, strict=True)]
    return out


@dataclass
class Manifest:
    step: int
    arrays: dict[str, ArrayEntry] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    structure: Any = None
    files: dict[str, int] = field(default_factory=dict)
    hash_algorithm: str = "xxh3-128"
    metrics: dict[str, Any] = field(default_factory=dict)
    directory_id: str | None = None
    created_unix: float = 0.0
    all_finite: bool | None = None
    writer: dict[str, Any] = field(default_factory=dict)
    user_metadata: dict[str, Any] = field(default_factory=dict)
    format_version: str = FORMAT_VERSION
    #: how many ranks wrote it (1: one process)
    world: int = 1
    #: ranks 1.. of a multi-rank checkpoint: how each one's view differs from the top level
    #: (rank 0's): :class:`RankView` (empty for one process)
    ranks: list[RankView] = field(default_factory=list)
    #: the ``encryption`` section of an encrypted checkpoint (no key material); None: plaintext
    encryption: dict[str, Any] | None = None
    #: an incremental checkpoint: the older checkpoints its ``ref`` entries read, each with
    #: the lengths of its data files they read (empty: every byte is this checkpoint's own)
    refs: dict[str, dict[str, int]] = field(default_factory=dict)
    #: array key -> how the framework laid it out over devices (see ``ArrayLeaf.layout``):
    #: optional, informational, read by the adapter that made it (absent: none recorded)
    layouts: dict[str, Any] = field(default_factory=dict)

    def to_bytes(self, sealer: Any = None) -> bytes:
        """The manifest's bytes, sealed: with a plain hash, or (encrypted, ``sealer``: the
        :class:`~pitstop.core.format.crypto.Encryption`) with an HMAC under the key (see
        :func:`pitstop.core.format.encode.encode`)."""
        return encode(self, sealer)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(e.shape) * decode_dtype(e.dtype).itemsize for e in self.arrays.values())

    def stored(self) -> list[tuple[str, ArrayEntry]]:
        """Every stored run of bytes as ``(key, entry)``: a sharded array's shards each, and
        the arrays only other ranks have (each stored run once)."""
        out = [(k, p) for k, e in self.arrays.items() for p in e.parts]
        seen = {(p.file, p.offset) for _k, p in out}
        for r in self.ranks:
            for k, e in r.arrays.items():
                for p in e.parts:
                    if (p.file, p.offset) not in seen:
                        seen.add((p.file, p.offset))
                        out.append((k, p))
        return out

    def view(self, rank: int) -> Manifest:
        """What rank ``rank`` saved: its structure, values and arrays (rank 0's view for a
        one-process checkpoint or rank 0)."""
        if rank == 0 or not self.ranks:
            return self
        r = self.ranks[rank - 1]
        arrays = {k: e for k, e in self.arrays.items() if k not in r.absent}
        arrays.update(r.arrays)
        return Manifest(
            step=self.step, arrays=arrays,
            values=self.values if r.values is None else r.values,
            structure=self.structure if r.structure is _SAME else r.structure,
            files=self.files, hash_algorithm=self.hash_algorithm, metrics=self.metrics,
            directory_id=self.directory_id, created_unix=self.created_unix,
            all_finite=self.all_finite, writer=self.writer, user_metadata=self.user_metadata,
            format_version=self.format_version, world=self.world, encryption=self.encryption,
            refs=self.refs, layouts=self.layouts)

    def rank_specific(self) -> list[str]:
        """Keys whose saved value differs between ranks (per-rank state: RNG streams, a
        sampler's position ...): what a restore on another world size cannot reshard."""
        keys: set[str] = set()
        for r in self.ranks:
            keys.update(r.arrays)
            keys.update(r.absent)
            if r.values is not None:
                keys.update(k for k in set(r.values) | set(self.values)
                            if r.values.get(k, _SAME) != self.values.get(k, _SAME))
        return sorted(keys)


#: marks a rank view's structure as the top level's
_SAME: Any = object()


@dataclass
class RankView:
    """How one rank's saved view differs from rank 0's (the manifest's top level)."""

    #: its arrays that rank 0 does not have, or whose bytes differ from rank 0's
    arrays: dict[str, ArrayEntry] = field(default_factory=dict)
    #: top-level arrays this rank does not have
    absent: list[str] = field(default_factory=list)
    #: its value leaves (None: the same as rank 0's)
    values: dict[str, Any] | None = None
    #: its structure (``_SAME``: the same as rank 0's)
    structure: Any = _SAME

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        if self.arrays:
            d["arrays"] = {k: e.to_json() for k, e in self.arrays.items()}
        if self.absent:
            d["absent"] = self.absent
        if self.values is not None:
            d["values"] = self.values
        if self.structure is not _SAME:
            d["structure"] = self.structure
        return d

