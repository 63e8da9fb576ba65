"""CuPy arrays. Imported only when a CuPy array is met or a header names one.

Device data always travels out of band, as a 1-D ``cupy.uint8`` view of the
array's memory (it exposes ``__cuda_array_interface__``). A strided array is
compacted with one device copy. Decoding wraps the received device buffer
without a copy; a host buffer (from a transport that cannot carry device
frames) is copied to the current device.
"""

from __future__ import annotations

from typing import Any

import cupy
import numpy as np
from msgpack import ExtType

from ..errors import DecodeError
from . import _buffers, _dtypes
from ._format import (
    ARRAY_HEAD,
    DIMS,
    EXT_ARRAY,
    FLAG_BROADCAST,
    FLAG_FORTRAN,
    FLAG_INLINE,
    FLAG_REQUIRES_GRAD,
    KIND_CUPY,
)


def is_cupy_array(obj: object) -> bool:
    """True if ``obj`` is a ``cupy.ndarray``."""
    return isinstance(obj, cupy.ndarray)


def encode_cupy(arr: Any, bufs: list[Any], threshold: int) -> ExtType:
    """Describe a CuPy array as an EXT_ARRAY of kind cupy (always out of band).

    Raises:
        UnsupportedValueError: its dtype is not whitelisted.
    """
    code = _dtypes.code_for(np.dtype(arr.dtype))
    flags = 0
    if arr.flags.c_contiguous:
        data = arr
    elif arr.flags.f_contiguous:
        flags = FLAG_FORTRAN
        data = arr.T
    else:
        data = cupy.ascontiguousarray(arr)  # the one (device) copy
    ndim = arr.ndim
    head = ARRAY_HEAD.pack(KIND_CUPY, code, flags, ndim, arr.device.id, len(bufs))
    bufs.append(data.reshape(-1).view(cupy.uint8))
    return ExtType(EXT_ARRAY, head + DIMS[ndim].pack(*arr.shape))


def decode_cupy(
    dtype: np.dtype[Any],
    flags: int,
    device: int,
    shape: tuple[int, ...],
    nbytes: int,
    data: Any,
    index: int,
    inline: bool,
) -> Any:
    """Build a CuPy array on the received buffer.

    Raises:
        DecodeError: flags not valid for CuPy, or a buffer of the wrong size.
    """
    if flags & (FLAG_BROADCAST | FLAG_REQUIRES_GRAD | FLAG_INLINE) or inline:
        raise DecodeError(f"flags {flags:#x} not valid for a CuPy array")
    if _buffers.is_device(data):
        size = _buffers.device_nbytes(data, index)
        if size != nbytes:
            raise DecodeError(f"buffer {index} has {size} bytes, the array needs {nbytes}")
        flat = cupy.asarray(data)
        if flat.dtype != cupy.uint8:
            flat = flat.reshape(-1).view(cupy.uint8)
    else:
        host, _ = _buffers.host_bytes(data, index)
        if host.nbytes != nbytes:
            raise DecodeError(f"buffer {index} has {host.nbytes} bytes, the array needs {nbytes}")
        with cupy.cuda.Device(device if device < cupy.cuda.runtime.getDeviceCount() else 0):
            flat = cupy.asarray(host)  # host frame for a device array: one copy up
    order = "F" if flags & FLAG_FORTRAN else "C"
    return flat.view(dtype).reshape(shape, order=order)
