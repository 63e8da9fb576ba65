"""Inspecting received buffers: host (buffer protocol) or device (CUDA)."""

from __future__ import annotations

from typing import Any, Final

import numpy as np

from ..errors import DecodeError

_HOST_TYPES: Final = frozenset({np.ndarray, bytes, bytearray, memoryview})


def is_device(buf: Any) -> bool:
    """True if ``buf`` is a device buffer (exposes ``__cuda_array_interface__``)."""
    return type(buf) not in _HOST_TYPES and hasattr(buf, "__cuda_array_interface__")


def host_bytes(buf: Any, index: int) -> tuple[np.ndarray[Any, np.dtype[np.uint8]], bool]:
    """Return ``buf`` as a 1-D uint8 array sharing its memory, and whether it is read-only.

    Raises:
        DecodeError: ``buf`` exposes no buffer protocol or is not contiguous.
    """
    if type(buf) is np.ndarray:
        if not buf.flags.c_contiguous:
            raise DecodeError(f"buffer {index} is not C-contiguous")
        if buf.dtype is not _U8 or buf.ndim != 1:
            # A view, not a copy: contiguous, so ravel and view share memory.
            buf = buf.ravel().view(np.uint8)
        return buf, not buf.flags.writeable
    try:
        mv = memoryview(buf)
    except TypeError:
        raise DecodeError(
            f"buffer {index} of type {type(buf).__qualname__} supports neither the buffer "
            "protocol nor __cuda_array_interface__"
        ) from None
    if not mv.c_contiguous:
        raise DecodeError(f"buffer {index} is not C-contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return np.frombuffer(mv, dtype=np.uint8), mv.readonly


_U8: Final = np.dtype(np.uint8)


def device_nbytes(buf: Any, index: int) -> int:
    """Byte size of a contiguous device buffer, from its ``__cuda_array_interface__``.

    Raises:
        DecodeError: the interface is malformed or describes a strided buffer.
    """
    try:
        iface = buf.__cuda_array_interface__
        shape = tuple(int(d) for d in iface["shape"])
        itemsize = np.dtype(_interface_typestr(iface["typestr"])).itemsize
        strides = iface.get("strides")
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise DecodeError(f"buffer {index}: malformed __cuda_array_interface__: {exc}") from None
    count = 1
    for dim in shape:
        count *= dim
    if strides is not None:
        expected = []
        step = itemsize
        for dim in reversed(shape):
            expected.append(step)
            step *= dim
        if count > 1 and tuple(strides) != tuple(reversed(expected)):
            raise DecodeError(f"buffer {index}: device buffer is not C-contiguous")
    return count * itemsize


def _interface_typestr(typestr: Any) -> str:
    # Only plain numeric typestrs ("|u1", "<f4"): a device buffer is bytes to
    # us, and this keeps arbitrary strings away from np.dtype().
    if (
        type(typestr) is not str
        or len(typestr) > 4
        or typestr[1:2] not in ("b", "i", "u", "f", "c")
    ):
        raise ValueError(f"unsupported typestr {typestr!r}")
    return typestr
