"""Array dtypes on disk: numpy's own descriptors, plus names for ml_dtypes' types.

A dtype is stored as numpy's array-interface string (``"<f4"``, ``"|b1"``, ``"<U8"``,
``"<M8[s]"``), as a list for structured dtypes (``np.lib.format.dtype_to_descr``), or as a
plain name for the ml_dtypes types numpy cannot describe (``"bfloat16"``,
``"float8_e4m3fn"``, ...). Always little-endian.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from pitstop.core.errors import UnsupportedStateError

_ML_NAMES = [
    "bfloat16", "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn",
    "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float6_e2m3fn",
    "float6_e3m2fn", "float4_e2m1fn", "int2", "int4", "uint2", "uint4",
]
_ML_NAME_SET = frozenset(_ML_NAMES)


class _MLTypes(Mapping[str, np.dtype]):
    """ml_dtypes' types by name, imported at the first use: importing ml_dtypes takes about
    a second, which every process (a ``pitstop`` command, a torch job) paid on
    ``import pitstop`` though most never hold one of its arrays. An array of one of these
    types cannot exist before ml_dtypes is imported, so lookups by dtype need no import."""

    def __init__(self) -> None:
        self._table: dict[str, np.dtype] | None = None
        self._by_dtype: dict[np.dtype, str] = {}
        self.floats: frozenset[np.dtype] = frozenset()

    def _load(self) -> dict[str, np.dtype]:
        if self._table is None:
            import ml_dtypes

            table = {n: np.dtype(getattr(ml_dtypes, n)) for n in _ML_NAMES
                     if hasattr(ml_dtypes, n)}
            self._by_dtype = {v: k for k, v in table.items()}
            self.floats = frozenset(v for k, v in table.items() if "float" in k)
            self._table = table
        return self._table

    def __getitem__(self, name: str) -> np.dtype:
        return self._load()[name]

    def __contains__(self, name: object) -> bool:
        return name in _ML_NAME_SET and name in self._load()

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())

    def name_of(self, dtype: np.dtype) -> str | None:
        """The name of ``dtype`` when it is an ml_dtypes type, else None."""
        if "ml_dtypes" not in sys.modules:
            return None
        self._load()
        return self._by_dtype.get(dtype)

    def is_float(self, dtype: np.dtype) -> bool:
        """True for the ml_dtypes floating types (numpy reports their kind as "V")."""
        return self.name_of(dtype) is not None and dtype in self.floats


#: name -> numpy dtype of the ml_dtypes types (bfloat16, float8, int4, ...), loaded lazily
ML_DTYPES = _MLTypes()


def is_inexact(dtype: np.dtype) -> bool:
    """True for dtypes that can hold NaN or Inf: numpy floats and complexes, and the
    ml_dtypes floats (bfloat16, float8, ...)."""
    return dtype.kind in "fc" or ML_DTYPES.is_float(dtype)


def check_savable_dtype(dtype: np.dtype) -> None:
    if dtype.hasobject:
        raise UnsupportedStateError(
            f"arrays of dtype {dtype} hold Python objects, which cannot be saved without pickle; "
            "convert them to a numeric or string dtype"
        )


def encode_dtype(dtype: np.dtype) -> Any:
    """The on-disk descriptor of ``dtype`` (little-endian)."""
    name = ML_DTYPES.name_of(dtype)
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
