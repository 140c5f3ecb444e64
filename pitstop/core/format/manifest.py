"""The versioned JSON manifest: schema, validation and migrations.

One manifest per checkpoint (``manifest.json``), written last. Readers accept every
``1.x`` version, migrate older majors through :data:`MIGRATIONS`, and refuse newer majors
with :class:`UnsupportedFormatError`. ``docs/format.md`` is the specification.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import re
import sys
import threading
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass, field
from typing import Any

from pitstop.core.directory.names import Naming
from pitstop.core.errors import CorruptCheckpointError, UnsupportedFormatError
from pitstop.core.format.dtypes import decode_dtype
from pitstop.core.tree import MAX_DEPTH, StructureError, check_structure, decode_value, encode_value

FORMAT = "pitstop-checkpoint"
FORMAT_VERSION = "1.1"
#: the version of a manifest that holds sharded arrays: a new major, so that a reader from
#: before shards says "upgrade pitstop" instead of calling the checkpoint corrupt (a manifest
#: without shards is still written as 1.1, which every 1.x reader reads)
SHARDED_VERSION = "2.0"
#: a checkpoint written by several ranks (a ``world`` section): the top level is rank 0's
#: whole view, so a 2.0 reader still reads it as one process would (rank 0's state)
WORLD_VERSION = "2.1"
#: an encrypted checkpoint (an ``encryption`` section, ``manifest_mac`` in place of
#: ``manifest_hash``): a new major, so that a 2.x reader says "upgrade pitstop" instead of
#: calling it corrupt and moving it aside (plaintext checkpoints keep their 1.1 / 2.x versions)
ENCRYPTED_VERSION = "3.0"
#: an incremental checkpoint (array entries with a ``ref``: bytes held by an older checkpoint
#: of the same directory, listed in ``refs``): a new major, so that a 3.x reader says
#: "upgrade pitstop" instead of reading a file the checkpoint does not hold
INCREMENTAL_VERSION = "4.0"
MAJOR = 4
#: separates a key path from a shard's index in the engine's piece keys; ``~`` is always
#: escaped inside key paths (tree.escape), so ``~s`` never occurs in one
SHARD_MARK = "~s"
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_VERSION = re.compile(r"^(0|[1-9][0-9]{0,5})\.(0|[1-9][0-9]{0,5})$")
_CODEC = re.compile(r"^(none|zstd|zstd\+shuffle[1-9][0-9]{0,2}|aes-256-gcm|"
                    r"zstd(\+shuffle[1-9][0-9]{0,2})?\+aes-256-gcm)$")

#: major version -> function upgrading a manifest dict of that major to the next one.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {
    1: lambda doc: doc,  # 2.0 only added sharded array entries: a 1.x manifest is a 2.0 one
    2: lambda doc: doc,  # 3.0 only added encryption: a 2.x manifest is a plaintext 3.0 one
    3: lambda doc: doc,  # 4.0 only added references (ref, refs): a 3.x manifest has none
}


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


def _arrays_json(arrays: dict[str, ArrayEntry]) -> str:
    """``json.dumps({k: e.to_json() ...}, separators=(",", ":"))``, made faster for the
    common entry (a whole array, uncompressed, plain ints and strings): a checkpoint of
    many small tensors has as many entries, written at every save."""
    from json.encoder import encode_basestring_ascii as quote
    quoted: dict[Any, str] = {}  # dtype descriptors and file names, each quoted once
    shapes: dict[tuple[Any, ...], str | None] = {}  # each shape's JSON (None: not plain ints)
    parts = []
    for k, e in arrays.items():
        dt, fname, shape, off, n, h = e.dtype, e.file, e.shape, e.offset, e.length, e.hash
        if (e.codec == "none" and e.index is None and e.shards is None and e.ref is None
                and type(dt) is str
                and type(fname) is str and type(h) is str and type(off) is int
                and type(n) is int and type(shape) is list):
            key = tuple(shape)
            js = shapes.get(key, False)
            if js is False:
                js = shapes[key] = "[" + ",".join(map(str, shape)) + "]" if all(
                    type(x) is int for x in shape) else None
            qd = quoted.get(dt)
            if qd is None:
                qd = quoted[dt] = quote(dt)
            qf = quoted.get(fname)
            if qf is None:
                qf = quoted[fname] = quote(fname)
        else:
            js = None
        if js is not None:
            parts.append(f'{quote(k)}:{{"dtype":{qd},"shape":{js},"file":{qf},"offset":{off},'
                         f'"length":{n},"hash":{quote(h)}}}')
        else:
            parts.append(quote(k) + ":" + json.dumps(e.to_json(), separators=(",", ":"),
                                                     allow_nan=False))
    return "{" + ",".join(parts) + "}"


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
        :class:`~pitstop.core.format.crypto.Encryption`) with an HMAC under the key."""
        sharded = any(e.shards is not None for e in self.arrays.values())
        version = WORLD_VERSION if self.world > 1 else \
            SHARDED_VERSION if sharded else FORMAT_VERSION
        doc = {
            "format": FORMAT,
            "format_version": version,
            "step": self.step,
            "created_unix": self.created_unix,
            "directory_id": self.directory_id,
            "writer": self.writer,
            "hash_algorithm": self.hash_algorithm,
            # non-finite floats (a NaN loss) are kept as {"$float": "nan"}, as in values
            "metrics": encode_value(self.metrics),
            "all_finite": self.all_finite,
            "user_metadata": encode_value(self.user_metadata),
            "files": {name: {"length": n} for name, n in self.files.items()},
        }
        if self.refs:
            if self.encryption is not None:
                raise ValueError("an encrypted manifest holds no references (refs)")
            doc["format_version"] = INCREMENTAL_VERSION
            doc["refs"] = {h: {f: {"length": n} for f, n in fs.items()}
                           for h, fs in self.refs.items()}
        # the arrays section is written by _arrays_json (the same text json.dumps makes,
        # without a dict per entry first); what follows it, as the document orders it
        rest: dict[str, Any] = {"values": self.values, "structure": self.structure}
        if self.layouts:
            rest["layouts"] = self.layouts
        if self.world > 1:
            rest["world"] = {"size": self.world,
                             "ranks": [{}] + [r.to_json() for r in self.ranks]}
        if self.encryption is not None:
            doc["format_version"] = ENCRYPTED_VERSION
            rest["encryption"] = self.encryption
            if sealer is None:
                raise ValueError("an encrypted manifest is sealed with its key: pass the sealer")
        text = (json.dumps(doc, separators=(",", ":"), allow_nan=False)[:-1]
                + ',"arrays":' + _arrays_json(self.arrays) + ","
                + json.dumps(rest, separators=(",", ":"), allow_nan=False)[1:])
        if self.encryption is not None:
            return bytes(sealer.seal(text.encode()))
        return seal(text.encode(), self.hash_algorithm)

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


