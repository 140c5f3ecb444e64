"""The npz format: one pitstop checkpoint as a ``.npz`` file that numpy alone reads, and
any ``np.savez`` file read back as a tree (``pitstop export --to npz`` / ``pitstop import``).

The layout (``docs/cli.md``): one ``.npy`` member per array, named by its pitstop key path
(components joined by ``/``, a ``/`` inside a component escaped as ``~1``), and one 0-d
unicode array ``__pitstop__`` holding JSON: ``{"format": "pitstop-npz", "format_version":
1, "step", "metrics", "values": {key path: value in the manifest's encoding}, "dtypes": {key
path: ml_dtypes name}, "structure"}``. Arrays of ml_dtypes types (bfloat16, float8, int4
...), which ``.npy`` cannot describe, are stored as their bits (unsigned ints of the same
width) and named in ``dtypes``. ``np.load(path, allow_pickle=False)`` reads every member.
"""

from __future__ import annotations

import json
import zipfile
from typing import Any

import numpy as np

from pitstop.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedStateError,
)
from pitstop.core.format.dtypes import ML_DTYPES
from pitstop.core.tree import decode_value, encode_value, split, unflatten
from pitstop.interop.common import atomic_write

NPZ_META = "__pitstop__"
NPZ_FORMAT = "pitstop-npz"


class ArrayUnreadable(CheckpointError):
    """An array of the checkpoint being exported could not be read (its cause chained:
    corrupt bytes, a vanished file); the caller reports the cause for the checkpoint."""


def _sub_structure(structure: Any, comps: list[str]) -> Any:
    """The part of a manifest's ``structure`` at key path components ``comps`` (None when
    it cannot be found)."""
    node = structure
    for c in comps:
        while isinstance(node, dict) and "$o" in node:
            node = node["$o"]
        if not isinstance(node, dict):
            return None
        if "$d" in node:
            found = [sub for k, sub in node["$d"] if str(k) == c]
            if not found:
                return None
            node = found[0]
        elif "$t" in node or "$l" in node:
            items: list[Any] = node.get("$t", node.get("$l")) or []
            if not c.isdigit() or int(c) >= len(items):
                return None
            node = items[int(c)]
        else:
            return None
    return node


def relative(kp: str, key: str | None) -> str | None:
    """``kp`` relative to the entry ``key`` (None: outside it)."""
    if key is None:
        return kp
    if kp == key:
        return split(kp)[-1] if split(kp) else kp
    if kp.startswith(key + "/"):
        return kp[len(key) + 1:]
    return None


def nested(leaves: dict[str, Any], where: str) -> dict[str, Any]:
    """Nested dicts from ``{key path: leaf}``."""
    root: dict[str, Any] = {}
    for kp, leaf in leaves.items():
        comps = split(kp) or [kp]
        node = root
        for c in comps[:-1]:
            nxt = node.setdefault(c, {})
            if not isinstance(nxt, dict):
                raise CorruptCheckpointError(f"{where}: {kp!r} is inside another entry "
                                             f"({c!r}), so no tree holds both",
                                             checkpoint=where, key=kp)
            node = nxt
        if comps[-1] in node:
            raise CorruptCheckpointError(f"{where}: entry {kp!r} is there twice (or also "
                                         "holds other entries)", checkpoint=where, key=kp)
        node[comps[-1]] = leaf
    return root


