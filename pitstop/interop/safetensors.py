"""Reading ``.safetensors`` files with numpy alone (``pitstop import``): tensor names split at
``/`` into nested dicts, and the step and values that ``export_safetensors``
(:mod:`pitstop.interop.torch_save`, which writes them through torch) put in the file's
``pitstop`` metadata."""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import numpy as np

from pitstop.core.errors import CorruptCheckpointError
from pitstop.core.format.dtypes import ML_DTYPES
from pitstop.core.tree import decode_value, join
from pitstop.interop.npz import nested, select_key

_ST_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4",
              "I16": "<i2", "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1",
              "BOOL": "?", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
              "F8_E5M2": "float8_e5m2", "C64": "<c8", "F8_E4M3FNUZ": "float8_e4m3fnuz",
              "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu"}


def read_safetensors(path: str, key: str | None) -> tuple[Any, int | None, dict[str, Any]]:
    """``(tree, step or None, metrics)`` of a .safetensors file, read with numpy alone:
    tensor names split at ``/`` into nested dicts; the values and step that
    ``pitstop export --to safetensors`` put in its ``pitstop`` metadata come back."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 << 20):
                raise ValueError("its header length is past the end of the file")
            header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError("its header is not a JSON object")
            base = 8 + n
            leaves: dict[str, Any] = {}
            meta = header.pop("__metadata__", None) or {}
            for name, info in header.items():
                descr = _ST_DTYPES.get(info.get("dtype"))
                if descr is None:
                    raise ValueError(f"tensor {name!r} has dtype {info.get('dtype')!r}, "
                                     "which numpy cannot hold")
                dt = ML_DTYPES[descr] if descr in ML_DTYPES else np.dtype(descr)
                shape = [int(d) for d in info["shape"]]
                start, stop = (int(x) for x in info["data_offsets"])
                count = int(np.prod(shape, dtype=np.int64))
                if not 0 <= start <= stop <= size - base or stop - start != count * dt.itemsize:
                    raise ValueError(f"tensor {name!r} lies outside the file")
                f.seek(base + start)
                a = np.fromfile(f, dtype=dt, count=count) if count else np.empty(0, dt)
                if a.size != count:
                    raise ValueError(f"tensor {name!r} is cut short")
                comps = name.split("/")
                leaves["/".join(join("", c) for c in comps)] = a.reshape(shape)
    except FileNotFoundError:
        raise
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise CorruptCheckpointError(f"{path}: not a readable .safetensors file ({e})",
                                     checkpoint=path) from None
    step = None
    metrics: dict[str, Any] = {}
    if isinstance(meta, dict) and isinstance(meta.get("pitstop"), str):
        try:
            doc = json.loads(meta["pitstop"])
            for name, kp in (doc.get("keys") or {}).items():
                plain = "/".join(join("", c) for c in name.split("/"))
                if plain in leaves and isinstance(kp, str):
                    leaves[kp] = leaves.pop(plain)
            for kp, v in (doc.get("values") or {}).items():
                leaves[kp] = decode_value(v)
            step = doc.get("step") if type(doc.get("step")) is int else None
        except (ValueError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(f"{path}: its pitstop metadata is malformed ({e})",
                                         checkpoint=path) from None
    return select_key(nested(leaves, path), key, path), step, metrics
