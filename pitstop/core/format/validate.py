"""Reading a manifest back: parse, check the seal, migrate an older major, validate every
field (a manifest is untrusted input: anything pitstop would not have written is refused as
corrupt, naming the checkpoint and the key), or refuse a newer major with "upgrade pitstop".

Readers accept every version up to ``MAJOR``.x, migrate older majors through
:data:`MIGRATIONS`, and refuse newer majors with :class:`UnsupportedFormatError`.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Container
from typing import Any

from pitstop.core.directory.names import Naming
from pitstop.core.errors import CorruptCheckpointError, UnsupportedFormatError
from pitstop.core.format.decoding import (
    PARSE_FRAMES,
    _brief,
    _finite,
    _not_json,
    _unique,
    deeper_than,
    gc_paused,
    load_json,
    on_fresh_stack,
)
from pitstop.core.format.encode import FORMAT
from pitstop.core.format.entries import _entries, _entry, _file_lengths, _object
from pitstop.core.format.schema import _SAME, Manifest, RankView
from pitstop.core.format.seal import _HASH_KEY, check_seal
from pitstop.core.tree.structure import StructureError, check_structure
from pitstop.core.tree.values import decode_value

#: the newest major this pitstop reads (a newer one is refused with "upgrade pitstop")
MAJOR = 4

_VERSION = re.compile(r"^(0|[1-9][0-9]{0,5})\.(0|[1-9][0-9]{0,5})$")

#: major version -> function upgrading a manifest dict of that major to the next one.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {
    1: lambda doc: doc,  # 2.0 only added sharded array entries: a 1.x manifest is a 2.0 one
    2: lambda doc: doc,  # 3.0 only added encryption: a 2.x manifest is a plaintext 3.0 one
    3: lambda doc: doc,  # 4.0 only added references (ref, refs): a 3.x manifest has none
}

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

