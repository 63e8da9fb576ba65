"""The parameter server in one process over tcp:// and inproc://: API behaviour,
deadlines that name the workers behind, idempotent retries, checkpoints."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorwire as tw
from tensorwire import ps
from tensorwire.errors import (
    ConfigError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    PlacementMoved,
    ResourceExhausted,
    Unavailable,
)
from tensorwire.transports import Limits, TransportConfig

URLS = ["tcp://127.0.0.1:0", "inproc://ps-test*"]
PUSH = "tensorwire.ps.Shard.push"


@contextlib.asynccontextmanager
async def shards(count: int = 2, url: str = "tcp://127.0.0.1:0",
                 **options: Any) -> AsyncIterator[list[ps.ShardServer]]:
    started = []
    try:
        for i in range(count):
            where = url.replace("*", str(i))
            config = ps.ShardConfig(**{k: (v / str(i) if isinstance(v, Path) else v)
                                       for k, v in options.items()})
            started.append(await ps.serve(where, config=config))
        yield started
    finally:
        for shard in started:
            await shard.close(checkpoint=False)


async def workers(servers: list[ps.ShardServer], n: int, **options: Any) -> list[ps.PSClient]:
    options.setdefault("optimizer", ps.SGD(lr=0.5))
    config = options.pop("config", ps.PSConfig(chunk_bytes=256))
    addresses = [s.addresses[0] for s in servers]
    return [await ps.connect(addresses, worker=w, num_workers=n, config=config, **options)
            for w in range(n)]


def model() -> dict[str, np.ndarray]:
    return {"w": np.arange(200, dtype=np.float32).reshape(20, 10), "b": np.ones(5, np.float32)}


def ones(scale: float) -> dict[str, np.ndarray]:
    return {name: np.full_like(value, scale) for name, value in model().items()}


@pytest.mark.parametrize("url", URLS)
async def test_sync_push_then_pull_without_waiting_reads_after_the_push(url: str) -> None:
    async with shards(url=url) as servers:
        clients = await workers(servers, 2)
        await asyncio.gather(*(c.init(model()) for c in clients))
        # push() takes its clock when called, so this pull reads after it.
        pushes = [c.push(ones(float(i + 1))) for i, c in enumerate(clients)]
        pulled = await asyncio.gather(*(c.pull() for c in clients))
        await asyncio.gather(*pushes)
        for params in pulled:
            np.testing.assert_array_equal(params["w"], model()["w"] - 0.5 * 1.5)
            np.testing.assert_array_equal(params["b"], 1 - 0.5 * 1.5)
        assert clients[0].clock == 1
        for c in clients:
            await c.close()


async def test_a_shard_split_over_many_messages_computes_the_same() -> None:
    results = []
    for message_bytes in (256, 1 << 20):
        config = ps.PSConfig(chunk_bytes=256, message_bytes=message_bytes)
        async with shards() as servers:
            clients = await workers(servers, 2, config=config, optimizer=ps.Adam(lr=0.1))
            await asyncio.gather(*(c.init(model()) for c in clients))
            # Small tensors share one message per shard unless the limit splits them.
            messages = len(clients[0]._batches)
            assert messages == 2 if message_bytes > 1000 else messages >= 4
            for step in range(3):
                got = await asyncio.gather(*(c.push_pull(ones(float(i + step)))
                                             for i, c in enumerate(clients)))
            results.append(got[0])
            for c in clients:
                await c.close()
    for name, value in results[0].items():
        np.testing.assert_array_equal(results[1][name], value)


async def test_a_pull_deadline_names_the_workers_behind() -> None:
    async with shards() as servers:
        clients = await workers(servers, 3, config=ps.PSConfig(chunk_bytes=256, timeout=0.3))
        await asyncio.gather(*(c.init(model()) for c in clients))
        await asyncio.gather(clients[0].push(ones(1)), clients[2].push(ones(1)))
        with pytest.raises(DeadlineExceeded, match=r"workers \[1\]"):
            await clients[0].pull()
        for c in clients:
            await c.close()


async def test_ssp_deadline_names_the_slow_worker() -> None:
    async with shards(1) as servers:
        clients = await workers(servers, 2, consistency="ssp", staleness=1,
                                config=ps.PSConfig(timeout=0.3))
        await asyncio.gather(*(c.init(model()) for c in clients))
        await clients[0].push_pull(ones(1))       # clock 1: 1 ahead, allowed
        with pytest.raises(DeadlineExceeded, match=r"workers \[1\]"):
            await clients[0].push_pull(ones(1))   # clock 2: 2 ahead of worker 1
        for c in clients:
            await c.close()


async def test_a_retried_push_is_applied_once() -> None:
    async with shards(1) as servers:
        (client,) = await workers(servers, 1, consistency="async")
        await client.init({"w": np.zeros(4, np.float32)})
        async with tw.connect(servers[0].addresses[0]) as raw:
            payload = {"codec": "none", "data": np.ones(4, np.float32)}
            for _ in range(3):  # the original and two retries of (worker 0, clock 0, w#0)
                await raw.call(PUSH, 0, 0, ["w#0"], [payload], 0, 5.0)
            await raw.call(PUSH, 0, 1, ["w#0"], [payload], 0, 5.0)
        client.clock = 2
        np.testing.assert_array_equal((await client.pull())["w"], -1.0)
        (status,) = await client.status()
        assert status["updates"] == 2 and status["clocks"] == [2]
        await client.close()


async def test_a_sync_push_retried_after_its_step_completed_is_ignored() -> None:
    async with shards(1) as servers:
        clients = await workers(servers, 2)
        await asyncio.gather(*(c.init({"w": np.zeros(3, np.float32)}) for c in clients))
        await asyncio.gather(*(c.push_pull({"w": np.ones(3, np.float32)}) for c in clients))
        async with tw.connect(servers[0].addresses[0]) as raw:
            again = {"codec": "none", "data": np.full(3, 100, np.float32)}
            await raw.call(PUSH, 1, 0, ["w#0"], [again], 1, 5.0)
        (status,) = await clients[0].status()
        assert status["step"] == 1 and status["updates"] == 2
        for c in clients:
            await c.close()


async def test_worker_zero_values_win_and_late_workers_wait_for_them() -> None:
    async with shards() as servers:
        clients = await workers(servers, 2)
        late = asyncio.ensure_future(clients[1].init({k: v * 7 for k, v in model().items()}))
        first = await clients[0].init(model())
        second = await late
        for name, value in model().items():
            np.testing.assert_array_equal(first[name], value)
            np.testing.assert_array_equal(second[name], value)
        for c in clients:
            await c.close()


async def test_another_job_or_model_is_refused() -> None:
    async with shards(1) as servers:
        (client,) = await workers(servers, 1)
        await client.init(model())
        (other,) = await workers(servers, 1, optimizer=ps.Adam())
        with pytest.raises(FailedPrecondition, match="another job"):
            await other.init(model())
        (bigger,) = await workers(servers, 1)
        with pytest.raises(InvalidArgument):
            await bigger.init({"w": np.zeros((20, 11), np.float32), "b": np.ones(5, np.float32)})
        (wider,) = await workers(servers, 1)
        same_shapes = {name: value.astype(np.float64) for name, value in model().items()}
        with pytest.raises(InvalidArgument, match="float64"):
            await wider.init(same_shapes)
        for c in (client, other, bigger, wider):
            await c.close()


async def test_bad_arguments_fail_before_anything_is_sent() -> None:
    async with shards(1) as servers:
        (client,) = await workers(servers, 1)
        with pytest.raises(FailedPrecondition):
            client.pull()
        with pytest.raises(InvalidArgument):
            await client.init({"n": np.arange(3)})
        await client.init(model())
        with pytest.raises(InvalidArgument, match="shape"):
            client.push({"w": np.zeros(3, np.float32), "b": np.ones(5, np.float32)})
        with pytest.raises(InvalidArgument, match="missing"):
            client.push({"w": np.zeros((20, 10), np.float32)})
        assert client.clock == 0
        await client.close()
    with pytest.raises(ConfigError):
        await ps.connect(["tcp://127.0.0.1:1"], worker=3, num_workers=2,
                         optimizer=ps.SGD(lr=1))
    with pytest.raises(ConfigError):
        await ps.connect(["tcp://127.0.0.1:1"], worker=0, num_workers=2,
                         optimizer=ps.Aggregate(), consistency="async")


async def test_aggregate_returns_the_summed_gradient_each_step() -> None:
    async with shards() as servers:
        clients = await workers(servers, 3, optimizer=ps.Aggregate())
        await asyncio.gather(*(c.init(model()) for c in clients))
        for step in range(2):
            got = await asyncio.gather(*(c.push_pull(ones(float(i + step)))
                                         for i, c in enumerate(clients)))
            for params in got:
                np.testing.assert_array_equal(params["w"], 3.0 + 3 * step)
        for c in clients:
            await c.close()


@pytest.mark.parametrize("compression", ["bf16", "topk"])
async def test_compressed_pushes_arrive(compression: str) -> None:
    async with shards() as servers:
        (client,) = await workers(servers, 1, compression=compression,
                                  optimizer=ps.SGD(lr=1.0))
        await client.init({"w": np.zeros(1000, np.float32)})
        grad = np.zeros(1000, np.float32)
        grad[::100] = 2.0
        params = await client.push_pull({"w": grad})
        np.testing.assert_array_equal(params["w"], -grad)
        await client.close()


async def test_checkpoint_on_request_and_restore_on_restart(tmp_path: Path) -> None:
    async with shards(2, checkpoint_dir=tmp_path) as servers:
        addresses = [s.addresses[0] for s in servers]
        (client,) = await workers(servers, 1, optimizer=ps.Adam(lr=0.1))
        await client.init(model())
        await client.push_pull(ones(1.0))
        paths = await client.checkpoint()
        assert [Path(p).parent for p in paths] == [tmp_path / "0", tmp_path / "1"]
        expected = await client.push_pull(ones(-2.0))
        await client.checkpoint()
        await client.close()
    restarted = [await ps.serve(a, checkpoint_dir=tmp_path / str(i))
                 for i, a in enumerate(addresses)]
    try:
        config = ps.PSConfig(chunk_bytes=256)
        client = await ps.connect(addresses, worker=0, num_workers=1, config=config,
                                  optimizer=ps.Adam(lr=0.1))
        params = await client.init({k: v * 0 for k, v in model().items()})
        client.clock = 2
        for name, value in expected.items():
            np.testing.assert_array_equal(params[name], value)
        # Adam's moments came back too: one more step matches a run without restart.
        opt = ps.Adam(lr=0.1)
        reference = {}
        for name, value in model().items():
            state = opt.init_state(value)
            for step, g in enumerate((1.0, -2.0, 0.5), 1):
                value, state = opt.step(value, np.full_like(value, g), state, step)
            reference[name] = value
        after = await client.push_pull(ones(0.5))
        for name, value in reference.items():
            np.testing.assert_allclose(after[name], value, rtol=1e-6)
        assert all(s["restored_from"] for s in await client.status())
        await client.close()
    finally:
        for server in restarted:
            await server.close(checkpoint=False)


async def test_periodic_checkpoints_by_update_count(tmp_path: Path) -> None:
    async with shards(1, checkpoint_dir=tmp_path, checkpoint_every=2) as servers:
        (client,) = await workers(servers, 1)
        await client.init(model())
        for _ in range(4):
            await client.push_pull(ones(1.0))
        await client.status()
        await servers[0].shard.stop()  # lets a checkpoint being written finish
        assert list((tmp_path / "0").glob("ckpt-*.npz"))
        await client.close()


async def test_checkpoint_without_a_directory_is_refused() -> None:
    async with shards(1) as servers:
        (client,) = await workers(servers, 1)
        await client.init(model())
        with pytest.raises(FailedPrecondition):
            await client.checkpoint()
        await client.close()


def test_sync_client_from_plain_threads() -> None:
    async def start() -> list[ps.ShardServer]:
        return [await ps.serve("tcp://127.0.0.1:0") for _ in range(2)]

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servers = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    addresses = [s.addresses[0] for s in servers]
    results: dict[int, Any] = {}

    def worker(rank: int) -> None:
        with ps.SyncClient(addresses, worker=rank, num_workers=2, optimizer=ps.SGD(lr=1.0),
                           config=ps.PSConfig(chunk_bytes=256)) as client:
            client.init(model())
            future = client.submit_push(ones(1.0))
            params = client.pull()  # ordered after the push
            future.result(30)
            results[rank] = (params, client.push_pull(ones(2.0)), client.imbalance)

    try:
        threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(results) == [0, 1]
        for params, after, imbalance in results.values():
            np.testing.assert_array_equal(params["b"], 0.0)
            np.testing.assert_array_equal(after["b"], -2.0)
            assert imbalance < 1.5
    finally:
        for server in servers:
            asyncio.run_coroutine_threadsafe(server.close(checkpoint=False), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def test_close_fails_a_waiting_call_at_once() -> None:
    async with shards(1) as servers:
        clients = await workers(servers, 2)
        await asyncio.gather(*(c.init(model()) for c in clients))
        await clients[0].push(ones(1.0))
        waiting = clients[0].pull()
        done, _ = await asyncio.wait({waiting}, timeout=0.2)
        assert not done  # it waits on the shard for worker 1's push
        loop = asyncio.get_running_loop()
        started = loop.time()
        await clients[0].close()
        with pytest.raises(Unavailable):
            await waiting
        assert loop.time() - started < 5
        await clients[1].close()


async def test_a_worker_on_an_old_placement_is_redirected_and_follows() -> None:
    async with shards(3) as servers:
        addresses = [s.addresses[0] for s in servers]
        leader, other = await workers(servers[:2], 2, optimizer=ps.Adam(lr=0.1))
        await asyncio.gather(leader.init(model()), other.init(model()))
        await asyncio.gather(leader.push_pull(ones(1.0)), other.push_pull(ones(2.0)))
        report = await leader.reshard(addresses)
        assert report["version"] == 1 and report["chunks_moved"] > 0
        assert other.version == 0
        # A call with the old version is refused with the new one, not served.
        async with tw.connect(addresses[0], timeout=10) as probe:
            keys = [c.key for c in other.placement.on_shard(0)]
            with pytest.raises(PlacementMoved) as moved:
                await probe.call("tensorwire.ps.Shard.pull", 1, 1, keys, 5, version=0)
            assert moved.value.version == 1 and moved.value.details == {"version": 1}
            layout = await probe.call("tensorwire.ps.Shard.layout")
            assert layout["addresses"] == addresses and layout["version"] == 1
        got = await asyncio.gather(leader.push_pull(ones(1.0)), other.push_pull(ones(2.0)))
        assert other.version == 1 and other.addresses == addresses
        np.testing.assert_array_equal(got[0]["w"], got[1]["w"])
        statuses = await other.status()
        assert [s["version"] for s in statuses] == [1, 1, 1]
        assert all(s["step"] == 2 for s in statuses)
        assert sum(s["chunks"] for s in statuses) == len(other.placement.chunks)
        for client in (leader, other):
            await client.close()


async def test_reshard_refuses_a_placement_that_does_not_fit() -> None:
    async with shards(2) as servers:
        (client,) = await workers(servers, 1)
        with pytest.raises(FailedPrecondition):
            await client.reshard([s.addresses[0] for s in servers])
        await client.init(model())
        with pytest.raises(InvalidArgument):
            await client.reshard([servers[0].addresses[0]], placement=client.placement)
        await client.close()


def layers(count: int = 12) -> dict[str, np.ndarray]:
    return {f"layer{i:02d}": np.full(64, float(i), np.float32) for i in range(count)}


@pytest.mark.parametrize("url", URLS)
async def test_tensors_arrive_one_by_one_in_forward_order(url: str) -> None:
    # One message per layer, one in flight: the order on the wire is the
    # priority order, whatever order the gradients come in.
    config = ps.PSConfig(chunk_bytes=256, message_bytes=256, window=1)
    async with shards(1, url) as servers:
        (client,) = await workers(servers, 1, config=config, optimizer=ps.SGD(lr=1.0))
        params = await client.init(layers())
        backward = {name: np.ones_like(params[name]) for name in reversed(params)}
        arrivals = client.push_pull_each(backward)
        order = [name async for name, _ in arrivals]
        assert order == list(params)
        first = await arrivals["layer00"]
        np.testing.assert_array_equal(first, -1.0)
        whole = await arrivals
        assert list(whole) == list(params)
        np.testing.assert_array_equal(whole["layer11"], 10.0)
        pulled = client.pull_each()
        np.testing.assert_array_equal(await pulled["layer05"], 4.0)
        assert set(await pulled) == set(params)
        await client.close()


async def test_fifo_order_computes_the_same() -> None:
    config = ps.PSConfig(chunk_bytes=256, message_bytes=256, priority=False)
    async with shards(2) as servers:
        clients = await workers(servers, 2, config=config, optimizer=ps.SGD(lr=1.0))
        await asyncio.gather(*(c.init(layers()) for c in clients))
        backward = {name: np.ones(64, np.float32) for name in reversed(layers())}
        got = await asyncio.gather(*(c.push_pull(backward) for c in clients))
        for name, value in layers().items():
            np.testing.assert_array_equal(got[0][name], value - 1.0)
            np.testing.assert_array_equal(got[1][name], got[0][name])
        for c in clients:
            await c.close()


async def test_an_error_reaches_every_tensor_of_an_arrival() -> None:
    async with shards(1) as servers:
        clients = await workers(servers, 2, config=ps.PSConfig(chunk_bytes=256, timeout=0.3))
        with pytest.raises(FailedPrecondition):
            clients[0].pull_each()
        await asyncio.gather(*(c.init(layers(3)) for c in clients))
        arrivals = clients[0].push_pull_each(
            {name: np.ones(64, np.float32) for name in layers(3)})
        with pytest.raises(DeadlineExceeded, match=r"workers \[1\]"):
            await arrivals["layer01"]
        with pytest.raises(DeadlineExceeded):
            async for _ in arrivals:
                pass
        with pytest.raises(DeadlineExceeded):
            await arrivals
        for c in clients:
            await c.close()


async def test_compression_follows_each_shards_link_and_residuals_follow_chunks() -> None:
    # Loopback shards share this host: "local". Pretend the second one is on
    # another host, as the shard's hello would say there.
    compression = {"local": "none", "remote": "int8"}
    config = ps.PSConfig(chunk_bytes=256, compression=compression)
    async with shards(2) as servers:
        (client,) = await workers(servers, 1, config=config, consistency="async",
                                  optimizer=ps.SGD(lr=1.0))
        near, far = (s.addresses[0] for s in servers)
        client._shards.link(far).host = "another-host"
        start = await client.init(model())
        assert [client.link_class(0), client.link_class(1)] == ["local", "remote"]
        rng = np.random.default_rng(3)
        grads = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in start.items()}
                 for _ in range(2)]
        await client.push(grads[0])
        remote = client._feedback.by_link["remote"].residuals
        on_far = {c.key for c in client.placement.on_shard(1)}
        assert set(remote) == on_far and any(np.abs(r).max() > 0 for r in remote.values())
        # Every chunk moves to the local shard, whose compressor keeps no
        # residual: each goes into its chunk's next gradient instead.
        await client.reshard([near])
        assert not client._feedback.by_link["remote"].residuals
        assert set(client._feedback.carry) == on_far
        params = await client.push_pull(grads[1])
        assert not client._feedback.carry
        # SGD with lr 1 (one async worker): the shards took exactly the sum
        # of the true gradients, whatever compression dropped on the way.
        for name, value in start.items():
            np.testing.assert_allclose(params[name], value - grads[0][name] - grads[1][name],
                                       rtol=1e-5, atol=1e-5)
        await client.close()


async def test_a_worker_follows_even_when_the_shard_it_knew_was_stopped() -> None:
    config = ps.PSConfig(chunk_bytes=256, retry_timeout=20)
    async with shards(3) as servers:
        addresses = [s.addresses[0] for s in servers]
        leader, other = await workers(servers, 2, config=config)
        await asyncio.gather(leader.init(model()), other.init(model()))
        await asyncio.gather(leader.push_pull(ones(1.0)), other.push_pull(ones(2.0)))
        # Shard 0 leaves and is stopped before the other worker calls again.
        await leader.reshard(addresses[1:])
        await servers[0].close(checkpoint=False)
        loop = asyncio.get_running_loop()
        started = loop.time()
        got = await asyncio.gather(leader.push_pull(ones(1.0)), other.push_pull(ones(2.0)))
        assert other.addresses == addresses[1:]
        assert loop.time() - started < 10  # well inside retry_timeout
        np.testing.assert_array_equal(got[0]["w"], got[1]["w"])
        np.testing.assert_allclose(got[0]["w"], model()["w"] - 2 * 0.5 * 1.5)
        for client in (leader, other):
            await client.close()


async def test_a_change_that_stopped_part_way_is_finished_by_the_next_reshard() -> None:
    # The worker that changes the placement cannot take the moving chunks'
    # state (Adam's value and moments), which is beyond its message limit,
    # while its own steps fit: the change stops after every shard switched
    # to it, with the new shard waiting for chunks that never came.
    limited = ps.PSConfig(chunk_bytes=256, message_bytes=256, rpc=tw.rpc.ClientConfig(
        transport=TransportConfig(limits=Limits(max_message_bytes=640))))
    async with shards(3) as servers, shards(2) as reference:
        addresses = [s.addresses[0] for s in servers]
        base = [s.addresses[0] for s in servers[:2]]
        adam = ps.Adam(lr=0.1)
        leader = await ps.connect(base, worker=0, num_workers=2, optimizer=adam,
                                  config=limited)
        other = await ps.connect(base, worker=1, num_workers=2, optimizer=adam,
                                 config=ps.PSConfig(chunk_bytes=256, message_bytes=256))
        await asyncio.gather(leader.init(model()), other.init(model()))
        await asyncio.gather(leader.push_pull(ones(1.0)), other.push_pull(ones(2.0)))
        with pytest.raises(ResourceExhausted):
            await leader.reshard(addresses)
        statuses = await other.status()
        assert [s["version"] for s in statuses] == [1, 1]
        # Any worker's next reshard finishes it: here the other one, which
        # has not even seen the new placement yet.
        assert other.version == 0
        report = await other.reshard(addresses)
        assert report["version"] == 1 and report["chunks_moved"] > 0
        assert other.version == 1 and other.addresses == addresses
        got = await asyncio.gather(leader.push_pull(ones(1.0)), other.push_pull(ones(2.0)))
        assert leader.version == 1
        statuses = await other.status()
        assert sum(s["chunks"] for s in statuses) == len(other.placement.chunks)
        # The same steps without any change of placement.
        expected = await workers(reference, 2, optimizer=adam,
                                 config=ps.PSConfig(chunk_bytes=256, message_bytes=256))
        await asyncio.gather(*(c.init(model()) for c in expected))
        for _ in range(2):
            want = await asyncio.gather(expected[0].push_pull(ones(1.0)),
                                        expected[1].push_pull(ones(2.0)))
        for name in model():
            np.testing.assert_array_equal(got[0][name], want[0][name])
            np.testing.assert_array_equal(got[1][name], want[1][name])
        for client in (leader, other, *expected):
            await client.close()


async def test_a_change_whose_chunks_are_gone_names_them() -> None:
    limited = ps.PSConfig(chunk_bytes=256, message_bytes=256, retry_timeout=1,
                          rpc=tw.rpc.ClientConfig(reconnect_attempts=1, transport=TransportConfig(
                              limits=Limits(max_message_bytes=640))))
    async with shards(3) as servers:
        addresses = [s.addresses[0] for s in servers]
        leader = await ps.connect(addresses[:2], worker=0, num_workers=1,
                                  optimizer=ps.Adam(lr=0.1), config=limited)
        await leader.init(model())
        with pytest.raises(ResourceExhausted):
            await leader.reshard(addresses[1:])
        # Shard 0 was to give its chunks to shard 2, and is stopped first.
        await servers[0].close(checkpoint=False)
        with pytest.raises(FailedPrecondition, match="on no shard this worker can reach"):
            await leader.reshard(addresses[1:])
        await leader.close()


async def test_two_placements_under_one_version_are_refused() -> None:
    async with shards(2) as servers:
        (client,) = await workers(servers, 1)
        await client.init(model())
        job = client.job.to_wire()
        layout = {"version": 1, "addresses": ["x", "y"], "step": 0,
                  "shard_of": dict(client.placement.shard_of)}
        async with tw.connect(servers[0].addresses[0], timeout=10) as probe:
            assert await probe.call("tensorwire.ps.Shard.begin", job, layout, 0) == 1
            assert await probe.call("tensorwire.ps.Shard.begin", job, layout, 0) == 1
            other = dict(layout, addresses=["y", "x"])
            with pytest.raises(FailedPrecondition, match="at the same time"):
                await probe.call("tensorwire.ps.Shard.begin", job, other, 0)
        await client.close()


async def test_a_worker_that_starts_after_a_change_finds_the_new_placement() -> None:
    async with shards(3) as servers:
        addresses = [s.addresses[0] for s in servers]
        (leader,) = await workers(servers[:2], 1, optimizer=ps.Adam(lr=0.1))
        await leader.init(model())
        before = await leader.push_pull(ones(1.0))
        await leader.reshard(addresses[1:])
        await leader.close()
        # A restarted worker knows only the addresses it was started with.
        (again,) = await workers(servers[:2], 1, optimizer=ps.Adam(lr=0.1))
        params = await again.init(model())
        assert again.version == 1 and again.addresses == addresses[1:]
        for name, value in before.items():
            np.testing.assert_array_equal(params[name], value)  # not worker 0's initial values
        # Its clock starts at 0 again: that push is step 0's, which the moved
        # chunks remember taking from worker 0, so it changes nothing.
        after = await again.push_pull(ones(5.0))
        np.testing.assert_array_equal(after["w"], before["w"])
        await again.close()