_HASH_KEY = b',"manifest_hash":"'


def seal(body: bytes, algorithm: str) -> bytes:
    """Append ``"manifest_hash"``: the hash of the manifest's bytes without that field, so
    the values, metrics and layout the manifest itself carries are covered too (format 1.1)."""
    from pitstop.core.format.hashing import hash_bytes
    digest = hash_bytes(algorithm, body)
    return body[:-1] + _HASH_KEY + digest.encode() + b'"}'


def check_seal(data: bytes, doc: dict[str, Any], where: str) -> None:
    """Verify ``manifest_hash`` when present (1.0 manifests have none)."""
    digest = doc.get("manifest_hash")
    if digest is None:
        if str(doc.get("format_version")) != "1.0":
            raise CorruptCheckpointError(
                f"{where}: manifest_hash is missing (every manifest since format 1.1 has one)",
                checkpoint=where, file="manifest.json")
        return
    from pitstop.core.format.hashing import ALGORITHMS, hash_bytes
    suffix = _HASH_KEY + str(digest).encode() + b'"}'
    algorithm = doc.get("hash_algorithm")
    if not data.endswith(suffix) or not isinstance(algorithm, str) or \
            algorithm not in ALGORITHMS or \
            hash_bytes(str(algorithm), data[: -len(suffix)] + b"}") != digest:
        raise CorruptCheckpointError(
            f"{where}: manifest hash mismatch (manifest.json changed after it was committed)",
            checkpoint=where, file="manifest.json")


