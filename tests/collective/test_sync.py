"""SyncGroup: blocking collectives, each rank a thread with its own background loop.

The ranks are threads of this process (each SyncGroup runs its own event
loop thread and real tcp:// connections on loopback), so a test calls every
rank's blocking method at once from a thread pool, as separate processes
would.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from tensorwire.collective import SyncGroup
from tensorwire.errors import FailedPrecondition, InvalidArgument

from ._threaded import each, thread_ranks

WORLD = 3


@pytest.fixture
async def groups() -> AsyncIterator[list[SyncGroup]]:
    async with thread_ranks(WORLD) as made:
        yield made


async def test_blocking_operations(groups: list[SyncGroup]) -> None:
    def work(g: SyncGroup) -> dict[str, Any]:
        r = g.rank
        out: dict[str, Any] = {}
        out["sum"] = g.allreduce(np.full(5, r + 1.0)).copy()
        x = np.full(3, float(r))
        out["src"] = g.broadcast(x, src=1).copy()
        y = np.full(2, float(r))
        out["root"] = g.broadcast(y, 2).copy()
        parts = [np.empty(2) for _ in range(WORLD)]
        g.all_gather(parts, np.full(2, float(r)))
        out["all_gather"] = [p.copy() for p in parts]
        gl = [np.empty(2) for _ in range(WORLD)] if r == 1 else None
        got = g.gather(np.full(2, r * 10.0), gl, dst=1)
        out["gather"] = None if got is None else [p.copy() for p in got]
        sc = np.empty(4)
        g.scatter(sc, [np.full(4, i * 2.0) for i in range(WORLD)] if r == 0 else None, src=0)
        out["scatter"] = sc.copy()
        future = g.submit_allreduce(np.ones(7), "max")
        out["submitted"] = future.result().copy()
        g.barrier()
        return out

    results = each(groups, work)
    for r, out in enumerate(results):
        np.testing.assert_array_equal(out["sum"], np.full(5, 6.0))
        np.testing.assert_array_equal(out["src"], np.full(3, 1.0))
        np.testing.assert_array_equal(out["root"], np.full(2, 2.0))
        for i, part in enumerate(out["all_gather"]):
            np.testing.assert_array_equal(part, np.full(2, float(i)))
        if r == 1:
            assert [p[0] for p in out["gather"]] == [0.0, 10.0, 20.0]
        else:
            assert out["gather"] is None
        np.testing.assert_array_equal(out["scatter"], np.full(4, r * 2.0))
        np.testing.assert_array_equal(out["submitted"], np.ones(7))


async def test_point_to_point(groups: list[SyncGroup]) -> None:
    def work(g: SyncGroup) -> Any:
        if g.rank == 0:
            g.send(np.arange(4.0), 2, tag=5)
            return None
        if g.rank == 2:
            return g.recv(np.empty(4), 0, tag=5).copy()
        return None

    results = each(groups, work)
    np.testing.assert_array_equal(results[2], np.arange(4.0))


async def test_torch_spellings_are_checked(groups: list[SyncGroup]) -> None:
    g = groups[0]
    with pytest.raises(InvalidArgument, match="disagree"):
        g.broadcast(np.zeros(2), 1, src=2)
    with pytest.raises(InvalidArgument, match="tensor_list"):
        g.all_gather([np.zeros(2)], np.zeros(2))
    with pytest.raises(InvalidArgument, match="gather_list"):
        g.gather(np.zeros(2), [np.zeros(3)] * WORLD, dst=0)


async def test_closed_facade_refuses_calls(groups: list[SyncGroup]) -> None:
    await asyncio.gather(*(asyncio.to_thread(g.close) for g in groups))
    with pytest.raises(FailedPrecondition):
        groups[0].allreduce(np.zeros(2))
