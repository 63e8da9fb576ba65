"""NumPy arrays and scalars (NumPy is a core dependency, so no lazy import).

Encoding never copies a C- or F-contiguous array: the buffer is a byte view of
its memory. Other layouts are compacted with exactly one copy
(``np.ascontiguousarray``); zero-strided (broadcast) axes are sent once and
re-broadcast by the decoder only where ``Limits.broadcast`` allows it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from msgpack import ExtType

from . import _dtypes
from ._format import (
    ARRAY_HEAD,
    DIMS,
    EXT_ARRAY,
    FLAG_BROADCAST,
    FLAG_FORTRAN,
    FLAG_INLINE,
    KIND_NDARRAY,
    KIND_NPSCALAR,
    U64,
    as_memoryview,
    new_ext,
)

_DTYPE_TO_CODE = _dtypes.DTYPE_TO_CODE


def byte_view(data: np.ndarray[Any, Any]) -> memoryview:
    """A 1-D unsigned-byte memoryview of a C-contiguous array, sharing its memory."""
    try:
        return as_memoryview(data).cast("B")
    except (ValueError, TypeError):
        # ml_dtypes (bfloat16, float8) cannot be exported through the buffer
        # protocol; a uint8 view of the same memory can.
        return as_memoryview(data.reshape(-1).view(np.uint8))


def encode_ndarray(arr: np.ndarray[Any, Any], bufs: list[Any], threshold: int,
                   broadcast: bool = False) -> ExtType:
    """Describe ``arr`` as an EXT_ARRAY; append its data to ``bufs`` unless it travels inline.
    ``broadcast``: send zero-strided axes once (``Limits.broadcast``).

    Raises:
        UnsupportedValueError: the dtype is not whitelisted or ndim > 64.
    """
    dtype = arr.dtype
    code = _DTYPE_TO_CODE.get(dtype)
    if code is None:
        code = _dtypes.code_for(dtype)
    shape = arr.shape
    flags = 0
    mask = 0
    aflags = arr.flags
    if aflags.c_contiguous:
        data = arr
    elif aflags.f_contiguous:
        flags = FLAG_FORTRAN
        data = arr.T  # C-contiguous view of the same memory, in memory order
    else:
        strides = arr.strides
        for axis, dim in enumerate(shape):
            if broadcast and strides[axis] == 0 and dim > 1:
                mask |= 1 << axis
        if mask:
            # Send each broadcast axis once: np.broadcast_to(1.0, (1 << 30,))
            # costs 8 bytes on the wire, not 8 GiB.
            flags = FLAG_BROADCAST
            arr = arr[
                tuple(slice(0, 1) if mask >> a & 1 else slice(None) for a in range(len(shape)))
            ]
        # The one copy of a non-contiguous array (documented in Encoder).
        data = np.ascontiguousarray(arr)
    ndim = len(shape)
    dims = DIMS[ndim].pack(*shape)
    nbytes = data.nbytes
    if nbytes < threshold:
        head = ARRAY_HEAD.pack(KIND_NDARRAY, code, flags | FLAG_INLINE, ndim, 0, 0)
        parts = [head, dims]
        if mask:
            parts.append(U64.pack(mask))
        parts.append(data.tobytes())
        return new_ext((EXT_ARRAY, b"".join(parts)))
    head = ARRAY_HEAD.pack(KIND_NDARRAY, code, flags, ndim, 0, len(bufs))
    bufs.append(byte_view(data))
    if mask:
        return new_ext((EXT_ARRAY, head + dims + U64.pack(mask)))
    return new_ext((EXT_ARRAY, head + dims))


def encode_scalar(value: np.generic, bufs: list[Any], threshold: int) -> ExtType:
    """Describe a NumPy (or ml_dtypes) scalar; always inline (it is a few bytes).

    Raises:
        UnsupportedValueError: its dtype is not whitelisted.
    """
    arr = np.asarray(value)
    dtype = arr.dtype
    code = _DTYPE_TO_CODE.get(dtype)
    if code is None:
        code = _dtypes.code_for(dtype)
    head = ARRAY_HEAD.pack(KIND_NPSCALAR, code, FLAG_INLINE, 0, 0, 0)
    return new_ext((EXT_ARRAY, head + arr.tobytes()))


def decode_ndarray(
    dtype: np.dtype[Any],
    flags: int,
    shape: tuple[int, ...],
    stored_shape: tuple[int, ...],
    data: np.ndarray[Any, np.dtype[np.uint8]],
) -> np.ndarray[Any, Any]:
    """Build the array as a view of ``data`` (1-D uint8, exact size, already checked)."""
    flat = data.view(dtype)
    if not flat.flags.aligned:
        # A misaligned view is legal but slow and breaks C extensions that
        # assume alignment; one copy into NumPy's aligned allocation instead.
        flat = flat.copy()
    if flags & FLAG_FORTRAN:
        arr = flat.reshape(stored_shape, order="F")
    else:
        arr = flat.reshape(stored_shape)
    if flags & FLAG_BROADCAST:
        # Read-only, like np.broadcast_to itself: a write through a zero
        # stride would change every element of that axis at once.
        arr = np.broadcast_to(arr, shape)
    return arr


def check_flags(kind: int, flags: int) -> str | None:
    """Return why ``flags`` are invalid for a NumPy kind, or None."""
    if kind == KIND_NPSCALAR:
        return None if flags == FLAG_INLINE else "a NumPy scalar must be inline, no other flags"
    if flags & ~(FLAG_FORTRAN | FLAG_INLINE | FLAG_BROADCAST):
        return f"flags {flags:#x} not valid for a NumPy array"
    return None
