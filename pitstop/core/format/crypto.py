"""Optional encryption at rest: AES-256-GCM per data segment, an HMAC-sealed manifest.

One 256-bit key (from an environment variable or a callback) is never used directly: HKDF-SHA256
derives from it a data key, a manifest MAC key and a short public key id. Each array's stored
bytes (compressed first when compression is on) are cut into segments of ``segment_bytes``;
each segment is stored as ``nonce (12) || ciphertext || tag (16)``, with a fresh random 96-bit
nonce and associated data that binds it to its checkpoint (directory id, step, a random save
id), its data file, its offset there, its number and whether it is the last one: segments
cannot be swapped, reordered, moved between arrays, files or checkpoints, or dropped from the
end unnoticed. ``docs/encryption.md`` explains the scheme; ``docs/format.md`` the layout.

The key material lives only in this module's objects: never in a manifest, a log line, an
exception message or ``repr()``, and an :class:`Encryption` refuses to be pickled.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import os
import re
import secrets
from collections.abc import Callable
from typing import Any

import numpy as np

from pitstop.core.errors import (
    CheckpointError,
    CorruptCheckpointError,
    EncryptionKeyError,
    InvalidArgumentError,
)

ALGORITHM = "aes-256-gcm"
#: appended to a compression codec's name (``zstd+aes-256-gcm``); alone when uncompressed
SUFFIX = "+" + ALGORITHM
ENV = "PITSTOP_ENCRYPTION_KEY"
SEGMENT = 4 << 20
NONCE = 12
TAG = 16
OVERHEAD = NONCE + TAG
_MAC_KEY = b',"manifest_mac":"'
_INSTALL = "pip install 'pitstop[crypto]'"
_MAKE_KEY = "python -c 'import secrets; print(secrets.token_hex(32))'"


def _aead() -> Any:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise CheckpointError(
            f"encryption at rest needs the 'cryptography' package: {_INSTALL}") from None
    return AESGCM


def _hkdf(key: bytes, info: bytes, length: int = 32) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=b"pitstop",
                info=b"pitstop/1 " + info).derive(key)


def _parse_text(text: str, env: str) -> bytes:
    """A key written as 64 hex digits or as the base64 of 32 bytes."""
    text = text.strip()
    if re.fullmatch(r"[0-9A-Fa-f]{64}", text):
        return bytes.fromhex(text)
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) == 32:
        return raw
    size = len(text)
    text, raw = "", b""  # (a traceback that shows its frames' locals must not show them)
    raise InvalidArgumentError(
        f"the environment variable {env} does not hold a 256-bit key ({size} characters "
        f"that are neither 64 hex digits nor the base64 of 32 bytes). Make a key with {_MAKE_KEY} "
        "and keep it in a secret store; pitstop never writes it anywhere")


class Encryption:
    """AES-256-GCM encryption at rest for a :class:`~pitstop.CheckpointManager`.

    ``key``: a callable returning the 32-byte key (from a secret store, say); without it the
    key is read from the environment variable ``env`` (64 hex digits, or base64 of 32 bytes).
    The key is read once, here; only keys derived from it are kept, and never shown.
    """

    __slots__ = ("env", "key_id", "_data", "_mac", "_source")

    def __init__(self, key: Callable[[], bytes] | None = None, *, env: str = ENV) -> None:
        if not isinstance(env, str) or not env:
            raise InvalidArgumentError(f"env must be the name of an environment variable, got "
                                       f"{type(env).__name__}")
        if key is not None and not callable(key):
            raise InvalidArgumentError(
                f"key must be a callable returning the 32-byte key (got a {type(key).__name__}); "
                "a callable keeps the key out of argument lists and tracebacks")
        aead = _aead()
        self.env = env
        if key is not None:
            self._source = "callback"
            try:
                raw = key()
            except Exception as e:  # noqa: BLE001 - its text may hold anything: not shown
                raise InvalidArgumentError(
                    f"the encryption key callback raised {type(e).__name__}; no key, so "
                    "nothing is read or written") from None
            if not isinstance(raw, (bytes, bytearray, memoryview)) or len(bytes(raw)) != 32:
                size = len(bytes(raw)) if isinstance(raw, (bytes, bytearray, memoryview)) \
                    else None
                kind = type(raw).__name__
                raw = b""  # (a traceback that shows its frames' locals must not show it)
                raise InvalidArgumentError(
                    "the encryption key callback must return 32 bytes (a 256-bit key), it "
                    f"returned {kind}" + (f" of {size} bytes" if size is not None else ""))
            master = bytes(raw)
        else:
            self._source = f"${env}"
            text = os.environ.get(env)
            if text is None or not text.strip():
                raise InvalidArgumentError(
                    f"encryption was asked for, but the environment variable {env} is not set. "
                    f"Set it to a 256-bit key (64 hex digits; make one with {_MAKE_KEY}), or "
                    "pass encryption=pitstop.Encryption(key=callable_returning_32_bytes)")
            try:
                master = _parse_text(text, env)
            finally:
                text = None  # (not in this frame's locals if that raised)
        self._data = aead(_hkdf(master, b"data"))
        self._mac = _hkdf(master, b"manifest-mac")
        self.key_id = _hkdf(master, b"key-id", 8).hex()
        del master

    def __repr__(self) -> str:
        # (getattr: one that failed to be made, shown by a traceback with its locals)
        return (f"Encryption(algorithm={ALGORITHM!r}, key_id={getattr(self, 'key_id', None)!r}, "
                f"key from {getattr(self, '_source', None)})")

    def __reduce__(self) -> Any:
        raise TypeError("a pitstop.Encryption holds key material and is never pickled; make "
                        "one in each process (the key from the same environment variable)")

    # ------------------------------------------------------------------ manifest
    def record(self, save_id: str, seq: int | None = None) -> dict[str, Any]:
        """The manifest's ``encryption`` section for one save (no key material); ``seq``:
        the save's place in its directory's order of saves (see ``docs/encryption.md``)."""
        rec: dict[str, Any] = {"algorithm": ALGORITHM, "kdf": "hkdf-sha256",
                               "key_id": self.key_id, "segment_bytes": SEGMENT,
                               "nonce": "random-96", "mac": "hmac-sha256", "save_id": save_id}
        if seq is not None:
            rec["seq"] = seq
        return rec

    def seal(self, body: bytes) -> bytes:
        """Append ``"manifest_mac"``: HMAC-SHA256 of the manifest's bytes without it."""
        mac = hmac.new(self._mac, body, hashlib.sha256).hexdigest()
        return body[:-1] + _MAC_KEY + mac.encode() + b'"}'

    def cipher(self, record: dict[str, Any], directory_id: str | None, step: int) -> SaveCipher:
        """The segment cipher of one checkpoint (``record``: its manifest's section)."""
        return SaveCipher(self._data, int(record["segment_bytes"]), json.dumps(
            [directory_id, step, record["save_id"]], separators=(",", ":")).encode())

    def new_save(self, directory_id: str, step: int, save_id: str | None = None,
                 seq: int | None = None) -> tuple[dict[str, Any], SaveCipher]:
        """A new save's record and cipher (``save_id``: rank 0's, in a multi-rank save)."""
        record = self.record(save_id or secrets.token_hex(16), seq)
        return record, self.cipher(record, directory_id, step)


