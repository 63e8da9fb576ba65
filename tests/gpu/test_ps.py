"""A parameter-server shard holding CuPy parameters applies pushes on the device.

A worker process initializes CuPy parameters and pushes CuPy gradients with
SGD; a shard process keeps every chunk in device memory and updates it
there; the worker's pulls are CuPy arrays equal to SGD computed on the host.
"""

from __future__ import annotations

import pytest

from ._procs import HAS_UCX, failed, gpu_or_skip, reports, serve_and_run


@pytest.mark.gpu
@pytest.mark.parametrize("listen", [
    pytest.param("ucx://127.0.0.1:0", id="ucx", marks=pytest.mark.skipif(
        not HAS_UCX, reason="ucxx is not installed")),
    pytest.param("tcp://127.0.0.1:0", id="tcp"),
])
async def test_shard_keeps_cupy_parameters_on_the_device(listen: str) -> None:
    gpu_or_skip()
    shard_out, worker_out = await serve_and_run(["shard", listen],
                                                lambda address: ["ps-worker", address])
    found = [r for out in (worker_out, shard_out) for r in reports(out) if "check" in r]
    assert len(found) == 1 + 3 + 2, found
    assert not failed(found), failed(found)
