"""A parameter-server shard holding CuPy parameters applies pushes on the device.

A worker process initializes CuPy parameters and pushes CuPy gradients with
SGD; a shard process keeps every chunk in device memory and updates it
there; the worker's pulls are CuPy arrays equal to SGD computed on the host.
"""

from __future__ import annotations

import asyncio
import signal

import pytest

from ._procs import HAS_UCX, failed, first_json, gpu_or_skip, reports, start


@pytest.mark.gpu
@pytest.mark.parametrize("listen", [
    pytest.param("ucx://127.0.0.1:0", id="ucx", marks=pytest.mark.skipif(
        not HAS_UCX, reason="ucxx is not installed")),
    pytest.param("tcp://127.0.0.1:0", id="tcp"),
])
async def test_shard_keeps_cupy_parameters_on_the_device(listen: str) -> None:
    gpu_or_skip()
    shard = await start("shard", listen)
    try:
        ready = await first_json(shard)
        worker = await start("ps-worker", ready["address"])
        worker_out, _ = await asyncio.wait_for(worker.communicate(), 100)
        assert worker.returncode == 0, worker_out.decode(errors="replace")[-4000:]
        shard.send_signal(signal.SIGTERM)
        shard_out, _ = await asyncio.wait_for(shard.communicate(), 30)
    finally:
        if shard.returncode is None:
            shard.kill()
            await shard.wait()
    found = [r for out in (worker_out, shard_out) for r in reports(out.decode(errors="replace"))
             if "check" in r]
    assert len(found) == 1 + 3 + 2, found
    assert not failed(found), failed(found)
