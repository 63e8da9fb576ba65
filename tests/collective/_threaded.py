"""Ranks as threads: each a SyncGroup with its own background loop and real
tcp:// connections on loopback, for tests that need many ranks cheaply."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from tensorwire.collective import GroupConfig, SyncGroup, serve_rendezvous

CONFIG = GroupConfig(timeout=20, rendezvous_timeout=20)


@contextlib.asynccontextmanager
async def thread_ranks(world: int, config: GroupConfig = CONFIG) -> AsyncIterator[list[SyncGroup]]:
    server, master = await serve_rendezvous("tcp://127.0.0.1:0", world)
    try:
        made = await asyncio.gather(*(asyncio.to_thread(
            SyncGroup.create, rank=r, world_size=world, master=master, host_master=False,
            listen="tcp://127.0.0.1:0", config=config) for r in range(world)))
        try:
            yield list(made)
        finally:
            await asyncio.gather(*(asyncio.to_thread(g.close) for g in made))
    finally:
        await server.close(grace=0)


def each(groups: list[SyncGroup], call: Callable[[SyncGroup], Any]) -> list[Any]:
    """``call(group)`` on every rank at once; the results in rank order."""
    with concurrent.futures.ThreadPoolExecutor(len(groups)) as pool:
        return list(pool.map(call, groups))