def write_npz(reader: Any, path: str, key: str | None) -> tuple[int, int]:
    """Write the checkpoint ``reader`` reads (or its entry ``key``) as an npz file at
    ``path``, one array at a time; returns (arrays, bytes). An array that cannot be read
    raises :class:`ArrayUnreadable`, its cause chained; a failed write
    :class:`pitstop.CheckpointWriteError`."""
    m = reader.manifest
    arrays = {r: (kp, e) for kp, e in m.arrays.items()
              if (r := relative(kp, key)) is not None}
    values = {r: v for kp, v in m.values.items() if (r := relative(kp, key)) is not None}
    if key is not None and not arrays and not values:
        raise CheckpointNotFoundError(f"{reader.where} has no entry {key!r}; `pitstop inspect` "
                                      "lists its keys")
    if NPZ_META in arrays:
        raise UnsupportedStateError(f"{reader.where}: an array is named {NPZ_META!r}, the name "
                                    "of the npz file's own metadata; export the other entries "
                                    "with --key")
    structure = m.structure if key is None else _sub_structure(m.structure, split(key))
    dtypes: dict[str, str] = {}
    total = 0

    def write(tmp: str) -> None:
        nonlocal total
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, (kp, entry) in arrays.items():
                try:
                    a = reader.read_array(kp, entry)
                except Exception as e:  # noqa: BLE001 - corrupt bytes, a vanished file
                    raise ArrayUnreadable(kp) from e
                ml = ML_DTYPES.name_of(a.dtype)
                if ml is not None:
                    dtypes[name] = ml
                    a = a.view(f"u{a.dtype.itemsize}")
                total += a.nbytes
                with zf.open(name + ".npy", "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, a, allow_pickle=False)
                del a
            meta = {"format": NPZ_FORMAT, "format_version": 1, "step": m.step,
                    "metrics": encode_value(m.metrics), "values": values, "dtypes": dtypes,
                    "structure": structure}
            with zf.open(NPZ_META + ".npy", "w") as f:
                np.lib.format.write_array(f, np.array(json.dumps(meta, allow_nan=False)),
                                          allow_pickle=False)

    atomic_write(path, write)
    return len(arrays), total


def read_npz(path: str, key: str | None) -> tuple[Any, int | None, dict[str, Any]]:
    """``(tree, step or None, metrics)`` of an npz file (pitstop's, or any ``np.savez`` one:
    its member names read as key paths)."""
    if not zipfile.is_zipfile(path):
        raise CorruptCheckpointError(f"{path}: not an .npz file (not a zip archive)",
                                     checkpoint=path)
    try:
        npz = np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise CorruptCheckpointError(f"{path}: not a readable .npz file ({e})",
                                     checkpoint=path) from None
    if not hasattr(npz, "files"):
        raise CorruptCheckpointError(f"{path}: a .npy file, not an .npz archive",
                                     checkpoint=path)
    with npz:
        meta: dict[str, Any] = {}
        try:
            if NPZ_META in npz.files:
                meta = json.loads(str(npz[NPZ_META][()]))
                if not isinstance(meta, dict) or meta.get("format") != NPZ_FORMAT:
                    raise ValueError("its __pitstop__ member is not pitstop's metadata")
            leaves: dict[str, Any] = {}
            dtypes = meta.get("dtypes") or {}
            for name in npz.files:
                if name == NPZ_META:
                    continue
                a = npz[name]
                if name in dtypes:
                    a = a.view(ML_DTYPES[dtypes[name]])
                leaves[name] = a
            for kp, v in (meta.get("values") or {}).items():
                leaves[kp] = decode_value(v)
            metrics = decode_value(meta.get("metrics") or {})
        except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile, EOFError) as e:
            raise CorruptCheckpointError(f"{path}: cannot read this .npz file ({e})",
                                         checkpoint=path) from None
    structure = meta.get("structure")
    tree: Any
    if structure is not None:
        try:
            tree = unflatten(structure, leaves)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise CorruptCheckpointError(f"{path}: its __pitstop__ structure does not match "
                                         f"its arrays ({type(e).__name__}: {e})",
                                         checkpoint=path) from None
    else:
        tree = nested(leaves, path)
    step = meta.get("step")
    return select_key(tree, key, path), step if type(step) is int else None, \
        metrics if isinstance(metrics, dict) else {}


def select_key(tree: Any, key: str | None, where: str) -> Any:
    from pitstop.core.tree import select
    return select(tree, key, where)
