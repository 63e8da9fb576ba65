"""Groups whose ranks share one event loop: API, bad input, rendezvous errors,
zero-copy receives. Real sockets on loopback; the multi-process cases are in
test_processes.py."""

from __future__ import annotations

import asyncio
import importlib.util
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from tensorwire.collective import Group, GroupConfig, ReduceOp, serve_rendezvous
from tensorwire.collective._environment import EnvSettings, env_settings
from tensorwire.errors import (
    AlreadyExists,
    CollectiveError,
    CollectiveTimeout,
    ConfigError,
    InvalidArgument,
    MismatchError,
    TensorwireError,
)

FAST = GroupConfig(timeout=20, rendezvous_timeout=20)


async def make_groups(n: int, listen: str = "tcp://127.0.0.1:0",
                      config: GroupConfig = FAST) -> tuple[list[Group], Any]:
    server, master = await serve_rendezvous("tcp://127.0.0.1:0", n)
    groups = await asyncio.gather(*(
        Group.create(rank=r, world_size=n, master=master, listen=listen, host_master=False,
                     config=config) for r in range(n)
    ))
    return list(groups), server


@pytest.fixture
async def trio() -> AsyncIterator[list[Group]]:
    groups, server = await make_groups(3)
    yield groups
    await asyncio.gather(*(g.close() for g in groups))
    await server.close(grace=0)


async def test_ranks_in_one_loop() -> None:
    groups, server = await make_groups(3)
    try:
        xs = [np.arange(10.0) * (g.rank + 1) for g in groups]
        results = await asyncio.gather(*(g.allreduce(x) for g, x in zip(groups, xs, strict=True)))
        for x, result in zip(xs, results, strict=True):
            assert result is x
            np.testing.assert_array_equal(x, np.arange(10.0) * 6)
        parts = await asyncio.gather(*(g.allgather(np.full(2, g.rank)) for g in groups))
        for p in parts:
            np.testing.assert_array_equal(p, [[0, 0], [1, 1], [2, 2]])
        assert [g.rank for g in groups] == [0, 1, 2]
        assert all(g.world_size == 3 for g in groups)
    finally:
        await asyncio.gather(*(g.close() for g in groups))
        await server.close(grace=0)


async def test_a_group_of_one_needs_no_peers() -> None:
    groups, server = await make_groups(1)
    (group,) = groups
    x = np.arange(5.0)
    assert await group.allreduce(x, ReduceOp.AVG) is x
    np.testing.assert_array_equal(x, np.arange(5.0))
    np.testing.assert_array_equal(await group.allgather(x), [np.arange(5.0)])
    await group.barrier()
    await group.close()
    await server.close(grace=0)


async def test_received_data_lands_in_the_callers_array(trio: list[Group]) -> None:
    outs = [np.zeros((3, 1 << 18), np.float32) for _ in trio]
    got = await asyncio.gather(*(
        g.allgather(np.full(1 << 18, g.rank, np.float32), out=out, algorithm="ring")
        for g, out in zip(trio, outs, strict=True)
    ))
    for result, out in zip(got, outs, strict=True):
        assert result is out
        np.testing.assert_array_equal(out, np.repeat(np.arange(3.0), 1 << 18).reshape(3, -1))


