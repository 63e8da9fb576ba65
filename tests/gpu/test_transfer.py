"""CuPy arrays and torch.cuda tensors between two processes: where they land.

A sink process serves an RPC service; a source process sends it device
arrays, 1 MiB and 128 MiB, and gets them echoed back. Over ucx:// each must
arrive in device memory that the receiving process's allocator handed out,
equal, with no byte staged through host memory by tensorwire, and UCX must
have carried it with CUDA IPC (its protocol tables say so). Over tcp:// the
same arrays arrive equal too, through host memory, and the connections'
``device_bytes_staged`` counters say how much. Kernels still queued on the
array when it is sent, on the current or a side stream, finish before UCX
reads it.
"""

from __future__ import annotations

import pytest

from ._procs import (
    HAS_UCX,
    cuda_transports,
    failed,
    gpu_or_skip,
    keep_evidence,
    reports,
    serve_and_run,
)

UCX = pytest.mark.skipif(not HAS_UCX, reason="ucxx is not installed")


async def run_pair(listen: str, kinds: str, *flags: str) -> tuple[str, str]:
    """Sink and source; returns the output of each."""
    return await serve_and_run(["sink", listen, *flags],
                               lambda address: ["source", address, kinds, *flags])


def check_reports(output: str, at_least: int) -> None:
    found = [r for r in reports(output) if "check" in r]
    assert len(found) >= at_least, output[-4000:]
    assert not failed(found), failed(found)


@pytest.mark.gpu
@UCX
async def test_ucx_device_to_device_into_the_receivers_allocator() -> None:
    gpu_or_skip()
    sink_out, source_out = await run_pair("ucx://127.0.0.1:0", "cupy,torch")
    keep_evidence("transfer over ucx://, sink", sink_out)
    keep_evidence("transfer over ucx://, source", source_out)
    check_reports(source_out, at_least=2 * 2 * 3 + 2 * 2 + 2)
    # UCX moved device memory by CUDA IPC, on both sides (each sent some).
    for output in (source_out, sink_out):
        assert "cuda_ipc" in cuda_transports(output), output[-6000:]


@pytest.mark.gpu
@UCX
async def test_ucx_torch_without_cupy() -> None:
    gpu_or_skip(torch_only=True)
    sink_out, source_out = await run_pair("ucx://127.0.0.1:0", "torch", "--no-cupy")
    keep_evidence("transfer over ucx:// without CuPy, sink", sink_out)
    check_reports(source_out, at_least=2 * 3 + 2 + 2)
    assert "cuda_ipc" in cuda_transports(source_out), source_out[-6000:]


@pytest.mark.gpu
async def test_tcp_stages_device_arrays_through_host_memory() -> None:
    gpu_or_skip()
    _, source_out = await run_pair("tcp://127.0.0.1:0", "cupy,torch")
    # Includes the staged-bytes checks: every device byte, both ways, counted.
    check_reports(source_out, at_least=2 * 2 * 3 + 2 * 2 + 2)
