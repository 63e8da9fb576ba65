"""Frames in memory: what a receiver knows of one before its data lands
(``FrameInfo``), allocating receive buffers (``Allocator``,
``default_allocator``, aligned ``host_empty``), and viewing a frame's bytes
(host or CUDA)."""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from ..errors import TransportError
from ._pool import POOL_MIN_BYTES, buffer_pool

__all__ = ("ALIGNMENT", "Allocator", "Device", "FrameInfo", "default_allocator", "device_nbytes",
           "host_empty", "host_view", "interface_nbytes", "is_device_frame", "writable_view")

Device = Literal["cpu", "cuda"]

#: Host frames are writable NumPy uint8 arrays aligned to this many bytes, so
#: that any dtype (and AVX-512 loads) can view them without a copy; or, where
#: the transport says how the sender's frame lay (``FrameInfo.offset``), at
#: the same offset from such a boundary as the sender's.
ALIGNMENT = 64


@dataclasses.dataclass(slots=True)
class FrameInfo:
    """What the receiver knows of a frame before its data lands.

    Attributes:
        index: position of the frame in its message.
        nbytes: exact size of the frame.
        device: ``"cpu"`` for host memory, ``"cuda"`` for device memory.
        offset: where the sender's frame started, modulo ``ALIGNMENT``
            (ucx:// host frames sent on their own; 0 elsewhere).
            :func:`default_allocator` puts the frame at the same offset:
            the kernel's copy between two buffers whose addresses differ in
            their low bits runs at two thirds of the speed (on one AMD EPYC
            host 64 MiB from 16 bytes past a 64-byte boundary: 8.0 GB/s
            into a 64-byte-aligned buffer, 11.4 into one 16 bytes past it;
            bench/results/copy_alignment.md), and over UCX's shared memory
            transport (``cma``) that copy is the whole transfer.
    """

    # Not frozen: one is built per received frame, and a frozen dataclass's
    # __init__ costs twice as much.
    index: int
    nbytes: int
    device: Device = "cpu"
    offset: int = 0


#: Returns a writable buffer of exactly ``info.nbytes`` bytes: host memory
#: (anything with the writable buffer protocol) for ``"cpu"`` frames, an object
#: with ``__cuda_array_interface__`` for ``"cuda"`` frames.
Allocator = Callable[[FrameInfo], Any]


def host_empty(nbytes: int, offset: int = 0) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A writable uint8 array of ``nbytes`` whose data starts ``offset``
    bytes past an ALIGNMENT boundary (0 <= offset < ALIGNMENT).

    Large ones come from the process's :func:`buffer_pool`.
    """
    if nbytes >= POOL_MIN_BYTES:
        return buffer_pool().empty(nbytes, align=ALIGNMENT, offset=offset)
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    # ctypes.addressof(c_char.from_buffer()) costs half of ``raw.ctypes.data``,
    # and this runs for every message received.
    start = (offset - ctypes.addressof(ctypes.c_char.from_buffer(raw.data))) % ALIGNMENT
    return raw[start : start + nbytes]


def default_allocator(info: FrameInfo) -> Any:
    """Allocate each frame at its exact size where it belongs.

    Host frames start ``info.offset`` bytes past an ALIGNMENT boundary;
    those of ``POOL_MIN_BYTES`` and more come from :func:`buffer_pool`.
    """
    if info.device == "cuda":
        from ._device import device_empty

        return device_empty(info.nbytes)
    return host_empty(info.nbytes, info.offset)


def is_device_frame(frame: Any) -> bool:
    """True when ``frame`` lives in GPU memory."""
    return hasattr(frame, "__cuda_array_interface__") and not _has_buffer_protocol(frame)


def _has_buffer_protocol(obj: Any) -> bool:
    try:
        memoryview(obj)
    except TypeError:
        return False
    return True


def device_nbytes(frame: Any) -> int:
    """Size of a contiguous CUDA buffer from ``__cuda_array_interface__``."""
    return interface_nbytes(frame.__cuda_array_interface__)


def interface_nbytes(cai: dict[str, Any]) -> int:
    """Size of a contiguous CUDA buffer from its ``__cuda_array_interface__``
    (read once by a caller that needs it for more than the size: with CuPy
    each read of the property costs)."""
    if cai.get("strides") is not None:
        itemsize = np.dtype(cai["typestr"]).itemsize
        expected = itemsize
        for dim, stride in zip(reversed(cai["shape"]), reversed(cai["strides"]), strict=True):
            if stride != expected and dim > 1:
                raise TransportError("CUDA frames must be C-contiguous")
            expected *= dim
    count = 1
    for dim in cai["shape"]:
        count *= dim
    return count * int(np.dtype(cai["typestr"]).itemsize)


def host_view(frame: Any) -> memoryview:
    """A flat byte view of a host frame, without copying.

    Raises:
        TransportError: the frame is neither a buffer nor contiguous.
    """
    try:
        view = memoryview(frame)
    except TypeError as exc:
        raise TransportError(
            f"a frame must support the buffer protocol or __cuda_array_interface__, "
            f"got {type(frame).__name__}"
        ) from exc
    if view.format == "B" and view.ndim == 1:
        return view
    if view.c_contiguous:
        return view.cast("B")
    if view.f_contiguous:
        # memoryview cannot cast a Fortran-ordered view; NumPy can, still
        # without copying.
        return np.asarray(view).ravel(order="F").view(np.uint8).data
    raise TransportError("frames must be contiguous buffers")


def writable_view(buffer: Any, info: FrameInfo) -> memoryview:
    """Check an allocator's host buffer and return a flat writable view."""
    view = host_view(buffer)
    if view.readonly:
        raise TransportError(f"allocator returned a read-only buffer for frame {info.index}")
    if view.nbytes != info.nbytes:
        raise TransportError(
            f"allocator returned {view.nbytes} bytes for frame {info.index} of {info.nbytes}"
        )
    return view
