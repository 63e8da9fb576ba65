"""Allreduce of CuPy arrays and torch.cuda tensors across 2 and 4 processes.

Every rank reduces in place, on the device (the result is the caller's own
array, at the same device address), and checks it against the sum that
NumPy computes on the host from every rank's input (each rank can rebuild
the others' inputs from their seeds).
"""

from __future__ import annotations

import asyncio

import pytest

from .. import _ranks as ranks
from ._procs import HAS_UCX, cuda_transports, failed, gpu_or_skip, keep_evidence, reports, start

UCX = pytest.mark.skipif(not HAS_UCX, reason="ucxx is not installed")


async def run_ranks(kind: str, world: int, listen: str) -> list[str]:
    async def spawn(rank: int, master: str) -> asyncio.subprocess.Process:
        return await start("rank", kind, str(rank), str(world), master, listen)

    outputs, codes = await ranks.run_ranks(world, spawn, 110)
    texts = [out.decode(errors="replace") for out, _ in outputs]
    for code, text in zip(codes, texts, strict=True):
        assert code == 0, text[-4000:]
    return texts


@pytest.mark.gpu
@pytest.mark.parametrize(("kind", "world", "listen"), [
    pytest.param("cupy", 2, "ucx://127.0.0.1:0", marks=UCX),
    pytest.param("torch", 2, "ucx://127.0.0.1:0", marks=UCX),
    pytest.param("cupy", 4, "ucx://127.0.0.1:0", marks=UCX),
    pytest.param("torch", 4, "ucx://127.0.0.1:0", marks=UCX),
    pytest.param("cupy", 2, "tcp://127.0.0.1:0"),
])
async def test_allreduce_on_the_device(kind: str, world: int, listen: str) -> None:
    gpu_or_skip()
    texts = await run_ranks(kind, world, listen)
    found = [r for text in texts for r in reports(text) if "check" in r]
    assert len(found) == world * 4, "\n".join(t[-2000:] for t in texts)
    assert not failed(found), failed(found)
    if listen.startswith("ucx"):
        keep_evidence(f"allreduce {kind} x{world} over ucx://, rank 0", texts[0])
        assert "cuda_ipc" in cuda_transports(texts[0]), texts[0][-6000:]