async def test_a_large_allreduce_does_not_copy_its_payload() -> None:
    # Scratch is one reduction segment; the payload itself is never copied.
    config = GroupConfig(timeout=60, rendezvous_timeout=20, segment_bytes=1 << 20)
    groups, server = await make_groups(2, config=config)
    payload = 32 << 20
    xs = [np.ones(payload // 4, np.float32) for _ in groups]
    try:
        tracemalloc.start()
        await asyncio.gather(*(g.allreduce(x) for g, x in zip(groups, xs, strict=True)))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        for x in xs:
            assert float(x[0]) == 2.0 and float(x[-1]) == 2.0
        # Both ranks in this process: two segments of scratch, not 2 x 32 MiB.
        assert peak < 8 << 20, f"peak {peak / 2**20:.1f} MiB while reducing 2 x 32 MiB"
    finally:
        await asyncio.gather(*(g.close() for g in groups))
        await server.close(grace=0)


@pytest.mark.parametrize("scheme", ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed"))])
async def test_exchanges_larger_than_the_socket_buffers_do_not_deadlock(scheme: str) -> None:
    # Both ranks post 16 MiB to each other before either receives: more
    # than the kernel buffers (tcp://) or an eager send (ucx://, a
    # rendezvous) hold, so each send can finish only while the other rank
    # receives. Recursive doubling (forced by small_bytes) and alltoall
    # run on Links.exchange.
    config = GroupConfig(timeout=60, rendezvous_timeout=20, small_bytes=64 << 20)
    groups, server = await make_groups(2, listen=f"{scheme}://127.0.0.1:0", config=config)
    count = 4 << 20  # float32: 16 MiB
    try:
        xs = [np.full(count, g.rank + 1, np.float32) for g in groups]
        xs[1][-1] = 7
        await asyncio.wait_for(asyncio.gather(*(
            g.allreduce(x) for g, x in zip(groups, xs, strict=True))), 50)
        for x in xs:
            assert float(x[0]) == 3.0 and float(x[-1]) == 8.0
        assert all(g.metrics()["allreduce"]["bytes_out"] == count * 4 for g in groups)
        sent = [np.arange(2 * count, dtype=np.float32).reshape(2, -1) + g.rank * 10
                for g in groups]
        got = await asyncio.wait_for(asyncio.gather(*(
            g.alltoall(a) for g, a in zip(groups, sent, strict=True))), 50)
        for rank, result in enumerate(got):
            np.testing.assert_array_equal(result, np.stack([sent[0][rank], sent[1][rank]]))
    finally:
        await asyncio.gather(*(g.close() for g in groups))
        await server.close(grace=0)


#: Segments of 1024 float32 (the smallest allowed), so that the blocks
#: below travel in several segments, the last one short.
SEGMENTED = GroupConfig(timeout=20, rendezvous_timeout=20, small_bytes=4 << 10,
                        segment_bytes=4 << 10)


@pytest.mark.parametrize("n", [2, 3, 5])
async def test_pipelined_ring_allreduce_equals_numpy_on_uneven_blocks(n: int) -> None:
    # Sizes that no world size divides: the blocks differ by one item, each
    # block is several segments and the last segment of each is short, and
    # (n - 1) steps of each half pass them on. Issue 25.
    groups, server = await make_groups(n, config=SEGMENTED)
    try:
        for size, dtype, op in [(5003, np.float32, ReduceOp.SUM),
                                (7919, np.float64, ReduceOp.AVG),
                                (4099, np.int64, ReduceOp.SUM),
                                (n, np.float32, ReduceOp.AVG)]:
            rng = np.random.default_rng(size + n)
            xs = [rng.integers(-1000, 1000, size).astype(dtype) for _ in groups]
            want = np.sum(xs, axis=0) if op is ReduceOp.SUM else np.mean(xs, axis=0)
            await asyncio.gather(*(g.allreduce(x, op, algorithm="ring")
                                   for g, x in zip(groups, xs, strict=True)))
            for x in xs:
                np.testing.assert_allclose(x, want, rtol=1e-6)
                # Every rank ends with the same bits: the allgather copies.
                assert x.tobytes() == xs[0].tobytes()
    finally:
        await asyncio.gather(*(g.close() for g in groups))
        await server.close(grace=0)


async def test_pooled_scratch_survives_operations_of_other_sizes_and_dtypes() -> None:
    # One scratch buffer serves consecutive operations of every size and
    # dtype (ring, recursive doubling, tree reduce); none may see another's
    # leftovers, and the pool must keep reusing, not grow. Issue 25.
    groups, server = await make_groups(3, config=SEGMENTED)
    pools = [g._links.scratch for g in groups]
    for pool in pools:
        pool.smallest = 0  # every size pooled here, the smallest included
    try:
        plan = [(9001, np.float32, "allreduce"), (37, np.float64, "allreduce"),
                (2500, np.int16, "allreduce"), (6001, np.float64, "reduce"),
                (9001, np.float32, "allreduce"), (513, np.float16, "allreduce"),
                (1, np.int32, "allreduce")]
        kept: list[set[int]] = []
        for round_, (size, dtype, what) in enumerate(plan * 2):
            xs = [np.full(size, g.rank + 1 + round_, dtype) for g in groups]
            want = np.sum(xs, axis=0, dtype=dtype)
            if what == "allreduce":
                await asyncio.gather(*(g.allreduce(x) for g, x in zip(groups, xs, strict=True)))
                for x in xs:
                    np.testing.assert_array_equal(x, want)
            else:
                await asyncio.gather(*(g.reduce(x, root=1, algorithm="tree")
                                       for g, x in zip(groups, xs, strict=True)))
                np.testing.assert_array_equal(xs[1], want)
            kept.append({id(b) for pool in pools for b in pool._free["cpu"]})
            assert all(len(pool._free["cpu"]) <= pool.keep for pool in pools)
        # The second pass over the plan allocates nothing new.
        assert set.union(*kept[len(plan):]) <= set.union(*kept[:len(plan)])
    finally:
        await asyncio.gather(*(g.close() for g in groups))
        await server.close(grace=0)


async def test_small_scratch_is_not_pooled_and_large_scratch_is() -> None:
    # An allreduce of a few bytes takes fresh scratch from the allocator
    # (the pool's bookkeeping costs more than the allocation); one of a
    # segment's size and more reuses pooled scratch across operations.
    config = GroupConfig(timeout=20, rendezvous_timeout=20, segment_bytes=256 << 10)
    groups, server = await make_groups(2, config=config)
    pools = [g._links.scratch for g in groups]
    try:
        for _ in range(3):
            xs = [np.full(2, g.rank + 1, np.float32) for g in groups]
            await asyncio.gather(*(g.allreduce(x) for g, x in zip(groups, xs, strict=True)))
            assert all(x.tolist() == [3.0, 3.0] for x in xs)
        assert all(not pool._free.get("cpu") for pool in pools)
        kept = []
        for _ in range(3):
            xs = [np.full(256 << 10, g.rank + 1, np.float32) for g in groups]
            await asyncio.gather(*(g.allreduce(x) for g, x in zip(groups, xs, strict=True)))
            assert all(float(x.min()) == float(x.max()) == 3.0 for x in xs)
            kept.append({id(b) for pool in pools for b in pool._free["cpu"]})
        assert kept[0] and kept[1] == kept[0] and kept[2] == kept[0]
    finally:
        await asyncio.gather(*(g.close() for g in groups))
        await server.close(grace=0)


async def test_bad_arguments_are_refused_before_anything_is_sent(trio: list[Group]) -> None:
    group = trio[0]
    with pytest.raises(InvalidArgument, match="NumPy array"):
        group.allreduce([1.0, 2.0])
    with pytest.raises(InvalidArgument, match="contiguous"):
        group.allreduce(np.zeros((4, 4))[:, 1])
    readonly = np.zeros(4)
    readonly.flags.writeable = False
    with pytest.raises(InvalidArgument, match="read-only"):
        group.allreduce(readonly)
    with pytest.raises(InvalidArgument, match="floating"):
        group.allreduce(np.zeros(4, np.int32), ReduceOp.AVG)
    with pytest.raises(InvalidArgument, match="unknown reduction"):
        group.allreduce(np.zeros(4), "median")
    with pytest.raises(InvalidArgument, match="root"):
        group.broadcast(np.zeros(4), root=3)
    with pytest.raises(InvalidArgument, match="algorithm"):
        group.allreduce(np.zeros(4), algorithm="butterfly")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="shape"):
        group.alltoall(np.zeros((2, 4)))
    with pytest.raises(InvalidArgument, match="object"):
        group.allreduce(np.array([None, 1], dtype=object))
    with pytest.raises(InvalidArgument, match="another rank"):
        await group.send(np.zeros(1), 0)
    fortran = np.asfortranarray(np.zeros((2, 3)))
    with pytest.raises(InvalidArgument, match="C-ordered"):
        group.allgather(fortran)
    with pytest.raises(InvalidArgument, match="C-ordered"):
        group.gather(fortran)
    with pytest.raises(InvalidArgument, match="C-ordered"):
        group.scatter(fortran)
    with pytest.raises(InvalidArgument, match="timeout"):
        await group.recv(np.zeros(1), 1, timeout=0)
    # Nothing was queued: the group still runs the next operation on every rank.
    xs = [np.ones(3) for _ in trio]
    await asyncio.gather(*(g.allreduce(x) for g, x in zip(trio, xs, strict=True)))
    assert all((x == 3).all() for x in xs)


async def test_point_to_point_checks_tags_and_deadlines(trio: list[Group]) -> None:
    a, b, _ = trio
    out = np.empty(4)
    with pytest.raises(CollectiveTimeout, match="nothing from rank 0") as timed_out:
        await b.recv(out, 0, timeout=0.3)
    assert timed_out.value.ranks == (0,)
    await a.send(np.arange(4.0), 1, tag=5)
    # Delivered by tag: a receive of another tag waits for its own message,
    # and the tag-5 message waits for its receive.
    with pytest.raises(CollectiveTimeout, match="tag 6"):
        await b.recv(out, 0, tag=6, timeout=0.3)
    assert await b.recv(out, 0, tag=5) is out
    np.testing.assert_array_equal(out, np.arange(4.0))
    # A message of the right tag but another shape is a mismatch.
    await a.send(np.arange(3.0), 1, tag=8)
    with pytest.raises(MismatchError, match="tag 8") as mismatch:
        await b.recv(out, 0, tag=8)
    assert mismatch.value.ranks == (0,)
    # The pair carries on with the next message.
    await a.send(np.arange(4.0) + 1, 1, tag=7)
    assert await b.recv(out, 0, tag=7) is out
    np.testing.assert_array_equal(out, np.arange(4.0) + 1)


async def test_each_operation_gets_its_own_deadline_from_its_start() -> None:
    # One loop timer watches the deadlines (_oplog): the timer armed for an
    # early operation fires while a later one runs, and must not cut that
    # one short; an operation that never completes still times out in time.
    groups, server = await make_groups(2, config=GroupConfig(timeout=0.4, rendezvous_timeout=20))
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        xs = [np.ones(8) for _ in groups]
        rounds = 0
        while loop.time() - started < 1.5:  # several deadlines' worth of operations
            await asyncio.gather(*(g.allreduce(x) for g, x in zip(groups, xs, strict=True)))
            rounds += 1
            await asyncio.sleep(0.05)
        assert all((x == 2.0 ** rounds).all() for x in xs)
        alone = loop.time()
        with pytest.raises(CollectiveTimeout, match=r"within 0\.4 s"):
            await groups[0].allreduce(np.ones(8))  # rank 1 never comes
        assert 0.35 < loop.time() - alone < 5
    finally:
        await asyncio.gather(*(g.close() for g in groups), return_exceptions=True)
        await server.close(grace=0)


async def test_a_deadline_after_one_whose_cancel_was_absorbed_still_times_out() -> None:
    # An operation whose body absorbs its deadline's cancel and returns (as
    # Python 3.11's asyncio.wait_for can when its result comes at that
    # moment) ends normally; the deadline's cancel must be taken back all
    # the same, or the next operation's deadline reads as close()'s cancel.
    groups, server = await make_groups(1, config=GroupConfig(timeout=0.2, rendezvous_timeout=20))
    (group,) = groups
    log = group._log

    async def absorbs(op: Any) -> str:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            return "absorbed"
        return "slept"

    async def hangs(op: Any) -> None:
        await asyncio.sleep(5)

    try:
        first = log.submit("absorbs()", absorbs, None)
        second = log.submit("hangs()", hangs, None)
        assert await asyncio.wait_for(first, 10) == "absorbed"
        with pytest.raises(CollectiveTimeout, match=r"hangs\(\) #1 .* within 0\.2 s"):
            await asyncio.wait_for(second, 10)
        assert isinstance(log.failed, CollectiveTimeout)
    finally:
        await group.close()
        await server.close(grace=0)


async def test_cancelling_the_wait_does_not_withdraw_the_operation(trio: list[Group]) -> None:
    xs = [np.ones(100) for _ in trio]
    works = [g.allreduce(x) for g, x in zip(trio, xs, strict=True)]
    works[0].cancel()  # the caller stops waiting; the ranks still run it
    await asyncio.gather(*works[1:])
    # The next operation lines up on every rank, so the first one ran there too.
    await asyncio.gather(*(g.barrier() for g in trio))
    assert all((x == 3).all() for x in xs)


async def test_a_closed_group_refuses_operations() -> None:
    groups, server = await make_groups(2)
    await asyncio.gather(*(g.close() for g in groups))
    await server.close(grace=0)
    with pytest.raises(CollectiveError, match="closed"):
        groups[0].allreduce(np.zeros(1))


async def test_a_taken_rank_is_refused() -> None:
    server, master = await serve_rendezvous("tcp://127.0.0.1:0", 2)
    config = GroupConfig(rendezvous_timeout=2)
    try:
        outcomes = await asyncio.gather(*(
            Group.create(rank=0, world_size=2, master=master, listen="tcp://127.0.0.1:0",
                         host_master=False, config=config) for _ in range(2)
        ), return_exceptions=True)
    finally:
        await server.close(grace=0)
    # One of the two is told its rank is taken; the other waits in vain for rank 1.
    taken = [o for o in outcomes if isinstance(o, AlreadyExists)]
    assert len(taken) == 1 and "same rank" in str(taken[0])
    assert all(isinstance(o, TensorwireError) for o in outcomes)


async def test_disagreeing_world_sizes_are_refused() -> None:
    server, master = await serve_rendezvous("tcp://127.0.0.1:0", 2)
    try:
        with pytest.raises(InvalidArgument, match="world size 3"):
            await Group.create(rank=1, world_size=3, master=master, listen="tcp://127.0.0.1:0",
                               host_master=False, config=GroupConfig(rendezvous_timeout=5))
    finally:
        await server.close(grace=0)


async def test_a_rank_that_never_comes_times_out_the_rendezvous() -> None:
    server, master = await serve_rendezvous("tcp://127.0.0.1:0", 2)
    try:
        with pytest.raises(TensorwireError):
            await Group.create(rank=0, world_size=2, master=master, listen="tcp://127.0.0.1:0",
                               host_master=False, config=GroupConfig(rendezvous_timeout=0.5))
    finally:
        await server.close(grace=0)


async def test_rank_zero_hosts_the_rendezvous_itself() -> None:
    group = await Group.create(rank=0, world_size=1, master="tcp://127.0.0.1:0",
                               listen="tcp://127.0.0.1:0", config=FAST)
    x = np.full(4, 2.0)
    await group.allreduce(x)
    assert (x == 2).all()
    await group.close()


def test_environment_of_each_launcher() -> None:
    torchrun = {"RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    assert env_settings(torchrun) == EnvSettings(3, 8, "tcp://10.0.0.1:1234", None)
    agent = {**torchrun, "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert env_settings(agent).master == "tcp://10.0.0.1:1235"
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "MASTER_ADDR": "node1"}
    assert env_settings(slurm) == EnvSettings(1, 4, "tcp://node1:29500", None)
    mpi = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "::1"}
    assert env_settings(mpi).master == "tcp://[::1]:29500"
    bracketed = {**mpi, "MASTER_ADDR": "[fe80::1]"}
    assert env_settings(bracketed).master == "tcp://[fe80::1]:29500"
    launched = {"RANK": "0", "WORLD_SIZE": "2", "TENSORWIRE_MASTER": "tcp://h:7",
                "TENSORWIRE_MASTER_HOSTED": "1"}
    assert env_settings(launched) == EnvSettings(0, 2, "tcp://h:7", False)
    with pytest.raises(ConfigError, match="no rank"):
        env_settings({})
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        env_settings({"RANK": "0", "WORLD_SIZE": "1"})
    with pytest.raises(ConfigError, match="integers"):
        env_settings({"RANK": "zero", "WORLD_SIZE": "1", "MASTER_ADDR": "h"})


async def test_from_env_joins_a_group() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0",
           "TENSORWIRE_LISTEN": "tcp://127.0.0.1:0"}
    group = await Group.from_env(environ=env, config=FAST)
    assert (group.rank, group.world_size) == (0, 1)
    await group.close()


@pytest.mark.parametrize("bad", [
    {"timeout": 0}, {"rendezvous_timeout": -1}, {"small_bytes": -1}, {"segment_bytes": 100},
    {"heartbeat_interval": 5, "heartbeat_timeout": 2},
])
def test_config_is_validated(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        GroupConfig(**bad)


async def test_create_validates_its_arguments() -> None:
    with pytest.raises(ConfigError, match="rank"):
        await Group.create(rank=2, world_size=2, master="tcp://127.0.0.1:1")
    with pytest.raises(ConfigError, match="world_size"):
        await Group.create(rank=0, world_size=0, master="tcp://127.0.0.1:1")
    with pytest.raises(ConfigError, match="tcp://"):
        await Group.create(rank=0, world_size=1, master="ucx://127.0.0.1:1")
    with pytest.raises(ConfigError, match="inproc"):
        await Group.create(rank=0, world_size=1, master="tcp://127.0.0.1:1",
                           listen="inproc://group")
