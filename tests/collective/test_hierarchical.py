"""Hierarchical collectives on loopback, with a declared topology
(``GroupConfig.topology``) standing in for several hosts: ranks in one event
loop, real sockets. Across emulated hosts: tests/multihost/test_topology.py."""

from __future__ import annotations

import asyncio
import dataclasses
import tracemalloc
from typing import Any

import numpy as np
import pytest

from tensorwire.collective import Group, GroupConfig, ReduceOp, serve_rendezvous
from tensorwire.collective._runtime import Runtime
from tensorwire.errors import ConfigError, InvalidArgument
from tensorwire.timeline import Timeline

#: Uneven hosts, and ranks placed round robin as well as contiguously.
TOPOLOGIES = {
    3: {"a": [0, 2], "b": [1]},
    4: {"a": [0, 1], "b": [2, 3]},
    5: {"a": [0, 3], "b": [1, 4], "c": [2]},
    6: {"a": [0, 1, 2], "b": [3], "c": [4, 5]},
}
BASE = GroupConfig(timeout=30, rendezvous_timeout=20, small_bytes=1 << 10,
                   segment_bytes=16 << 10, hierarchical_bytes=1 << 10)
REDUCTIONS = {
    ReduceOp.SUM: lambda xs: np.sum(xs, axis=0),
    ReduceOp.MIN: lambda xs: np.min(xs, axis=0),
    ReduceOp.MAX: lambda xs: np.max(xs, axis=0),
    ReduceOp.PRODUCT: lambda xs: np.prod(xs, axis=0),
    ReduceOp.AVG: lambda xs: np.mean(xs, axis=0),
}


async def make_groups(topology: dict[str, list[int]],
                      config: GroupConfig = BASE) -> tuple[list[Group], list[Timeline], Any]:
    n = sum(len(r) for r in topology.values())
    server, master = await serve_rendezvous("tcp://127.0.0.1:0", n)
    timelines = [Timeline() for _ in range(n)]
    groups = await asyncio.gather(*(
        Group.create(rank=r, world_size=n, master=master, listen="tcp://127.0.0.1:0",
                     host_master=False,
                     config=dataclasses.replace(config, topology=topology, timeline=timelines[r]))
        for r in range(n)
    ))
    return list(groups), timelines, server


def data(rank: int, case: int, count: int, dtype: str) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(rank * 7919 + case)
    if dtype.startswith("int"):
        return rng.integers(-3, 4, count).astype(dtype)
    return rng.standard_normal(count).astype(dtype)


def close(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any]) -> None:
    if want.dtype.kind in "iu":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-4 if want.dtype == np.float32 else 1e-12,
                                   atol=1e-5)


@pytest.mark.parametrize("n", sorted(TOPOLOGIES))
async def test_hierarchical_operations_match_numpy(n: int) -> None:
    groups, timelines, server = await make_groups(TOPOLOGIES[n])
    try:
        assert all(g.topology == TOPOLOGIES[n] for g in groups)
        case = 0
        for count in (1, 1009, 40_000):  # one item, a prime, several segments
            for dtype in ("int32", "int64", "float32", "float64"):
                case += 1
                inputs = [data(r, case, count, dtype) for r in range(n)]
                for op, reference in REDUCTIONS.items():
                    if op is ReduceOp.AVG and dtype.startswith("int"):
                        continue
                    xs = [x.copy() for x in inputs]
                    got = await asyncio.gather(*(
                        g.allreduce(x, op, algorithm="hierarchical")
                        for g, x in zip(groups, xs, strict=True)))
                    assert all(a is b for a, b in zip(got, xs, strict=True))
                    close(xs[0], reference(np.stack(inputs)).astype(dtype))
                    for x in xs[1:]:  # bitwise identical everywhere
                        assert x.tobytes() == xs[0].tobytes(), (op, dtype, count)
                root = case % n
                xs = [x.copy() for x in inputs]
                await asyncio.gather(*(g.broadcast(x, root, algorithm="hierarchical")
                                       for g, x in zip(groups, xs, strict=True)))
                for x in xs:
                    np.testing.assert_array_equal(x, inputs[root])
                parts = await asyncio.gather(*(g.allgather(inputs[g.rank],
                                                           algorithm="hierarchical")
                                               for g in groups))
                for p in parts:
                    np.testing.assert_array_equal(p, np.stack(inputs))
        # Every root, with the automatic choice on a large enough message.
        for root in range(n):
            xs = [np.full(5000, r, np.int64) if r == root else np.zeros(5000, np.int64)
                  for r in range(n)]
            await asyncio.gather(*(g.broadcast(x, root) for g, x in zip(groups, xs, strict=True)))
            assert all(int(x.sum()) == 5000 * root for x in xs)
        xs = [np.full(5000, r + 1.0) for r in range(n)]
        await asyncio.gather(*(g.allreduce(x) for g, x in zip(groups, xs, strict=True)))
        assert all(float(x[-1]) == n * (n + 1) / 2 for x in xs)
        small = [np.ones(3) for _ in range(n)]  # at most hierarchical_bytes: flat
        await asyncio.gather(*(g.allreduce(x) for g, x in zip(groups, small, strict=True)))
        calls = [e["args"]["call"] for e in timelines[0].events]
        assert calls[-1].startswith("allreduce(") and "hierarchical" not in calls[-1]
        assert calls[-2].endswith(",hierarchical)")
        assert calls[-3].startswith("broadcast(") and calls[-3].endswith(",hierarchical)")
    finally:
        await asyncio.gather(*(g.close() for g in groups))
        await server.close(grace=0)


