"""The versioned JSON manifest: schema, validation and migrations.

One manifest per checkpoint (``manifest.json``), written last. Readers accept every
``1.x`` version, migrate older majors through :data:`MIGRATIONS`, and refuse newer majors
with :class:`UnsupportedFormatError`. ``docs/format.md`` is the specification.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .dtypes import decode_dtype
from .errors import CorruptCheckpointError, UnsupportedFormatError
from .tree import decode_value, encode_value

FORMAT = "pitstop-checkpoint"
FORMAT_VERSION = "1.1"
MAJOR = 1
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_CODEC = re.compile(r"^(none|zstd|zstd\+shuffle[1-9][0-9]{0,2})$")

#: major version -> function upgrading a manifest dict of that major to the next one.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}


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

    def to_json(self) -> dict[str, Any]:
        d = {"dtype": self.dtype, "shape": self.shape, "file": self.file,
             "offset": self.offset, "length": self.length, "hash": self.hash}
        if self.codec != "none":
            d["codec"] = self.codec
        return d


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

    def to_bytes(self) -> bytes:
        doc = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
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
            "arrays": {k: e.to_json() for k, e in self.arrays.items()},
            "values": self.values,
            "structure": self.structure,
        }
        body = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
        return seal(body, self.hash_algorithm)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(e.shape) * decode_dtype(e.dtype).itemsize for e in self.arrays.values())


_HASH_KEY = b',"manifest_hash":"'


def seal(body: bytes, algorithm: str) -> bytes:
    """Append ``"manifest_hash"``: the hash of the manifest's bytes without that field, so
    the values, metrics and layout the manifest itself carries are covered too (format 1.1)."""
    from .hashing import hash_bytes
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
    from .hashing import ALGORITHMS, hash_bytes
    suffix = _HASH_KEY + str(digest).encode() + b'"}'
    algorithm = doc.get("hash_algorithm")
    if not data.endswith(suffix) or algorithm not in ALGORITHMS or \
            hash_bytes(str(algorithm), data[: -len(suffix)] + b"}") != digest:
        raise CorruptCheckpointError(
            f"{where}: manifest hash mismatch (manifest.json changed after it was committed)",
            checkpoint=where, file="manifest.json")


def parse(data: bytes, where: str) -> Manifest:
    """Parse and validate manifest bytes; ``where`` names the checkpoint in errors."""
    try:
        doc = json.loads(data)
    except RecursionError:
        raise CorruptCheckpointError(f"{where}: manifest is nested too deeply to be one",
                                     checkpoint=where) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{where}: manifest is not valid JSON ({e})",
                                     checkpoint=where) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{where}: not a pitstop manifest", checkpoint=where)
    if str(doc.get("format_version", "")).startswith("1."):
        check_seal(data, doc, where)
    version = doc.get("format_version")
    try:
        major = int(str(version).split(".")[0])
    except ValueError:
        raise CorruptCheckpointError(f"{where}: bad format_version {version!r}",
                                     checkpoint=where) from None
    if major > MAJOR:
        raise UnsupportedFormatError(
            f"{where}: written in checkpoint format {version}, but this pitstop reads format "
            f"{MAJOR}.x. Upgrade pitstop (pip install -U pitstop) to read it."
        )
    while major < MAJOR:
        if major not in MIGRATIONS:
            raise UnsupportedFormatError(f"{where}: format {version} is too old to migrate")
        doc = MIGRATIONS[major](doc)
        major += 1
    try:
        return _validate(doc, where)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise CorruptCheckpointError(f"{where}: malformed manifest ({type(e).__name__}: {e})",
                                     checkpoint=where) from None


def _validate(doc: dict[str, Any], where: str) -> Manifest:
    files: dict[str, int] = {}
    for name, info in doc["files"].items():
        if not _FILE_NAME.match(name):
            raise CorruptCheckpointError(
                f"{where}: data file name {name!r} is not a plain file name inside the checkpoint",
                checkpoint=where, file=name)
        length = info["length"]
        if not isinstance(length, int) or length < 0:
            raise ValueError(f"file {name}: bad length {length!r}")
        files[name] = length
    arrays: dict[str, ArrayEntry] = {}
    for key, e in doc["arrays"].items():
        if not isinstance(e["shape"], list) or not all(
                type(s) is int for s in e["shape"]):
            raise ValueError(f"array {key!r}: shape {e['shape']!r} is not a list of integers")
        entry = ArrayEntry(dtype=e["dtype"], shape=list(e["shape"]), file=e["file"],
                           offset=int(e["offset"]), length=int(e["length"]), hash=str(e["hash"]),
                           codec=e.get("codec", "none"))
        if not _CODEC.match(str(entry.codec)):
            raise ValueError(f"array {key!r}: unknown codec {entry.codec!r}")
        if entry.file not in files:
            raise CorruptCheckpointError(
                f"{where}: array {key!r} points to file {entry.file!r}, which the checkpoint "
                "does not list", checkpoint=where, key=key, file=entry.file)
        if any(s < 0 for s in entry.shape) or entry.offset < 0 or entry.length < 0:
            raise ValueError(f"array {key!r}: negative shape, offset or length")
        if entry.offset + entry.length > files[entry.file]:
            raise CorruptCheckpointError(
                f"{where}: array {key!r} ends past the end of {entry.file}",
                checkpoint=where, key=key, file=entry.file)
        dt = decode_dtype(entry.dtype)
        if entry.codec == "none" and entry.length != math.prod(entry.shape) * dt.itemsize:
            raise CorruptCheckpointError(
                f"{where}: array {key!r} has {entry.length} bytes, its shape and dtype need "
                f"{math.prod(entry.shape) * dt.itemsize}", checkpoint=where, key=key)
        arrays[key] = entry
    values = doc.get("values", {})
    if not isinstance(values, dict):
        raise ValueError("values is not an object")
    both = sorted(set(values) & set(arrays))
    if both:
        raise ValueError(f"{both[:3]} are both arrays and values")
    step = doc["step"]
    if not isinstance(step, int) or isinstance(step, bool):
        raise ValueError(f"step {step!r} is not an integer")
    from .hashing import ALGORITHMS
    if doc["hash_algorithm"] not in ALGORITHMS:
        raise ValueError(f"unknown hash_algorithm {doc['hash_algorithm']!r}")
    return Manifest(
        step=step, arrays=arrays, values=dict(values),
        structure=doc.get("structure"), files=files,
        hash_algorithm=str(doc["hash_algorithm"]), metrics=dict(decode_value(doc.get("metrics") or {})),
        directory_id=doc.get("directory_id"), created_unix=float(doc.get("created_unix", 0.0)),
        all_finite=doc.get("all_finite"), writer=dict(doc.get("writer") or {}),
        user_metadata=dict(decode_value(doc.get("user_metadata") or {})),
        format_version=str(doc["format_version"]),
    )
