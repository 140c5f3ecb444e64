"""The seal of a plaintext manifest: ``manifest_hash``, the hash of its bytes without that
field, appended last (an encrypted manifest is sealed with an HMAC instead, see
:mod:`pitstop.core.format.crypto`).
"""

from __future__ import annotations

from typing import Any

from pitstop.core.errors import CorruptCheckpointError

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

