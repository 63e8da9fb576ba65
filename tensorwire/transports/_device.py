"""GPU frames on transports that cannot move device memory themselves.

Imported only when a CUDA frame is met; needs CuPy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import TransportError

__all__ = ("copy_host_to_device", "device_to_host")


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise TransportError("CUDA frames need CuPy (pip install 'tensorwire[gpu]')") from exc
    return cupy


def _as_device_bytes(frame: Any) -> Any:
    cupy = _cupy()
    array = cupy.asarray(frame)
    if not array.flags.c_contiguous:
        raise TransportError("CUDA frames must be C-contiguous")
    return array.reshape(-1).view(cupy.uint8)


def device_to_host(frame: Any) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Copy a CUDA frame to host memory (synchronises its stream)."""
    host: np.ndarray[Any, np.dtype[np.uint8]] = _as_device_bytes(frame).get()
    return host


def copy_host_to_device(dst: Any, host: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
    """Copy a received host bounce buffer into its CUDA frame."""
    _as_device_bytes(dst).set(host)
