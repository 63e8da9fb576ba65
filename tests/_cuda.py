"""The CUDA device the GPU tests need, or a skip that says why there is none."""

from __future__ import annotations

from typing import Any

import pytest


def cupy_or_skip() -> Any:
    """CuPy with at least one CUDA device; skips the test otherwise."""
    cupy = pytest.importorskip("cupy", reason="cupy is not installed")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("cupy sees no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        pytest.skip(f"no CUDA runtime: {exc}")
    return cupy