def check_sealed(data: bytes, doc: dict[str, Any], where: str,
                 encryption: Encryption | None) -> None:
    """Check an encrypted manifest: a key is given, it is the writer's, and the HMAC holds."""
    rec = doc.get("encryption")
    if not isinstance(rec, dict) or rec.get("algorithm") != ALGORITHM:
        raise CorruptCheckpointError(
            f"{where}: its manifest's encryption section is missing or names an unknown "
            "algorithm", checkpoint=where, file="manifest.json")
    if encryption is None:
        raise EncryptionKeyError(
            f"checkpoint {where} is encrypted (key id {str(rec.get('key_id'))[:32]}); set "
            f"{ENV} to its key or pass encryption=pitstop.Encryption(...)")
    if rec.get("key_id") != encryption.key_id:
        raise EncryptionKeyError(
            f"checkpoint {where} was written with key id {str(rec.get('key_id'))[:32]}, the "
            f"key given has id {encryption.key_id}: not its key (nothing was read). Give the "
            "key it was written with")
    mac = doc.get("manifest_mac")
    suffix = _MAC_KEY + str(mac).encode() + b'"}'
    if not isinstance(mac, str) or not data.endswith(suffix) or not hmac.compare_digest(
            hmac.new(encryption._mac, data[: -len(suffix)] + b"}", hashlib.sha256).hexdigest(),
            mac):
        raise CorruptCheckpointError(
            f"{where}: manifest authentication failed (manifest.json changed after it was "
            "committed)", checkpoint=where, file="manifest.json")
    seg = rec.get("segment_bytes")
    if "seq" in rec and (type(rec["seq"]) is not int or rec["seq"] < 0):
        raise CorruptCheckpointError(f"{where}: malformed encryption section (seq)",
                                     checkpoint=where, file="manifest.json")
    if type(seg) is not int or not 1 <= seg <= 1 << 30 or not isinstance(rec.get("save_id"), str):
        raise CorruptCheckpointError(f"{where}: malformed encryption section",
                                     checkpoint=where, file="manifest.json")


def codec_of(base: str) -> str:
    """The stored codec of an encrypted array whose bytes are first encoded with ``base``."""
    return ALGORITHM if base == "none" else base + SUFFIX


def split(codec: str) -> tuple[str, bool]:
    """``(compression codec, encrypted)`` of a stored codec name."""
    if codec == ALGORITHM:
        return "none", True
    if codec.endswith(SUFFIX):
        return codec[: -len(SUFFIX)], True
    return codec, False


def stored_length(n: int, segment: int = SEGMENT) -> int:
    """Stored bytes of ``n`` plaintext bytes (one empty segment for an empty array)."""
    return n + max(1, math.ceil(n / segment)) * OVERHEAD


