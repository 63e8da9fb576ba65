"""One greedy client must not take the server away from the others.

Over tcp:// and over ucx:// alike: a process pipelines calls at full speed
(``_greedy.py``) while a well-behaved client calls every 10 ms with a 1 s
deadline and a 1 s heartbeat timeout, and new clients connect: every call
succeeds, the good client's p99 latency stays within 10x of what it was
without the greedy one, heartbeats are answered and new connections
accepted throughout. (Every 10 ms, so that the p99 of the 2.5 s beside the
greedy client, about 200 calls, is a percentile: with a call every 50 ms
it was the one slowest call, and a single stall of the shared 2-core host,
up to half a second in 1 of about 10 runs, failed the test where the other
calls took milliseconds; a stall of 1 s still fails it, by the deadline.)
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from collections.abc import Iterator

import pytest

import tensorwire as tw
from tensorwire.errors import TensorwireError
from tensorwire.rpc import ClientConfig

from .conftest import ROOT, Server, spawn_server

GOOD = ClientConfig(timeout=1.0, heartbeat_interval=0.25, heartbeat_timeout=1.0,
                    reconnect_attempts=1)
#: The latency that scheduling noise alone reaches on a loaded 2-core VM,
#: with three busy processes (server, greedy client, this test) on it: a
#: p99 below it is not starvation, whatever the unloaded p99 was. (Measured:
#: 3.6 to 57 ms beside the greedy client; starved, calls took seconds.)
NOISE_FLOOR = 0.25


@pytest.fixture(scope="module", params=[
    "tcp",
    pytest.param("ucx", marks=pytest.mark.skipif(
        importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed")),
])
def any_server(request: pytest.FixtureRequest) -> Iterator[Server]:
    """The reliability server listening on tcp:// or on ucx://."""
    with spawn_server("--listen", f"{request.param}://127.0.0.1:0") as running:
        yield running


#: The good client's pause between calls.
INTERVAL = 0.01


async def _latencies(client: tw.Client, seconds: float, failures: list[str]) -> list[float]:
    out = []
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        started = time.perf_counter()
        try:
            assert await client.call("Store.echo", 42) == 42
        except TensorwireError as exc:
            failures.append(repr(exc))
        else:
            out.append(time.perf_counter() - started)
        await asyncio.sleep(INTERVAL)
    return out


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def _accepts(address: str, seconds: float, failures: list[str]) -> list[float]:
    """Connect a new client every 0.3 s; how long each took to answer a call."""
    took = []
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        started = time.perf_counter()
        try:
            async with tw.connect(address, config=GOOD) as client:
                await client.call("Store.echo", 1)
        except TensorwireError as exc:
            failures.append(f"new client: {exc!r}")
        took.append(time.perf_counter() - started)
        await asyncio.sleep(0.3)
    return took


@pytest.mark.slow
async def test_a_greedy_client_does_not_starve_the_others(any_server: Server) -> None:
    server = any_server
    failures: list[str] = []
    async with tw.connect(server.address, config=GOOD) as client:
        await client.call("Store.echo", 0)
        unloaded = await _latencies(client, 1.5, failures)
        greedy = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.reliability._greedy", server.address, "3",
            cwd=ROOT, stdout=asyncio.subprocess.PIPE)
        try:
            await asyncio.sleep(0.3)  # under way
            loaded, accepts = await asyncio.gather(_latencies(client, 2.5, failures),
                                                   _accepts(server.address, 2.5, failures))
            out, _ = await asyncio.wait_for(greedy.communicate(), 20)
        finally:
            if greedy.returncode is None:
                greedy.kill()
                await greedy.wait()
    replies = int(out)
    scheme = server.address.split(":")[0]
    print(f"fairness over {scheme}: greedy client got {replies / 2**20:.1f} MiB of replies; "
          f"good client p99 "
          f"{_p99(unloaded) * 1e3:.2f} ms alone, {_p99(loaded) * 1e3:.2f} ms beside it "
          f"({len(loaded)} calls, the slowest {max(loaded) * 1e3:.0f} ms); new connections "
          f"answered within "
          f"{max(accepts) * 1e3:.0f} ms")
    assert failures == []
    assert replies > 1 << 20, "the greedy client did not get going"
    assert _p99(loaded) <= max(10 * _p99(unloaded), NOISE_FLOOR), (unloaded, loaded)
    assert max(accepts) < 1.0, accepts
