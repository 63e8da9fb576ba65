"""Compression per link class across emulated hosts: only the remote link compresses.

The worker runs on host 0 with one shard beside it (loopback, the "local"
link class) and one shard on host 1 (the "remote" class), and pushes with
``compression={"local": None, "remote": "fp8"}``. Host 1's link counters
show that the remote shard received about a quarter of the gradient bytes
(fp8: one byte per float32), and the shards' parameters show that the local
shard got the gradients exactly while the remote one got fp8's rounding
(with error feedback, so its sum still tracks the true one).
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from tensorwire.testing.netbed import Testbed

from .conftest import spawn

STEPS = 5
ELEMENTS = 1 << 18  # 1 MiB of float32 per tensor, one chunk each, one tensor per shard
WORKER = f"""
import asyncio, json, sys
import numpy as np
from tensorwire import ps
local, remote = sys.argv[1], sys.argv[2]
async def main():
    config = ps.PSConfig(compression={{"local": None, "remote": "fp8"}}, timeout=30,
                         retry_timeout=10)
    client = await ps.connect([local, remote], worker=0, num_workers=1,
                              optimizer=ps.SGD(lr=1.0), config=config)
    async with client:
        rng = np.random.default_rng(0)
        names = ["a", "b"]
        await client.init({{n: np.zeros({ELEMENTS}, np.float32) for n in names}})
        grads = {{n: rng.standard_normal({ELEMENTS}).astype(np.float32) for n in names}}
        on = {{c.name: s for s in (0, 1) for c in client.placement.on_shard(s)}}
        print("ready", flush=True)
        sys.stdin.readline()
        for _ in range({STEPS}):
            await client.push(grads)
        print("pushed", flush=True)
        sys.stdin.readline()
        params = await client.pull()
        report = {{}}
        for n in names:
            # SGD with lr 1 from zeros: the parameters are minus the sum received.
            received = -params[n].astype(np.float64)
            true_sum = {STEPS} * grads[n].astype(np.float64)
            report[n] = {{"shard": on[n], "peak": float(np.abs(grads[n]).max()),
                         "max_error": float(np.abs(received - true_sum).max()),
                         "max_rel_error": float(np.max(np.abs(received - true_sum)
                                                       / np.abs(true_sum)))}}
        pushes = client.metrics()["push"]
        report["bytes_per_push"] = pushes["bytes_out"] / pushes["calls"]
        print(json.dumps(report), flush=True)
asyncio.run(main())
"""


@asynccontextmanager
async def shard_in(bed: Testbed, host: int, listen: str) -> AsyncIterator[str]:
    child = await spawn(bed, host, "-m", "tensorwire", "ps", "serve", "--listen", listen)
    try:
        assert child.stdout is not None and child.stderr is not None
        while True:
            line = (await asyncio.wait_for(child.stdout.readline(), 30)).decode()
            assert line, (await child.stderr.read()).decode()[-2000:]
            if line.startswith("listening on "):
                yield line.split()[-1]
                break
    finally:
        if child.returncode is None:
            child.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(child.wait(), 10)
            except TimeoutError:
                child.kill()
                await child.wait()


async def expect(process: asyncio.subprocess.Process, word: str) -> str:
    assert process.stdout is not None and process.stderr is not None
    line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
    if not line.startswith(word):
        process.kill()
        raise AssertionError(f"expected {word!r}, got {line!r}: "
                             f"{(await process.stderr.read()).decode()[-3000:]}")
    return line


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("bed", [2], indirect=True)
async def test_only_the_remote_link_is_compressed(bed: Testbed) -> None:
    async with shard_in(bed, 0, "tcp://127.0.0.1:0") as local, \
            shard_in(bed, 1, f"tcp://{bed.address(1)}:0") as remote:
        worker = await spawn(bed, 0, "-c", WORKER, local, remote)
        try:
            assert worker.stdin is not None
            await expect(worker, "ready")
            _, received_before = bed.link_bytes(1)
            worker.stdin.write(b"go\n")
            await worker.stdin.drain()
            await expect(worker, "pushed")
            _, received_after = bed.link_bytes(1)
            worker.stdin.write(b"go\n")
            await worker.stdin.drain()
            report = json.loads(await expect(worker, "{"))
            await asyncio.wait_for(worker.wait(), 30)
        finally:
            if worker.returncode is None:
                worker.kill()
                await worker.wait()
    assert worker.returncode == 0
    by_shard = {report[n]["shard"]: report[n] for n in ("a", "b")}
    assert set(by_shard) == {0, 1}, "the placement should put one tensor on each shard"
    raw = ELEMENTS * 4
    per_push = (received_after - received_before) / STEPS
    print(f"per push: remote host received {per_push / raw:.3f} of the float32 bytes "
          f"of its tensor; the client sent {report['bytes_per_push']:.0f} bytes to both")
    # fp8 on the wire to host 1: one byte per element, plus message and TCP/IP
    # headers and acknowledgements; far below the 1.0 of float32.
    assert 0.25 <= per_push / raw < 0.3
    # Both shards together: the local tensor as float32, the remote one as fp8.
    assert report["bytes_per_push"] == raw + ELEMENTS
    # The local shard got the gradients exactly: only float32 summation error.
    local_tensor, remote_tensor = by_shard[0], by_shard[1]
    assert local_tensor["max_rel_error"] < 1e-5
    # The remote shard got fp8's rounding, held within one rounding of a
    # step's gradient by error feedback (e4m3: 2**-4 relative, of a peak).
    assert remote_tensor["max_error"] > 1e-4
    assert remote_tensor["max_error"] < 2 * 2.0**-4 * remote_tensor["peak"]