class Sink:
    """Stored segments gathered in one page-aligned buffer of a data file's writer and
    written in whole pages, so an encrypted file goes out with O_DIRECT like a raw one (no
    page-cache copy); memory: this one buffer, whatever the arrays' sizes."""

    ALIGN = 4096

    def __init__(self, writer: Any, largest: int) -> None:
        """``largest``: the most bytes one :meth:`reserve` asks for (one stored segment)."""
        self.w = writer
        size = -(-(largest + self.ALIGN) // self.ALIGN) * self.ALIGN
        raw = np.empty(size + self.ALIGN, np.uint8)
        start = -raw.ctypes.data % self.ALIGN
        self.buf = raw[start:start + size]
        self.fill = 0

    def reserve(self, n: int) -> np.ndarray:
        """The next ``n`` bytes of the file, to be filled by the caller."""
        if self.fill + n > self.buf.size:
            self._flush()
        view = self.buf[self.fill:self.fill + n]
        self.fill += n
        return view

    def _flush(self) -> None:
        keep = self.fill % self.ALIGN if getattr(self.w, "direct", False) else 0
        cut = self.fill - keep
        self.w.write(self.buf[:cut])
        self.buf[:keep] = self.buf[cut:self.fill]
        self.fill = keep

    def close(self) -> int:
        """Write what is left (zero-padded to a whole page under O_DIRECT); returns the
        padding's length, which the file's recorded length includes."""
        end = self.fill
        if getattr(self.w, "direct", False):
            end = -(-end // self.ALIGN) * self.ALIGN
            self.buf[self.fill:end] = 0
        if end:
            self.w.write(self.buf[:end])
        pad, self.fill = end - self.fill, 0
        return pad


class SaveCipher:
    """Encrypts and decrypts the segments of one checkpoint's arrays."""

    __slots__ = ("aead", "segment", "context")

    def __init__(self, aead: Any, segment: int, context: bytes) -> None:
        self.aead, self.segment, self.context = aead, segment, context

    def _aad(self, file: str, offset: int, seg: int, last: bool) -> bytes:
        return b"pitstop/1\0%s\0%s\0%d\0%d\0%d" % (self.context, file.encode(), offset, seg,
                                                    last)

    def encrypt(self, payload: Any, file: str, offset: int,
                reserve: Callable[[int], np.ndarray], hasher: Any) -> int:
        """Encrypt ``payload`` (an array stored at ``offset`` of ``file``) segment by segment,
        each straight into the next ``reserve(n)`` bytes of the file's output buffer
        (:class:`Sink`), and hash the stored bytes; returns the stored length."""
        view = memoryview(payload).cast("B")
        n, s = len(view), self.segment
        count = max(1, math.ceil(n / s))
        for i in range(count):
            part = view[i * s:(i + 1) * s]
            out = reserve(NONCE + len(part) + TAG)
            nonce = secrets.token_bytes(NONCE)
            out[:NONCE] = np.frombuffer(nonce, np.uint8)
            self.aead.encrypt_into(nonce, part, self._aad(file, offset, i, i == count - 1),
                                   out[NONCE:])
            hasher.update(out)
        return n + count * OVERHEAD

    def plain_length(self, stored: int) -> int | None:
        """Plaintext bytes of ``stored`` stored bytes; None when no run of segments is that
        long."""
        full = self.segment + OVERHEAD
        count = max(1, math.ceil(stored / full))
        last = stored - (count - 1) * full
        return None if last < OVERHEAD else stored - count * OVERHEAD

    def decrypt(self, file: str, offset: int, stored: int,
                read: Callable[[int, np.ndarray], None], out: np.ndarray, hasher: Any) -> None:
        """Decrypt the ``stored`` bytes at ``offset`` of ``file`` into ``out`` (uint8, its
        plaintext length), one segment at a time; ``read(pos, buf)`` fills ``buf`` from
        ``pos``. Raises ``ValueError`` naming the segment that does not authenticate."""
        from cryptography.exceptions import InvalidTag
        full = self.segment + OVERHEAD
        count = max(1, math.ceil(stored / full))
        scratch = np.empty(min(stored, full), np.uint8)
        pos = 0
        for i in range(count):
            size = min(full, stored - i * full)
            buf = scratch[:size]
            read(offset + i * full, buf)
            hasher.update(buf)
            nonce = bytes(buf[:NONCE])
            try:
                self.aead.decrypt_into(nonce, buf[NONCE:], self._aad(file, offset, i,
                                                                     i == count - 1),
                                       out[pos:pos + size - OVERHEAD])
            except InvalidTag:
                raise ValueError(
                    f"segment {i + 1} of {count} does not authenticate (its bytes were changed, "
                    "moved from another array, file or checkpoint, or written with another "
                    "key)") from None
            pos += size - OVERHEAD


__all__ = ["Encryption", "EncryptionKeyError", "ALGORITHM", "ENV"]
