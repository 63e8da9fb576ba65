"""Collectives on CUDA arrays; skipped (with the reason) where no CUDA device is present.

The ranks share one process and one device here; over ucx:// the frames
move device to device, over tcp:// through host bounce buffers.
"""

from __future__ import annotations

import asyncio
import importlib.util

import numpy as np
import pytest

from tensorwire.collective import GroupConfig, ReduceOp

from .._cuda import cupy_or_skip
from .test_group import make_groups

LISTEN = [
    "tcp://127.0.0.1:0",
    pytest.param("ucx://127.0.0.1:0", id="ucx", marks=pytest.mark.skipif(
        importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed")),
]




@pytest.mark.gpu
@pytest.mark.parametrize("listen", LISTEN)
async def test_cupy_allreduce_broadcast_allgather(listen: str) -> None:
    cupy = cupy_or_skip()
    config = GroupConfig(timeout=60, rendezvous_timeout=30, segment_bytes=1 << 20)
    groups, server = await make_groups(3, listen, config)
    try:
        count = 3 << 20  # several segments per ring step
        xs = [cupy.full(count, g.rank + 1, cupy.float32) for g in groups]
        pointers = [x.data.ptr for x in xs]
        await asyncio.gather(*(g.allreduce(x) for g, x in zip(groups, xs, strict=True)))
        for x, ptr in zip(xs, pointers, strict=True):
            assert x.data.ptr == ptr  # in place, on the device
            assert bool((x == 6).all())
        avg = [cupy.full(100, float(g.rank), cupy.float64) for g in groups]
        await asyncio.gather(*(g.allreduce(a, ReduceOp.AVG) for g, a in
                               zip(groups, avg, strict=True)))
        assert all(bool((a == 1.0).all()) for a in avg)
        bs = [cupy.arange(1000, dtype=cupy.int64) if g.rank == 1 else
              cupy.zeros(1000, cupy.int64) for g in groups]
        await asyncio.gather(*(g.broadcast(b, root=1) for g, b in zip(groups, bs, strict=True)))
        assert all(bool((b == cupy.arange(1000)).all()) for b in bs)
        parts = await asyncio.gather(*(g.allgather(cupy.full(5, g.rank, cupy.int32))
                                       for g in groups))
        for p in parts:
            assert type(p) is cupy.ndarray
            np.testing.assert_array_equal(cupy.asnumpy(p), np.repeat(np.arange(3), 5)
                                          .reshape(3, 5))
    finally:
        await asyncio.gather(*(g.close() for g in groups))
        await server.close(grace=0)


@pytest.mark.gpu
async def test_torch_cuda_allreduce() -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    cupy_or_skip()
    groups, server = await make_groups(2)
    try:
        ts = [torch.full((1 << 20,), float(g.rank + 1), device="cuda") for g in groups]
        results = await asyncio.gather(*(g.allreduce(t) for g, t in zip(groups, ts, strict=True)))
        for t, result in zip(ts, results, strict=True):
            assert result is t
            assert bool((t == 3).all())
    finally:
        await asyncio.gather(*(g.close() for g in groups))
        await server.close(grace=0)
