"""CUDA code paths; skipped (with the reason) where no CUDA device is present."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tensorwire import serde

from .._cuda import cupy_or_skip


def _torch_cuda() -> Any:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["C", "F"])
def test_cupy_roundtrip_zero_copy(order: str) -> None:
    cupy = cupy_or_skip()
    arr = cupy.arange(4096, dtype=cupy.float32).reshape(64, 64)
    arr = cupy.asfortranarray(arr) if order == "F" else arr
    header, buffers = serde.encode({"x": arr})
    assert hasattr(buffers[0], "__cuda_array_interface__")
    assert buffers[0].data.ptr == arr.data.ptr
    out = serde.decode(header, buffers)["x"]
    assert type(out) is cupy.ndarray and out.dtype == arr.dtype
    assert out.data.ptr == arr.data.ptr
    assert bool((out == arr).all())
    assert out.flags.f_contiguous == (order == "F")


@pytest.mark.gpu
def test_cupy_strided_and_host_buffer() -> None:
    cupy = cupy_or_skip()
    arr = cupy.arange(100, dtype=cupy.int64)[::3]
    header, buffers = serde.encode(arr)
    host = [np.asarray(cupy.asnumpy(b)) for b in buffers]
    out = serde.decode(header, host)
    assert type(out) is cupy.ndarray
    assert bool((out == arr).all())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_torch_cuda_roundtrip(dtype: str) -> None:
    torch = _torch_cuda()
    t = torch.arange(1000, device="cuda").to(getattr(torch, dtype))
    header, buffers = serde.encode(t)
    assert hasattr(buffers[0], "__cuda_array_interface__")
    out = serde.decode(header, buffers)
    assert out.device.type == "cuda" and out.dtype == t.dtype
    assert out.data_ptr() == t.data_ptr()
    assert torch.equal(out, t)
