"""Encodings applied to an array's bytes before hashing and writing: none | zstd (+ shuffle).

A codec is named in the manifest per array (``"none"``, ``"zstd"``, ``"zstd+shuffle4"``),
so readers need nothing but the manifest to decode. Byte-shuffle groups the k-th byte of
every element together, which makes float tensors compress far better.
"""

from __future__ import annotations

import numpy as np
import zstandard


def _shuffle(data: np.ndarray, itemsize: int) -> np.ndarray:
    flat = data.reshape(-1).view(np.uint8)
    if itemsize <= 1 or flat.size % itemsize:
        return flat
    return np.ascontiguousarray(flat.reshape(-1, itemsize).T).reshape(-1)


def _unshuffle(data: np.ndarray, itemsize: int) -> np.ndarray:
    if itemsize <= 1 or data.size % itemsize:
        return data
    return np.ascontiguousarray(data.reshape(itemsize, -1).T).reshape(-1)


def codec_name(compression: str | None, itemsize: int) -> str:
    """The codec to use for an array of ``itemsize`` under the manager's ``compression``."""
    if compression in (None, "none"):
        return "none"
    if compression == "zstd":
        return "zstd"
    if compression == "zstd+shuffle":
        return f"zstd+shuffle{itemsize}" if itemsize > 1 else "zstd"
    raise ValueError(f"unknown compression {compression!r}; use None, 'zstd' or 'zstd+shuffle'")


#: zstd's fastest standard level: on float tensors after the byte shuffle it compresses a
#: little better than level 3 at ~1.7x its speed (fp32 Adam state: ~1.19x at ~0.9 GB/s per core)
LEVEL = 1
#: arrays at least this big are compressed on every core (zstd's own worker threads, one
#: frame: readers see no difference); smaller ones are parallel across data files already
THREADED_MIN = 32 << 20


def encode(codec: str, data: np.ndarray, level: int = LEVEL) -> memoryview | np.ndarray:
    """Encode the raw bytes of ``data`` (a C-contiguous uint8 view)."""
    if codec == "none":
        return data
    raw = data
    if codec.startswith("zstd+shuffle"):
        raw = _shuffle(data, int(codec.removeprefix("zstd+shuffle")))
    threads = -1 if raw.nbytes >= THREADED_MIN else 0  # -1: as many as there are cores
    return memoryview(zstandard.ZstdCompressor(level=level, threads=threads).compress(raw.data))


def decode_into(codec: str, payload: bytes | memoryview, out: np.ndarray) -> None:
    """Decode ``payload`` into ``out`` (a C-contiguous uint8 view of the right size)."""
    if codec == "none":
        out[...] = np.frombuffer(payload, np.uint8)
        return
    raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=out.size)
    if len(raw) != out.size:
        raise ValueError(f"decompressed {len(raw)} bytes, expected {out.size}")
    arr = np.frombuffer(raw, np.uint8)
    if codec.startswith("zstd+shuffle"):
        arr = _unshuffle(arr, int(codec.removeprefix("zstd+shuffle")))
    out[...] = arr
