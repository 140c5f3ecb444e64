"""The run directory's identity (``.pitstop/directory.json``: its id, naming, encryption) and
what its checkpoints say of it where that file is missing or edited: who may write here,
with which key, under which names.

The identity is what lets retention prove a checkpoint was written here (its manifest
carries the same id); the encryption evidence is read from the checkpoints themselves, as
whoever can write the directory can edit that file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pitstop.core.directory.names import DEFAULT, Naming
from pitstop.core.errors import CheckpointError, InvalidArgumentError
from pitstop.core.format.decoding import load_json
from pitstop.core.storage import Storage

log = logging.getLogger("pitstop")

IDENTITY = "directory.json"
_ID = re.compile(r"^[0-9A-Za-z_-]{1,64}$")


@dataclass(frozen=True)
class Identity:
    """What ``.pitstop/directory.json`` says: the directory's id and how its checkpoints are
    named (:data:`~pitstop.core.directory.names.DEFAULT` where no naming is recorded: older pitstop)."""

    directory_id: str
    naming: Naming
    #: ``{"algorithm", "key_id"}`` of a directory whose checkpoints are encrypted; else None
    encryption: dict[str, Any] | None = None


def read_identity(storage: Storage, *, required: bool) -> Identity | None:
    """The directory's identity; None when it has none yet. A malformed identity file raises
    (``required``: a writer must not guess whose checkpoints these are, nor their names) or
    reads as none."""
    try:
        raw = storage.read_meta(IDENTITY)
    except OSError as e:
        if not required:
            return None
        raise CheckpointError(f"cannot read {storage.location}/.pitstop/{IDENTITY}: {e}") from e
    if raw is None:
        return None
    try:
        doc = load_json(raw)
        ident = doc["directory_id"]
        if not isinstance(ident, str) or not _ID.fullmatch(ident):
            # the id names memory-tier files: nothing but letters, digits, - and _
            raise TypeError(f"directory_id {ident!r} is not 1-64 letters, digits, - or _")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError) as e:
        if not required:
            log.warning("pitstop: %s/.pitstop/%s is malformed (%s); reading without it",
                        storage.location, IDENTITY, e)
            return None
        raise CheckpointError(
            f"{storage.location}/.pitstop/{IDENTITY} is not a pitstop directory identity "
            f"({type(e).__name__}: {e}; it holds {raw[:60]!r}). Remove that file to give the "
            "directory a new identity: retention then leaves the checkpoints already there "
            "alone, since it can no longer prove this directory wrote them.") from None
    enc = doc.get("encryption")
    if enc is not None and not (isinstance(enc, dict) and isinstance(enc.get("key_id"), str)):
        raise CheckpointError(
            f"{storage.location}/.pitstop/{IDENTITY} records a malformed encryption section "
            f"({str(enc)[:60]!r}); write back the key id its checkpoints have "
            "(pitstop inspect shows it)")
    if "naming" not in doc:
        return Identity(ident, DEFAULT, enc)  # written before namings were recorded
    try:
        return Identity(ident, Naming.from_json(doc["naming"]), enc)
    except InvalidArgumentError as e:
        if not required:
            log.warning("pitstop: %s/.pitstop/%s records no valid naming (%s); reading without "
                        "it", storage.location, IDENTITY, e)
            return None
        raise CheckpointError(
            f"{storage.location}/.pitstop/{IDENTITY} records no valid checkpoint naming ({e}). "
            "Write back the naming its checkpoints have, e.g. \"naming\": {\"step_prefix\": "
            "\"step_\", \"step_digits\": 10} for step_0000000042; pitstop will not guess "
            "which entries are its checkpoints.") from None


def create_identity(storage: Storage, naming: Naming = DEFAULT, encryption: Any = None,
                    ident: str | None = None) -> str:
    """Give the directory a new id (or record ``ident`` again), recording how its checkpoints
    are named and, with ``encryption``, that they are encrypted and the key's id; returns the
    id."""
    ident = ident or uuid.uuid4().hex
    doc: dict[str, Any] = {"directory_id": ident, "created_unix": time.time(),
                           "naming": naming.to_json()}
    if encryption is not None:
        doc["encryption"] = {"algorithm": "aes-256-gcm", "key_id": encryption.key_id}
    storage.write_meta(IDENTITY, json.dumps(doc).encode())
    return ident


def identity_of_checkpoints(storage: Storage, naming: Naming) -> Identity | None:
    """For a directory without an identity file (its ``.pitstop/`` was not copied along, or
    was lost): whether its committed checkpoints are encrypted, with which key id, and of
    which directory id (None: no checkpoints). Encrypted when any of them is (a planted
    plaintext newest one does not make the directory plaintext); its id is the one every
    encrypted checkpoint names, and when they name several (a checkpoint of another run
    copied in), no id can be trusted: raises. It proves nothing, so it trusts nothing: it
    refuses writers that would mix kinds, finds the key for a reader and binds the reads
    to the id (``CheckpointReader`` then checks each manifest's seal)."""
    from pitstop.core.storage.local import MANIFEST
    names = sorted((s, n) for n in storage.list_checkpoints()
                   if (s := naming.parse(n)) is not None)
    if not names:
        return None
    found: dict[str, Any] | None = None
    ids: dict[str, str] = {}
    for _, name in reversed(names):
        try:
            doc = load_json(storage.read_bytes(name, MANIFEST))
        except (OSError, ValueError, UnicodeDecodeError, RecursionError):
            continue
        enc = doc.get("encryption") if isinstance(doc, dict) else None
        if isinstance(enc, dict) and isinstance(enc.get("key_id"), str):
            found = found or {"algorithm": str(enc.get("algorithm")), "key_id": enc["key_id"]}
            if isinstance(doc.get("directory_id"), str):
                ids.setdefault(doc["directory_id"], name)
    if len(ids) > 1:
        shown = ", ".join(f"{n} names {i}" for i, n in sorted(ids.items(), key=lambda x: x[1]))
        raise CheckpointError(
            f"{storage.location} has no .pitstop/{IDENTITY}, and its encrypted checkpoints "
            f"name {len(ids)} directory ids ({shown}): some were copied in from another run, "
            "and pitstop cannot tell which are this directory's. Put back the directory's "
            f".pitstop/{IDENTITY}, or move the checkpoints of the other run out")
    return Identity(next(iter(ids), ""), naming, found)


#: an encrypted manifest's last bytes: its encryption section (no nested object) and MAC
#: are the last fields pitstop writes
_TAIL = 4096
_SEALED_TAIL = re.compile(rb'"encryption":(\{[^{}]*\}),"manifest_mac":"[0-9a-f]{1,128}"\}\s*$')


def sealed_sections(storage: Storage, naming: Naming, aside: bool = True,
                    strict: bool = False) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(name, encryption section)`` of each checkpoint in the directory whose manifest is
    encrypted (``aside``: also those moved aside as corrupt or abandoned), read from the
    last few KiB of each manifest, never a whole one. Not authenticated: what it says is
    used only to refuse (a plaintext checkpoint beside it, a replayed one), never to trust.
    ``strict``: a manifest that is there but cannot be read raises its OSError (one vanished
    meanwhile is passed over); otherwise it is passed over too."""
    from pitstop.core.storage.local import MANIFEST
    for name in storage.list_checkpoints():
        if naming.parse(name) is None and not (aside and ".abandoned-" in name or
                                               aside and ".corrupt-" in name):
            continue
        try:
            n = storage.size(name, MANIFEST)
            tail = bytearray(min(n, _TAIL))
            got = storage.read_into(name, MANIFEST, n - len(tail), tail)
            m = _SEALED_TAIL.search(bytes(tail[:got]))
            section = load_json(m.group(1)) if m is not None else None
        except FileNotFoundError:
            continue
        except OSError:
            if strict:
                raise
            continue
        except (ValueError, RecursionError, UnicodeDecodeError):
            continue
        if isinstance(section, dict) and isinstance(section.get("key_id"), str):
            yield name, section


def encrypted_evidence(storage: Storage, naming: Naming) -> dict[str, Any] | None:
    """``{"algorithm", "key_id"}`` when any checkpoint in the directory (committed, or moved
    aside as corrupt or abandoned) has an encrypted manifest; None when none has.

    Whether a directory is encrypted must not rest on ``.pitstop/directory.json`` alone,
    which whoever can write the directory can edit or remove: with a key at hand, a manager
    asks this when the identity records no encryption. An encrypted checkpoint cannot be
    made without the key, and pitstop never mixes kinds in a directory, so one is proof
    enough that a plaintext one beside it was planted."""
    for _name, section in sealed_sections(storage, naming):
        return {"algorithm": "aes-256-gcm", "key_id": section["key_id"]}
    return None


def last_seq(storage: Storage, naming: Naming) -> int:
    """The highest ``seq`` an encrypted checkpoint of the directory records (also one moved
    aside: a rollback's abandoned checkpoints were saved before the next save); 0: none.

    A manifest it cannot read is no manifest it may pass over: the next save's seq would
    then be below that checkpoint's, and that save refused as a replay once the manifest
    can be read again (a hard-link backup removed, a storage error gone)."""
    try:
        seqs = [sec["seq"] for _n, sec in sealed_sections(storage, naming, strict=True)
                if type(sec.get("seq")) is int]
    except OSError as e:
        raise CheckpointError(
            f"checkpoint directory {storage.location}: a checkpoint's manifest cannot be read "
            f"({e}), so pitstop cannot tell where the next encrypted save comes in the "
            "directory's order of saves (seq); a save numbered too low would later be refused "
            "as a replay. Make the manifest readable (break a hard link by removing the linked "
            "copy, or retry after a storage error) and open the directory again") from e
    return max(seqs, default=0)


def directory_kind(storage: Storage, naming: Naming, identity: Identity | None,
                   keyed: bool) -> Identity | None:
    """What a manager takes the directory to be: its identity, or (without one) what its
    checkpoints say; with a key at hand (``keyed``), a directory that looks plaintext but
    holds an encrypted checkpoint is encrypted (:func:`encrypted_evidence`): its identity
    was edited, or a plaintext checkpoint planted as the newest one."""
    kind = identity or identity_of_checkpoints(storage, naming)
    if keyed and kind is not None and kind.encryption is None:
        found = encrypted_evidence(storage, naming)
        if found is not None:
            log.warning("pitstop: %s holds encrypted checkpoints (key id %s), but %s: it is "
                        "read as an encrypted directory, and a plaintext checkpoint in it is "
                        "not trusted", storage.location, found["key_id"],
                        "its identity records no encryption" if identity is not None else
                        "its newest checkpoint is plaintext")
            kind = dataclasses.replace(kind, encryption=found)
    return kind


def check_encryption(location: str, identity: Identity | None, encryption: Any,
                     has_checkpoints: bool, writing: bool = True) -> bool:
    """Whether a manager with ``encryption`` (or None) may use this directory; True when its
    identity must now record encryption (a plaintext directory without checkpoints). A
    writer never mixes plaintext and encrypted checkpoints, nor two keys, in one directory."""
    from pitstop.core.errors import EncryptionKeyError
    recorded = identity.encryption if identity is not None else None
    if recorded is not None and encryption is None:
        raise EncryptionKeyError(
            f"checkpoint directory {location} is encrypted (key id {recorded['key_id'][:32]}); "
            "set PITSTOP_ENCRYPTION_KEY to its key and pass "
            "encryption=pitstop.Encryption()" + (
                ", or use another directory. pitstop never writes plaintext checkpoints "
                "into an encrypted directory" if writing else " to read it"))
    if recorded is not None and recorded["key_id"] != encryption.key_id:
        raise EncryptionKeyError(
            f"checkpoint directory {location} is encrypted with key id "
            f"{recorded['key_id'][:32]}, the key given has id {encryption.key_id}: not its key. "
            "Give the directory's key (key rotation: see docs/encryption.md)")
    if recorded is None and encryption is not None and identity is not None:
        if has_checkpoints and not writing:
            # a key would refuse each of them as unauthenticated: "corrupt", which they are not
            raise EncryptionKeyError(
                f"checkpoint directory {location} is not encrypted (its checkpoints are "
                "plaintext), but encryption= was given; open it without encryption= to read "
                "them")
        if has_checkpoints:
            raise EncryptionKeyError(
                f"checkpoint directory {location} holds unencrypted checkpoints; pitstop does "
                "not mix them with encrypted ones. Use a new directory for encrypted "
                "checkpoints (docs/encryption.md says how to re-encrypt old ones)")
        return True
    return False


def resolve_naming(location: str, recorded: Naming | None, step_prefix: str | None,
                   step_digits: int | None) -> Naming:
    """The naming a manager uses: what the directory recorded, with the arguments given
    (None adopts the recorded part); a naming that differs from the recorded one raises."""
    base = recorded or DEFAULT
    asked = Naming(base.prefix if step_prefix is None else step_prefix,
                   base.digits if step_digits is None else step_digits)
    if recorded is not None and asked != recorded:
        raise InvalidArgumentError(
            f"checkpoint directory {location} names its checkpoints {recorded.describe()} "
            f"(step_prefix={recorded.prefix!r}, step_digits={recorded.digits}, recorded in "
            f".pitstop/{IDENTITY} when it was created), but this manager asks for "
            f"{asked.describe()} (step_prefix={asked.prefix!r}, step_digits={asked.digits}). A "
            "directory keeps one naming: leave step_prefix and step_digits out (or pass the "
            "recorded ones) to use it, or give a new directory for the other naming.")
    return asked


__all__ = ["IDENTITY", "Identity", "read_identity", "create_identity", "identity_of_checkpoints",
           "sealed_sections", "encrypted_evidence", "last_seq", "directory_kind",
           "check_encryption", "resolve_naming"]
