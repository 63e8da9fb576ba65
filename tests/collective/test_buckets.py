"""Bucketed allreduce with priorities (``Group.allreduce_many``): ranks in one
event loop, real sockets on loopback."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np
import pytest

from tensorwire.collective import Group, GroupConfig, ReduceOp, serve_rendezvous
from tensorwire.errors import InvalidArgument, MismatchError
from tensorwire.timeline import Timeline

CONFIG = GroupConfig(timeout=20, rendezvous_timeout=20, small_bytes=4 << 10,
                     segment_bytes=16 << 10)


async def make_groups(n: int, **config: Any) -> tuple[list[Group], list[Timeline], Any]:
    server, master = await serve_rendezvous("tcp://127.0.0.1:0", n)
    timelines = [Timeline() for _ in range(n)]
    groups = await asyncio.gather(*(
        Group.create(rank=r, world_size=n, master=master, listen="tcp://127.0.0.1:0",
                     host_master=False,
                     config=dataclasses.replace(CONFIG, timeline=timelines[r], **config))
        for r in range(n)))
    return list(groups), timelines, server


def layers(rank: int) -> list[np.ndarray[Any, Any]]:
    """A model's gradients as the backward pass yields them: last layer first."""
    rng = np.random.default_rng(rank)
    shapes = [(300,), (20, 30), (5000,), (7,), (0,), (2000,), (64, 64), (11,), (1,)]
    grads: list[np.ndarray[Any, Any]] = [rng.standard_normal(s).astype(np.float32)
                                         for s in shapes]
    grads.insert(4, rng.integers(-5, 5, 900).astype(np.int64))  # another dtype
    return grads


@pytest.mark.parametrize(("n", "topology"), [(3, None), (4, {"a": [0, 1], "b": [2, 3]})])
async def test_buckets_match_numpy_and_finish_in_priority_order(
        n: int, topology: dict[str, list[int]] | None) -> None:
    groups, timelines, server = await make_groups(n, topology=topology,
                                                  hierarchical_bytes=1 << 10)
    try:
        inputs = [layers(r) for r in range(n)]
        count = len(inputs[0])
        # The forward pass needs the last gradient of the list first.
        priorities = list(reversed(range(count)))
        grads = [[g.copy() for g in gs] for gs in inputs]
        finished: list[int] = []
        futures = []
        for rank, g in enumerate(groups):
            mine = g.allreduce_many(grads[rank], priorities=priorities, bucket_bytes=8 << 10)
            if rank == 0:
                for i, f in enumerate(mine):
                    f.add_done_callback(lambda _, i=i: finished.append(i))
            futures.append(mine)
        results = await asyncio.gather(*(asyncio.gather(*fs) for fs in futures))
        for rank in range(n):
            for i in range(count):
                assert results[rank][i] is grads[rank][i]
                want = np.sum([inputs[r][i] for r in range(n)], axis=0)
                np.testing.assert_allclose(grads[rank][i], want, rtol=1e-5, atol=1e-5)
                assert grads[rank][i].tobytes() == grads[0][i].tobytes()
        # Most urgent first (the buckets queue in that order; a bucket's arrays
        # finish together).
        assert [priorities[i] for i in finished] == sorted(priorities[i] for i in finished)
        calls = [e["args"]["call"] for e in timelines[0].events]
        assert len(calls) < count, "small arrays were fused"
        assert any(c.startswith("allreduce_bucket(") for c in calls)
        assert any(c.startswith("allreduce(<f4[5000]") for c in calls), "a large one alone"
        if topology is not None:
            assert any("hierarchical" in c for c in calls)
        # Default priorities: the list order.
        xs = [[np.full(10, float(r)), np.full(20, float(r))] for r in range(n)]
        done = await asyncio.gather(*(asyncio.gather(*g.allreduce_many(x, ReduceOp.MAX))
                                      for g, x in zip(groups, xs, strict=True)))
        assert all(float(d[1][0]) == n - 1 for d in done)
    finally:
        await asyncio.gather(*(g.close() for g in groups))
        await server.close(grace=0)


async def test_ranks_that_bucket_differently_get_a_mismatch() -> None:
    groups, _, server = await make_groups(2)
    try:
        xs = [[np.ones(10), np.ones(20)] for _ in groups]
        outcome = await asyncio.gather(
            asyncio.gather(*groups[0].allreduce_many(xs[0], priorities=[0, 1])),
            asyncio.gather(*groups[1].allreduce_many(xs[1], priorities=[1, 0])),
            return_exceptions=True)
        assert all(isinstance(o, MismatchError) for o in outcome), outcome
    finally:
        await asyncio.gather(*(g.close() for g in groups))
        await server.close(grace=0)


async def test_allreduce_many_checks_its_arguments() -> None:
    groups, _, server = await make_groups(1)
    (group,) = groups
    try:
        with pytest.raises(InvalidArgument, match="priorities"):
            group.allreduce_many([np.ones(3)], priorities=[0, 1])
        with pytest.raises(InvalidArgument, match="bucket_bytes"):
            group.allreduce_many([np.ones(3)], bucket_bytes=0)
        with pytest.raises(InvalidArgument, match="algorithm"):
            group.allreduce_many([np.ones(3)], algorithm="nope")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="AVG"):
            group.allreduce_many([np.ones(3, np.int32)], ReduceOp.AVG)
        assert await asyncio.gather(*group.allreduce_many([])) == []
    finally:
        await group.close()
        await server.close(grace=0)