#: the fields a plaintext manifest starts with, in the order pitstop writes them
_HEAD = ("format", "format_version", "step", "created_unix", "directory_id", "writer",
         "hash_algorithm")


def peek_header(data: bytes, where: str) -> dict[str, Any] | None:
    """The leading fields of a plaintext manifest (format to hash_algorithm: whose it is,
    of which step), its seal checked over all of its bytes, without decoding its entries:
    retention asks this of every checkpoint it deletes, and a manifest of 100,000 tensors
    takes half a second to decode whole. None when the manifest does not start as pitstop
    writes one (encrypted, edited by hand, another writer): the caller then parses it whole.
    Raises :class:`CorruptCheckpointError` when the seal does not hold."""
    try:
        text = data[:1 << 16].decode("utf-8", "ignore")
        digest = data[data.rindex(_HASH_KEY) + len(_HASH_KEY):-2].decode("ascii")
    except (ValueError, UnicodeDecodeError):
        return None
    if not text.startswith("{") or not data.endswith(b'"}'):
        return None
    decoder = json.JSONDecoder(object_pairs_hook=_unique, parse_constant=_not_json,
                               parse_float=_finite)
    head: dict[str, Any] = {}
    pos = 1
    try:
        for name in _HEAD:
            lead = f'"{name}":'
            if not text.startswith(lead, pos):
                return None
            head[name], pos = decoder.raw_decode(text, pos + len(lead))
            if not text.startswith(",", pos):
                return None
            pos += 1
    except (ValueError, RecursionError):
        return None
    end = len(text[:pos].encode())
    for name in _HEAD[:2] + _HEAD[3:]:
        # the same field again further on: the whole parse refuses such a manifest
        # (load_json), so the header must not be read from it. ("step" is a common key of
        # values, and retention decides by directory_id; a second top-level step is
        # refused by the whole parse of any reader)
        if data.find(b'"%s":' % name.encode(), end) >= 0:
            return None
    version = head["format_version"]
    if head["format"] != FORMAT or type(version) is not str or not _VERSION.fullmatch(version) \
            or not 1 <= int(version.split(".")[0]) <= MAJOR or type(head["step"]) is not int:
        return None
    check_seal(data, {"manifest_hash": digest, "format_version": version,
                      "hash_algorithm": head["hash_algorithm"]}, where)
    return head


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """One JSON object, refused when a key occurs twice in it: Python's json keeps the last,
    a quick read of the leading fields the first, so the two could disagree about whose
    checkpoint it is (and other JSON readers pick either)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _v in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"key {_brief(dup)} occurs twice in one object")
    return out


def load_json(data: bytes | str) -> Any:
    """The one parse of a manifest and of ``.pitstop/directory.json``: strict JSON (no
    ``NaN``/``Infinity``, no number beyond a double) and no key twice in one object.
    Raises ``ValueError`` (``json.JSONDecodeError`` for a syntax error), ``RecursionError``
    or ``UnicodeDecodeError``."""
    return json.loads(data, object_pairs_hook=_unique, parse_constant=_not_json,
                      parse_float=_finite)


def _not_json(word: str) -> Any:
    """``NaN``, ``Infinity``, ``-Infinity``: Python's json reads them, JSON has no such
    thing (pitstop writes a non-finite float as ``{"$float": "nan"}``)."""
    raise ValueError(f"{word} is not JSON")


def _finite(text: str) -> float:
    """A JSON number with a fraction or exponent; one too large for a double (``1e400``,
    which Python would read as infinity) is not one pitstop writes."""
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"number {text[:40]} is out of range")
    return v


def parse(data: bytes, where: str, encryption: Any = None, naming: Naming | None = None
          ) -> Manifest:
    """Parse and validate manifest bytes; ``where`` names the checkpoint in errors. An
    encrypted one needs ``encryption`` (its key) to check its HMAC seal. ``naming``: the
    directory's, so that each referenced checkpoint (``refs``) must be one of its
    checkpoints of an older step (without it, only the form of those names is checked)."""
    with gc_paused():
        if deeper_than(sys.getrecursionlimit() - PARSE_FRAMES):
            # a caller deep in its own stack: the nesting of a valid manifest must not run
            # into the recursion limit and be taken for corruption, so it is read on a
            # fresh stack
            m = on_fresh_stack(_parse, data, where, encryption)
        else:
            m = _parse(data, where, encryption)
    if naming is not None and m.refs:
        check_refs(m, naming, where)
    return m  # type: ignore[no-any-return]


def check_refs(m: Manifest, naming: Naming, where: str) -> None:
    """Every checkpoint ``m`` references is named as ``naming`` names a checkpoint, of a
    step older than ``m``'s own (never itself: references never loop)."""
    for holder in m.refs:
        step = naming.parse(holder)
        if step is None or step >= m.step:
            raise CorruptCheckpointError(
                f"{where}: manifest.json references {_brief(holder)}, which is not an older "
                f"checkpoint of this directory (its checkpoints are named "
                f"{naming.describe()}; this one is of step {m.step})",
                checkpoint=where, file="manifest.json")


