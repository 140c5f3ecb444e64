"""Array dtypes on disk: numpy's own descriptors, plus names for ml_dtypes' types.

A dtype is stored as numpy's array-interface string (``"<f4"``, ``"|b1"``, ``"<U8"``,
``"<M8[s]"``), as a list for structured dtypes (``np.lib.format.dtype_to_descr``), or as a
plain name for the ml_dtypes types numpy cannot describe (``"bfloat16"``,
``"float8_e4m3fn"``, ...). Always little-endian.
"""

from __future__ import annotations

import functools
from typing import Any

import ml_dtypes
import numpy as np

from pitstop.core.errors import UnsupportedStateError

_ML_NAMES = [
    "bfloat16", "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn",
    "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float6_e2m3fn",
    "float6_e3m2fn", "float4_e2m1fn", "int2", "int4", "uint2", "uint4",
]
ML_DTYPES: dict[str, np.dtype] = {
    n: np.dtype(getattr(ml_dtypes, n)) for n in _ML_NAMES if hasattr(ml_dtypes, n)
}
_ML_BY_DTYPE = {v: k for k, v in ML_DTYPES.items()}
#: the ml_dtypes floating types (numpy reports their kind as "V")
ML_FLOATS = frozenset(v for k, v in ML_DTYPES.items() if "float" in k)


def is_inexact(dtype: np.dtype) -> bool:
    """True for dtypes that can hold NaN or Inf: numpy floats and complexes, and the
    ml_dtypes floats (bfloat16, float8, ...)."""
    return dtype.kind in "fc" or dtype in ML_FLOATS


def check_savable_dtype(dtype: np.dtype) -> None:
    if dtype.hasobject:
        raise UnsupportedStateError(
            f"arrays of dtype {dtype} hold Python objects, which cannot be saved without pickle; "
            "convert them to a numeric or string dtype"
        )


def encode_dtype(dtype: np.dtype) -> Any:
    """The on-disk descriptor of ``dtype`` (little-endian)."""
    name = _ML_BY_DTYPE.get(dtype)
    if name is not None:
        return name
    check_savable_dtype(dtype)
    if dtype.byteorder == ">":
        dtype = dtype.newbyteorder("<")
    if dtype.fields is not None or dtype.subdtype is not None:
        return np.lib.format.dtype_to_descr(dtype)
    return dtype.str


def decode_dtype(descr: Any) -> np.dtype:
    """Inverse of :func:`encode_dtype`; raises ValueError for what it does not know."""
    if isinstance(descr, str):
        return _decode_str(descr)
    return _decode(descr)


@functools.lru_cache(maxsize=1024)
def _decode_str(descr: str) -> np.dtype:
    return _decode(descr)


def _decode(descr: Any) -> np.dtype:
    if isinstance(descr, str) and descr in ML_DTYPES:
        return ML_DTYPES[descr]
    if isinstance(descr, list):
        dt = np.lib.format.descr_to_dtype([tuple(d) if isinstance(d, list) else d for d in descr])
    else:
        dt = np.dtype(descr)
    if dt.hasobject:
        raise ValueError(f"dtype {descr!r} holds Python objects")
    if dt.itemsize == 0 and dt.kind in "SU":
        # numpy makes an array of "S0" / "U0" as "S1" / "U1" (no real array has them): one
        # declared of 0 bytes would come back with bytes never read, of memory never cleared
        raise ValueError(f"dtype {descr!r} has no size (numpy makes arrays of it as "
                         f"{np.empty(0, dt).dtype.str})")
    return dt
