"""The whitelist of dtypes that may cross the wire, by fixed numeric code.

A decoder never builds a dtype from a string it received: it maps a one-byte
code through these tables. Codes 0-15 are NumPy's little-endian (or byte-order
free) numeric types, 16-31 the same types big-endian, 64+ the ``ml_dtypes``
types (little-endian, as ml_dtypes only exists natively on little-endian
hosts). Torch uses the same codes for the same element formats.
"""

from __future__ import annotations

import sys
from typing import Final

import numpy as np

from ._format import UnsupportedValueError

#: code -> NumPy dtype string; the strings are our own constants, never input.
_NUMPY_CODES: Final[dict[int, str]] = {
    0: "|b1",
    1: "|i1",
    2: "|u1",
    3: "<i2",
    4: "<u2",
    5: "<i4",
    6: "<u4",
    7: "<i8",
    8: "<u8",
    9: "<f2",
    10: "<f4",
    11: "<f8",
    12: "<c8",
    13: "<c16",
    19: ">i2",
    20: ">u2",
    21: ">i4",
    22: ">u4",
    23: ">i8",
    24: ">u8",
    25: ">f2",
    26: ">f4",
    27: ">f8",
    28: ">c8",
    29: ">c16",
}

#: code -> attribute name in the ml_dtypes module (looked up only if present).
ML_DTYPES_CODES: Final[dict[int, str]] = {
    64: "bfloat16",
    65: "float8_e4m3fn",
    66: "float8_e5m2",
    67: "float8_e4m3fnuz",
    68: "float8_e5m2fnuz",
    69: "float8_e4m3b11fnuz",
    70: "float8_e3m4",
    71: "float8_e4m3",
    72: "float8_e8m0fnu",
    73: "float6_e2m3fn",
    74: "float6_e3m2fn",
    75: "float4_e2m1fn",
    76: "int4",
    77: "uint4",
    78: "int2",
    79: "uint2",
}

#: code -> dtype, for decoding. 256 slots so a u8 code is a plain index.
CODE_TO_DTYPE: Final[list[np.dtype[np.generic] | None]] = [None] * 256
#: dtype -> code, for encoding (dtype equality includes the byte order).
DTYPE_TO_CODE: Final[dict[np.dtype[np.generic], int]] = {}

for _code, _name in _NUMPY_CODES.items():
    _dt = np.dtype(_name)
    CODE_TO_DTYPE[_code] = _dt
    DTYPE_TO_CODE[_dt] = _code

_ml_loaded = False


def _load_ml_dtypes(*, importing: bool) -> bool:
    """Add the ml_dtypes types to both tables; True if ml_dtypes is available.

    The encoder calls this only when it met an array whose dtype is not in the
    table and ml_dtypes is already in ``sys.modules`` (so it imports nothing);
    the decoder may import it (``importing=True``) when a header names such a
    code. Little-endian hosts only: the codes mean little-endian layouts.
    """
    global _ml_loaded  # a cache, filled once
    if _ml_loaded:
        return True
    if not importing and "ml_dtypes" not in sys.modules:
        return False
    if sys.byteorder != "little":
        return False
    try:
        import ml_dtypes
    except ImportError:
        return False
    for code, name in ML_DTYPES_CODES.items():
        scalar_type = getattr(ml_dtypes, name, None)
        if scalar_type is None:  # older ml_dtypes: type does not exist yet
            continue
        dt = np.dtype(scalar_type)
        CODE_TO_DTYPE[code] = dt
        DTYPE_TO_CODE[dt] = code
    _ml_loaded = True
    return True


def code_for(dtype: np.dtype[np.generic]) -> int:
    """Return the wire code of ``dtype`` (slow path of a table miss).

    Raises:
        UnsupportedValueError: the dtype is not in the whitelist (object,
            structured, string, datetime, long double, ...).
    """
    code = DTYPE_TO_CODE.get(dtype)
    if code is not None:
        return code
    if _load_ml_dtypes(importing=False):
        code = DTYPE_TO_CODE.get(dtype)
        if code is not None:
            return code
    if dtype.hasobject:
        why = "object arrays are never encoded (no pickle)"
    elif dtype.fields is not None:
        why = "structured dtypes are not supported; send each field as its own array"
    else:
        why = "not in the dtype whitelist"
    raise UnsupportedValueError(f"unsupported dtype {dtype.str!r} ({dtype}): {why}")


def dtype_for(code: int) -> np.dtype[np.generic] | None:
    """Return the dtype of a wire code, or None if the code is unknown."""
    dt = CODE_TO_DTYPE[code]
    if dt is None and code in ML_DTYPES_CODES and _load_ml_dtypes(importing=True):
        dt = CODE_TO_DTYPE[code]
    return dt
