"""Load on a real RPC server process: many clients, many calls in flight.

Bounded in count; every answer is checked, and the server's resident memory
must not grow with the load.
"""

from __future__ import annotations

import asyncio
import time

import pytest

import tensorwire as tw
from tensorwire.rpc import ClientConfig

from .conftest import Server

CONFIG = ClientConfig(timeout=120, heartbeat_interval=2, heartbeat_timeout=30)


@pytest.mark.slow
async def test_200_clients_making_1000_calls_each(server: Server) -> None:
    idle = server.rss()
    clients = [tw.connect(server.address, config=CONFIG) for _ in range(200)]
    await asyncio.gather(*(client.connect() for client in clients))
    before = server.rss()

    async def work(index: int, client: tw.Client) -> int:
        wrong = 0
        for call in range(1000):
            value = index * 1000 + call
            if await client.call("Store.echo", value) != value:
                wrong += 1
        return wrong

    started = time.perf_counter()
    try:
        wrong = await asyncio.wait_for(
            asyncio.gather(*(work(i, c) for i, c in enumerate(clients))), 110)
    finally:
        took = time.perf_counter() - started
        loaded = server.rss()
        await asyncio.gather(*(client.close() for client in clients))
    await asyncio.sleep(1.0)
    left = server.rss()
    assert sum(wrong) == 0
    # 200 sessions' worth of buffers, not 200,000 calls' worth.
    grew = loaded - before
    assert grew < 64 << 20, (before, loaded)
    assert left - idle < 64 << 20, (idle, left)
    mib = 2**20
    print(f"load: 200,000 calls from 200 clients in {took:.1f} s; server RSS against before "
          f"they connected: {(before - idle) / mib:+.1f} MiB with 200 idle sessions, "
          f"{(loaded - idle) / mib:+.1f} MiB at the end of the calls, "
          f"{(left - idle) / mib:+.1f} MiB 1 s after the clients closed")


@pytest.mark.slow
async def test_10000_calls_in_flight_on_one_connection(server: Server) -> None:
    async with tw.connect(server.address, config=CONFIG) as client:
        before = server.rss()
        for _ in range(2):
            results = await asyncio.gather(*(client.call("Store.echo", i) for i in range(10_000)))
            assert results == list(range(10_000))
        # The server runs at most 256 of them at once (max_concurrent_per_connection);
        # the rest wait on the client, not in the server's memory.
        assert server.rss() - before < 64 << 20, (before, server.rss())
