"""Writing a manifest: which format version it is written as, and its bytes (the arrays
section made without a dict per entry), sealed.
"""

from __future__ import annotations

import json
from typing import Any

from pitstop.core.format.seal import seal
from pitstop.core.tree.values import encode_value

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


def _arrays_json(arrays: dict[str, Any]) -> str:
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


def encode(m: Any, sealer: Any = None) -> bytes:
    """The bytes of the manifest ``m`` (a :class:`~pitstop.core.format.schema.Manifest`),
    sealed: with a plain hash, or (encrypted, ``sealer``: the
    :class:`~pitstop.core.format.crypto.Encryption`) with an HMAC under the key."""
    sharded = any(e.shards is not None for e in m.arrays.values())
    version = WORLD_VERSION if m.world > 1 else \
        SHARDED_VERSION if sharded else FORMAT_VERSION
    doc = {
        "format": FORMAT,
        "format_version": version,
        "step": m.step,
        "created_unix": m.created_unix,
        "directory_id": m.directory_id,
        "writer": m.writer,
        "hash_algorithm": m.hash_algorithm,
        # non-finite floats (a NaN loss) are kept as {"$float": "nan"}, as in values
        "metrics": encode_value(m.metrics),
        "all_finite": m.all_finite,
        "user_metadata": encode_value(m.user_metadata),
        "files": {name: {"length": n} for name, n in m.files.items()},
    }
    if m.refs:
        if m.encryption is not None:
            raise ValueError("an encrypted manifest holds no references (refs)")
        doc["format_version"] = INCREMENTAL_VERSION
        doc["refs"] = {h: {f: {"length": n} for f, n in fs.items()}
                       for h, fs in m.refs.items()}
    # the arrays section is written by _arrays_json (the same text json.dumps makes,
    # without a dict per entry first); what follows it, as the document orders it
    rest: dict[str, Any] = {"values": m.values, "structure": m.structure}
    if m.layouts:
        rest["layouts"] = m.layouts
    if m.world > 1:
        rest["world"] = {"size": m.world,
                         "ranks": [{}] + [r.to_json() for r in m.ranks]}
    if m.encryption is not None:
        doc["format_version"] = ENCRYPTED_VERSION
        rest["encryption"] = m.encryption
        if sealer is None:
            raise ValueError("an encrypted manifest is sealed with its key: pass the sealer")
    text = (json.dumps(doc, separators=(",", ":"), allow_nan=False)[:-1]
            + ',"arrays":' + _arrays_json(m.arrays) + ","
            + json.dumps(rest, separators=(",", ":"), allow_nan=False)[1:])
    if m.encryption is not None:
        return bytes(sealer.seal(text.encode()))
    return seal(text.encode(), m.hash_algorithm)