_gc_lock = threading.Lock()
_gc_pauses = [0, False]  # how many gc_paused() are open; whether the collector was enabled


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (reference counting goes on) while a manifest of
    many entries is decoded: its 100,000 small dicts would otherwise set off collections
    that rescan the whole heap of a large job again and again (half of the parse time).
    Pauses on several threads compose: the collector runs again when the last one ends,
    and only if it ran when the first began."""
    with _gc_lock:
        if _gc_pauses[0] == 0:
            _gc_pauses[1] = gc.isenabled()
            gc.disable()
        _gc_pauses[0] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses[0] -= 1
            if _gc_pauses[0] == 0 and _gc_pauses[1]:
                gc.enable()


#: the frames parsing may need: the JSON nesting of the deepest structure pitstop writes
#: (three levels per container), then the checks walking it, with room to spare
PARSE_FRAMES = 3 * MAX_DEPTH + 300


def deeper_than(frames: int) -> bool:
    """Whether the caller's stack is more than ``frames`` frames deep."""
    f: Any = sys._getframe(1)
    for _ in range(max(frames, 0)):
        f = f.f_back
        if f is None:
            return False
    return True


def on_fresh_stack(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` run on a fresh thread's stack (its result, or its exception raised)."""
    out: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            out.append((True, fn(*args)))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            out.append((False, e))

    t = threading.Thread(target=run, name="pitstop-parse", daemon=True)
    t.start()
    t.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


def _parse(data: bytes, where: str, encryption: Any) -> Manifest:
    try:
        doc = load_json(data)
    except RecursionError:
        raise CorruptCheckpointError(f"{where}: manifest is nested too deeply to be one",
                                     checkpoint=where) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{where}: manifest is not valid JSON ({e})",
                                     checkpoint=where) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{where}: not a pitstop manifest", checkpoint=where)
    encrypted = "encryption" in doc or "manifest_mac" in doc
    version = doc.get("format_version")
    # exactly "<major>.<minor>" as pitstop writes it: the version decides how the manifest
    # is sealed, so a version that int() would read some other way (1, "01.1", " 1.1")
    # must never skip the seal check
    if type(version) is not str or not _VERSION.fullmatch(version):
        raise CorruptCheckpointError(f"{where}: bad format_version {_brief(version)}",
                                     checkpoint=where, file="manifest.json")
    major = int(version.split(".")[0])
    if encrypted:
        from pitstop.core.format.crypto import check_sealed
        check_sealed(data, doc, where, encryption)
    elif 1 <= major <= MAJOR:
        check_seal(data, doc, where)
    if major > MAJOR:
        raise UnsupportedFormatError(
            f"{where}: written in checkpoint format {version}, but this pitstop reads formats "
            f"up to {MAJOR}.x. Upgrade pitstop (pip install -U pitstop) to read it."
        )
    while major < MAJOR:
        if major not in MIGRATIONS:
            raise UnsupportedFormatError(f"{where}: format {version} is too old to migrate")
        doc = MIGRATIONS[major](doc)
        major += 1
    try:
        manifest = _validate(doc, where)
        if encrypted:
            manifest.encryption = doc["encryption"]
        _check_encrypted(manifest)
        return manifest
    except RecursionError:
        raise CorruptCheckpointError(f"{where}: manifest is nested too deeply to be one",
                                     checkpoint=where, file="manifest.json") from None
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as e:
        what = f"missing field {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise CorruptCheckpointError(f"{where}: malformed manifest.json ({what})",
                                     checkpoint=where, file="manifest.json") from None


#: the most dimensions an array may declare (numpy's own limit)
MAX_NDIM = 64
#: the most elements, and the most bytes, an array or a file may declare: far beyond any
#: real checkpoint, small enough that no size computed from them overflows a C integer
MAX_ELEMENTS = 1 << 56
MAX_BYTES = 1 << 60


def _check_encrypted(m: Manifest) -> None:
    """Every stored array is encrypted exactly when the manifest says it is."""
    from pitstop.core.format.crypto import split
    if m.refs and m.encryption is not None:
        raise ValueError("an encrypted manifest with references (refs): pitstop writes none")
    if m.encryption is None and not m.ranks and all(
            e.codec == "none" and e.shards is None for e in m.arrays.values()):
        return  # the common case, without a list of every stored run
    for key, e in m.stored():
        if split(e.codec)[1] != (m.encryption is not None):
            raise ValueError(f"array {key!r}: codec {e.codec!r} in "
                             f"{'an encrypted' if m.encryption else 'a plaintext'} manifest")


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


def _brief(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:76] + "...'"


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


def _validate(doc: dict[str, Any], where: str) -> Manifest:
    files = _file_lengths(doc["files"], "files", where, "data file")
    refs = _refs(doc.get("refs", {}), where)
    arrays = _entries(_object(doc["arrays"], "arrays"), where, files, refs)
    values = doc.get("values", {})
    if not isinstance(values, dict):
        raise ValueError("values is not an object")
    _check_values(values, where)
    both = sorted(set(values) & set(arrays))
    if both:
        raise ValueError(f"{both[:3]} are both arrays and values")
    world, ranks = 1, []
    if "world" in doc:
        world = doc["world"]["size"]
        sections = doc["world"]["ranks"]
        if type(world) is not int or world < 2 or not isinstance(sections, list) or \
                len(sections) != world or sections[0] != {}:
            raise ValueError(f"world: size {world!r} with {len(sections)} rank sections")
        for r, sec in enumerate(sections[1:], 1):
            view = RankView(
                arrays={k: _entry(e, k, where, files) for k, e in sec.get("arrays", {}).items()},
                absent=list(sec.get("absent", [])),
                values=sec.get("values"), structure=sec.get("structure", _SAME))
            if view.values is not None and not isinstance(view.values, dict):
                raise ValueError(f"world: rank {r}'s values are not an object")
            if view.values is not None:
                _check_values(view.values, where)
            if not all(isinstance(k, str) and k in arrays for k in view.absent):
                raise ValueError(f"world: rank {r}'s absent arrays are not top-level arrays")
            ranks.append(view)
    step = doc["step"]
    if not isinstance(step, int) or isinstance(step, bool):
        raise ValueError(f"step {step!r} is not an integer")
    from pitstop.core.format.hashing import ALGORITHMS
    if doc["hash_algorithm"] not in ALGORITHMS:
        raise ValueError(f"unknown hash_algorithm {_brief(doc['hash_algorithm'])}")
    structure = doc.get("structure")
    _check_structure(structure, arrays, values, where)
    for r, view in enumerate(ranks, 1):
        if view.structure is not _SAME:
            mine = _ViewKeys(arrays, set(view.absent), view.arrays)
            _check_structure(view.structure, mine,
                             values if view.values is None else view.values, where, r)
    created = doc.get("created_unix", 0.0)
    if not isinstance(created, (int, float)) or isinstance(created, bool) or \
            not math.isfinite(created):
        raise ValueError(f"created_unix {_brief(created)} is not a time")
    if doc.get("all_finite") not in (None, True, False):
        raise ValueError(f"all_finite {_brief(doc.get('all_finite'))} is not a bool")
    if not isinstance(doc.get("directory_id"), (str, type(None))):
        raise ValueError(f"directory_id {_brief(doc.get('directory_id'))} is not a string")
    return Manifest(
        step=step, arrays=arrays, values=dict(values),
        structure=structure, files=files,
        hash_algorithm=str(doc["hash_algorithm"]),
        metrics=_decoded_object(doc.get("metrics"), "metrics", where),
        directory_id=doc.get("directory_id"), created_unix=float(created),
        all_finite=doc.get("all_finite"),
        writer=dict(_object(doc.get("writer") or {}, "writer")),
        user_metadata=_decoded_object(doc.get("user_metadata"), "user_metadata", where),
        format_version=str(doc["format_version"]), world=world, ranks=ranks, refs=refs,
        layouts=_layouts(doc.get("layouts"), arrays),
    )


def _layouts(v: Any, arrays: Container[str]) -> dict[str, Any]:
    """The optional ``layouts`` section: objects keyed by array keys (informational: an
    entry for a key the checkpoint holds no array under is dropped, not an error)."""
    if v is None:
        return {}
    return {k: e for k, e in _object(v, "layouts").items()
            if k in arrays and isinstance(e, dict)}


#: what a referenced checkpoint's name may be (a single directory entry, never one of
#: pitstop's own: .pitstop, .tmp-*); ``check_refs`` then holds it to the directory's naming
_REF_NAME = re.compile(r"^[^./\x00][^/\x00]{0,254}$", re.S)


def _refs(v: Any, where: str) -> dict[str, dict[str, int]]:
    """The ``refs`` section: referenced checkpoint -> its data files read -> their lengths."""
    out: dict[str, dict[str, int]] = {}
    for holder, files in _object(v, "refs").items():
        if not _REF_NAME.fullmatch(holder) or ".tmp-" in holder:
            raise CorruptCheckpointError(
                f"{where}: manifest.json references {_brief(holder)}, which is not the name "
                "of a checkpoint", checkpoint=where, file="manifest.json")
        held = _file_lengths(files, f"refs[{holder!r}]", where,
                             f"referenced data file of {holder}")
        if not held:
            raise ValueError(f"refs: {holder} lists no data file")
        out[holder] = held
    return out


def _object(v: Any, what: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ValueError(f"{what} is {_brief(v)}, not an object")
    return v


def _check_values(values: dict[str, Any], where: str) -> None:
    """Every value leaf decodes (the ``$float``, ``$bytes``, ``$tuple``, ``$dict`` wrappers
    are what :func:`encode_value` writes), or the manifest is corrupt, naming the key."""
    for key, v in values.items():
        try:
            decode_value(v)
        except (ValueError, TypeError, RecursionError) as e:
            raise CorruptCheckpointError(
                f"{where}: value {key!r} in manifest.json is malformed ({e})",
                checkpoint=where, key=key, file="manifest.json") from None


def _decoded_object(v: Any, what: str, where: str) -> dict[str, Any]:
    try:
        out = decode_value(v or {})
    except (ValueError, TypeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: {what} in manifest.json is malformed ({e})",
                                     checkpoint=where, file="manifest.json") from None
    return dict(_object(out, what))


class _ViewKeys:
    """The array keys of one rank's view, without copying rank 0's (``in`` only)."""

    def __init__(self, top: dict[str, Any], absent: set[str], own: dict[str, Any]) -> None:
        self.top, self.absent, self.own = top, absent, own

    def __contains__(self, key: object) -> bool:
        return key in self.own or (key in self.top and key not in self.absent)


def _check_structure(structure: Any, arrays: Container[str], values: Container[str],
                     where: str, rank: int = 0) -> None:
    """The recorded structure rebuilds from these keys (see :func:`tree.check_structure`)."""
    if structure is None:
        return
    try:
        check_structure(structure, arrays, values)
    except (StructureError, RecursionError) as e:
        of = f" of rank {rank}" if rank else ""
        raise CorruptCheckpointError(
            f"{where}: the structure{of} in manifest.json is malformed ({e})",
            checkpoint=where, key=getattr(e, "key", None), file="manifest.json") from None


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
