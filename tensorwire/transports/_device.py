"""CUDA memory for transports: receive buffers, and the copies through host
memory that a transport which cannot move device memory itself needs.

Imported only when a CUDA frame is met. Uses CuPy where it is installed,
else PyTorch with CUDA, so that a torch-only process receives device
tensors too.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ..errors import TransportError

__all__ = ("copy_host_to_device", "device_empty", "device_to_host", "sync_current_streams")


def _library() -> tuple[str, Any]:
    """``("cupy", cupy)``, else ``("torch", torch)``.

    Raises:
        TransportError: neither is installed.
    """
    try:
        import cupy
    except ImportError:
        pass
    else:
        return "cupy", cupy
    try:
        import torch
    except ImportError as exc:
        raise TransportError(
            "a CUDA frame needs CuPy or PyTorch (pip install 'tensorwire[gpu]')"
        ) from exc
    return "torch", torch


def device_empty(nbytes: int) -> Any:
    """A CUDA uint8 array of ``nbytes`` on the current device.

    Raises:
        TransportError: neither CuPy nor PyTorch is installed.
    """
    name, lib = _library()
    if name == "cupy":
        return lib.empty(nbytes, dtype=lib.uint8)
    return lib.empty(nbytes, dtype=lib.uint8, device="cuda")


def _as_device_bytes(frame: Any, name: str, lib: Any) -> Any:
    """``frame`` as a flat uint8 array of ``lib`` (no copy)."""
    if name == "cupy":
        array = lib.asarray(frame)
        if not array.flags.c_contiguous:
            raise TransportError("CUDA frames must be C-contiguous")
        return array.reshape(-1).view(lib.uint8)
    tensor = lib.as_tensor(frame, device="cuda")
    if not tensor.is_contiguous():
        raise TransportError("CUDA frames must be C-contiguous")
    return tensor.reshape(-1).view(lib.uint8)


def sync_current_streams() -> None:
    """Wait for the GPU work queued on the current CuPy and torch streams.

    A transport reads a device frame on a stream of its own (UCX's copy
    engines, or the copy to host memory below): a kernel still writing the
    frame on the caller's stream, the default one or a side stream, would
    race with it. Only libraries already imported can have queued work.
    """
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.cuda.get_current_stream().synchronize()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


def device_to_host(frame: Any) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Copy a CUDA frame to host memory, once the work queued on it is done."""
    sync_current_streams()
    name, lib = _library()
    data = _as_device_bytes(frame, name, lib)
    host: np.ndarray[Any, np.dtype[np.uint8]] = (
        data.get() if name == "cupy" else data.cpu().numpy())
    return host


def copy_host_to_device(dst: Any, host: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
    """Copy a received host bounce buffer into its CUDA frame, and wait for
    the copy: the receiver may read the frame on any stream."""
    name, lib = _library()
    data = _as_device_bytes(dst, name, lib)
    if name == "cupy":
        data.set(host)
        lib.cuda.get_current_stream().synchronize()
    else:
        data.copy_(lib.from_numpy(host))  # synchronous: not non_blocking
