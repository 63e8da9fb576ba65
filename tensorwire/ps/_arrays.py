"""NumPy or CuPy: the array module a chunk computes with.

A shard keeps each chunk where its first value came from: in host memory for
NumPy arrays, on the GPU for CuPy arrays (which ucx:// delivers device to
device). Gradients are moved to their chunk's side; optimizers compute with
the chunk's module. CuPy is imported only when one of its arrays is met.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ("array_module", "like", "to_host")


def array_module(x: Any) -> Any:
    """``cupy`` for a CuPy array, else ``numpy``."""
    if type(x).__module__.partition(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def like(x: Any, reference: Any) -> Any:
    """``x`` as an array of ``reference``'s module: itself, or a copy across
    host and device memory."""
    xp = array_module(reference)
    if array_module(x) is xp:
        return x
    if xp is np:
        return to_host(x)
    return xp.asarray(x)


def to_host(x: Any) -> np.ndarray[Any, Any]:
    """``x`` in host memory (a copy of a CuPy array, else ``x`` as an array)."""
    if array_module(x) is not np:
        host: np.ndarray[Any, Any] = x.get()
        return host
    return np.asarray(x)