async def test_auto_stays_flat_where_the_hierarchy_cannot_help() -> None:
    # One rank per host: the leaders' ring is the flat ring, nothing to gain.
    groups, timelines, server = await make_groups({"a": [0], "b": [1], "c": [2]})
    try:
        await asyncio.gather(*(g.allreduce(np.ones(10_000)) for g in groups))
        await asyncio.gather(*(g.allreduce(np.ones(10_000), algorithm="ring") for g in groups))
        calls = [e["args"]["call"] for e in timelines[0].events]
        assert not any("hierarchical" in c for c in calls), calls
        with pytest.raises(InvalidArgument, match="algorithm"):
            groups[0].reduce(np.ones(3), algorithm="hierarchical")
    finally:
        await asyncio.gather(*(g.close() for g in groups))
        await server.close(grace=0)


async def test_hierarchical_allreduce_does_not_copy_its_payload() -> None:
    config = dataclasses.replace(BASE, timeout=60, segment_bytes=1 << 20)
    groups, _, server = await make_groups({"a": [0, 1], "b": [2, 3]}, config)
    payload = 16 << 20
    xs = [np.ones(payload // 4, np.float32) for _ in groups]
    try:
        tracemalloc.start()
        await asyncio.gather(*(g.allreduce(x) for g, x in zip(groups, xs, strict=True)))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        for x in xs:
            assert float(x[0]) == 4.0 and float(x[-1]) == 4.0
        # Four ranks in this process: a segment of scratch each, not 4 x 16 MiB.
        assert peak < 12 << 20, f"peak {peak / 2**20:.1f} MiB while reducing 4 x 16 MiB"
    finally:
        await asyncio.gather(*(g.close() for g in groups))
        await server.close(grace=0)


@pytest.mark.parametrize("topology", [{"a": [0, 1], "b": [1, 2]}, {"a": [0], "b": [2]},
                                      {"a": "x"}])
def test_a_bad_topology_is_refused(topology: Any) -> None:
    with pytest.raises(ConfigError, match="topology"):
        GroupConfig(topology=topology)


async def test_a_topology_of_another_world_size_is_refused() -> None:
    with pytest.raises(ConfigError, match="places 2 ranks"):
        await Group.create(rank=0, world_size=3, master="tcp://127.0.0.1:1",
                           config=GroupConfig(topology={"a": [0], "b": [1]}))


def test_hosts_are_told_apart_by_name_and_listen_address() -> None:
    runtime = Runtime(0, 4, GroupConfig())
    runtime.members = [
        {"host": "node", "data": "tcp://10.0.0.1:4000"},
        {"host": "node", "data": "tcp://10.0.0.1:4001"},
        {"host": "node", "data": "tcp://10.0.0.2:4000"},  # a clone with the same name
        {"host": "other", "data": "ucx://[fe80::1]:4000"},
    ]
    assert runtime.hosts() == ["node@10.0.0.1", "node@10.0.0.1", "node@10.0.0.2", "other"]
