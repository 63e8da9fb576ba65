"""Device frames on a ucx:// connection in one process: a CUDA frame arrives
in device memory, in the buffer the receiver's allocator gave.

Apart from tests/transports/test_ucx.py, whose helpers need the TLS test
packages that a GPU machine may lack.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from tensorwire.transports import Listener, connect, listen

from .._cuda import cupy_or_skip
from ..transports.test_conformance import as_bytes, echo
from ._procs import HAS_UCX

pytestmark = pytest.mark.skipif(not HAS_UCX, reason="ucxx is not installed")


@contextlib.asynccontextmanager
async def echo_server() -> AsyncIterator[Listener]:
    listener = await listen("ucx://127.0.0.1:0", echo)
    try:
        yield listener
    finally:
        await listener.close()


@pytest.mark.gpu
async def test_cuda_frames_arrive_in_device_memory() -> None:
    cupy = cupy_or_skip()
    data = cupy.arange(1 << 20, dtype=cupy.float32)
    async with echo_server() as listener, await connect(listener.address) as conn:
        await conn.send([b"meta", data, np.arange(10, dtype=np.uint8)])
        meta, device, host = await conn.recv()
        assert as_bytes(meta) == b"meta"
        assert hasattr(device, "__cuda_array_interface__")
        assert bool((device.view(cupy.float32) == data).all())
        assert np.array_equal(host, np.arange(10, dtype=np.uint8))


@pytest.mark.gpu
async def test_cuda_frame_into_allocator_memory() -> None:
    cupy = cupy_or_skip()
    given: list[Any] = []

    def allocator(info: Any) -> Any:
        assert info.device == "cuda"
        given.append(cupy.empty(info.nbytes, cupy.uint8))
        return given[-1]

    data = cupy.arange(3 << 20, dtype=cupy.uint8)
    async with echo_server() as listener, await connect(listener.address) as conn:
        await conn.send([data])
        (frame,) = await conn.recv(allocator=allocator)
        assert frame is given[0]
        assert bool((frame == data).all())
