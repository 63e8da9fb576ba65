"""A step pushed in parts (PSClient.begin_step) against one whole push, and
its misuse; the blocking SyncStep; facades sharing one background loop."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from tensorwire import collective, ps
from tensorwire.errors import FailedPrecondition, InvalidArgument

from .test_ps import shards, workers

Array = np.ndarray[Any, Any]


def model() -> dict[str, Array]:
    # Names in forward order; with 256-byte chunks "w" and "v" span several.
    return {"w": np.linspace(-1, 1, 200, dtype=np.float32).reshape(20, 10),
            "b": np.ones(5, np.float32), "v": np.linspace(2, 3, 70, dtype=np.float32),
            "c": np.zeros(3, np.float32)}


def gradient(step: int, worker: int) -> dict[str, Array]:
    rng = np.random.default_rng(100 * step + worker)
    return {name: rng.standard_normal(value.shape).astype(np.float32)
            for name, value in model().items()}


#: The parts a backward pass would hand over: last layers first, uneven.
PARTS = (("c", "v"), ("b",), ("w",))


async def train(mode: str, compression: str | None, parts: bool,
                steps: int = 4) -> list[dict[str, Array]]:
    """Two workers, two shards: what each step's push_pull returned to worker 0."""
    async with shards(2) as servers:
        clients = await workers(servers, 2, consistency=mode, compression=compression,
                                staleness=1 if mode == "ssp" else 0,
                                optimizer=ps.Adam(lr=0.05),
                                config=ps.PSConfig(chunk_bytes=256, timeout=10))
        await asyncio.gather(*(c.init(model()) for c in clients))

        async def one(client: ps.PSClient, grads: dict[str, Array]) -> dict[str, Array]:
            if not parts:
                return await client.push_pull(grads)
            step = client.begin_step()
            tasks = [step.push_pull({name: grads[name] for name in part}) for part in PARTS]
            assert step.complete
            out: dict[str, Array] = {}
            for task in tasks:
                out.update(await task)
            return out

        seen = []
        for t in range(steps):
            if mode == "sync":
                got = await asyncio.gather(*(one(c, gradient(t, w))
                                             for w, c in enumerate(clients)))
            else:
                # One worker after the other: updates applied in one order.
                got = [await one(c, gradient(t, w)) for w, c in enumerate(clients)]
            seen.append(got[0])
        for c in clients:
            await c.close()
    return seen


@pytest.mark.parametrize("mode", ["sync", "ssp", "async"])
@pytest.mark.parametrize("compression", [None, "int8", "topk"])
async def test_a_step_in_parts_equals_one_push(mode: str, compression: str | None) -> None:
    whole = await train(mode, compression, parts=False)
    split = await train(mode, compression, parts=True)
    assert not np.array_equal(whole[-1]["w"], model()["w"])  # it trained
    for a, b in zip(whole, split, strict=True):
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


async def test_each_part_is_back_before_the_next_is_pushed() -> None:
    # Sync mode, two workers: both push the first part, and it comes back
    # updated while the rest of the step has not been pushed at all.
    async with shards(2) as servers:
        clients = await workers(servers, 2, optimizer=ps.SGD(lr=0.5))
        await asyncio.gather(*(c.init(model()) for c in clients))
        steps = [c.begin_step() for c in clients]
        first = await asyncio.gather(*(s.push_pull({"c": np.ones(3, np.float32)})
                                       for s in steps))
        for got in first:
            np.testing.assert_array_equal(got["c"], np.full(3, -0.5, np.float32))
        assert [s.missing for s in steps] == [["w", "b", "v"]] * 2
        rest = {name: np.ones_like(value) for name, value in model().items() if name != "c"}
        await asyncio.gather(*(s.push(rest) for s in steps))
        pulled = await clients[0].pull()
        np.testing.assert_array_equal(pulled["b"], np.full(5, 0.5, np.float32))
        assert clients[0].clock == 1
        for c in clients:
            await c.close()


async def test_parts_pushed_at_different_moments_do_not_deadlock() -> None:
    # One message per chunk, one in flight per shard. Worker 1 has both
    # parts at once; worker 0 gets the second (more urgent: the first
    # layers) while the first part's second message holds its window. Had
    # the urgent part overtaken queued messages, each worker would hold the
    # window place the other waits for, until the deadline.
    config = ps.PSConfig(chunk_bytes=256, message_bytes=256, window=1, timeout=5)
    async with shards(1) as servers:
        clients = await workers(servers, 2, optimizer=ps.SGD(lr=0.5), config=config)
        await asyncio.gather(*(c.init(model()) for c in clients))
        grads = {name: np.ones_like(value) for name, value in model().items()}
        late = {name: grads[name] for name in ("w", "b")}
        steps = [c.begin_step() for c in clients]
        both = [steps[1].push_pull({"v": grads["v"], "c": grads["c"]}),
                steps[1].push_pull(late)]
        first = steps[0].push_pull({"v": grads["v"], "c": grads["c"]})
        await asyncio.sleep(0.1)  # worker 0's backward pass computes the next bucket
        second = steps[0].push_pull(late)
        got = await asyncio.gather(first, second, *both)
        np.testing.assert_array_equal(got[1]["b"], np.full(5, 0.5, np.float32))
        for c in clients:
            await c.close()


async def test_misuse_of_a_step_is_refused_clearly() -> None:
    async with shards(1) as servers:
        (client,) = await workers(servers, 1)
        with pytest.raises(FailedPrecondition, match="init"):
            client.begin_step()
        await client.init(model())
        grads = gradient(0, 0)
        step = client.begin_step()
        assert step.clock == 0
        await step.push({"w": grads["w"]})
        with pytest.raises(InvalidArgument, match=r"\['w'\] were pushed in an earlier part"):
            step.push({"w": grads["w"], "b": grads["b"]})
        with pytest.raises(InvalidArgument, match="unknown tensors"):
            step.push({"nope": grads["w"]})
        with pytest.raises(InvalidArgument, match="at least one"):
            step.push_pull({})
        with pytest.raises(InvalidArgument, match="shape"):
            step.push({"b": grads["w"]})
        assert step.missing == ["b", "v", "c"]  # refused parts took nothing
        for call in (client.begin_step, client.pull, lambda: client.push(grads),
                     lambda: client.push_pull(grads)):
            with pytest.raises(FailedPrecondition,
                               match=r"step 0 is incomplete: no gradient was pushed for "
                                     r"\['b', 'v', 'c'\]"):
                call()
        await step.push({"b": grads["b"], "v": grads["v"], "c": grads["c"]})
        assert step.complete
        after = client.begin_step()
        assert after.clock == 1
        await client.init(model())  # a new layout: the open step is void
        with pytest.raises(FailedPrecondition, match="no longer the client's current step"):
            after.push(grads)
        await client.close()


async def test_sync_step_blocks_and_reports_misuse() -> None:
    async with shards(1) as servers:
        address = servers[0].addresses[0]

        def run() -> tuple[dict[str, Array], str]:
            with ps.SyncClient([address], worker=0, num_workers=1,
                               optimizer=ps.SGD(lr=1.0)) as client:
                client.init(model())
                step = client.begin_step()
                future = step.submit_push({"w": np.ones((20, 10), np.float32)})
                got = step.push_pull({"b": np.ones(5, np.float32)})
                future.result()
                with pytest.raises(InvalidArgument) as twice:
                    step.push({"b": np.ones(5, np.float32)})
                step.push({"v": np.ones(70, np.float32), "c": np.ones(3, np.float32)})
                return got, str(twice.value)

        got, message = await asyncio.to_thread(run)
        np.testing.assert_array_equal(got["b"], np.zeros(5, np.float32))
        assert "earlier part of step 0" in message


async def test_a_client_and_a_group_share_one_loop_thread() -> None:
    async with shards(1) as servers:
        address = servers[0].addresses[0]

        def run() -> list[bool]:
            group = collective.SyncGroup.create(rank=0, world_size=1,
                                                master="tcp://127.0.0.1:0", host_master=True)
            client = ps.SyncClient([address], worker=0, num_workers=1,
                                   optimizer=ps.SGD(lr=1.0), loop_of=group)
            same = client.background.loop is group.loop
            group.close()  # the client still runs: the thread waits for it
            client.init(model())
            alive = bool(client.pull()["c"].size == 3)
            client.close()
            stopped = group.loop.is_closed()
            with pytest.raises(FailedPrecondition):
                ps.SyncClient([address], worker=0, num_workers=1, optimizer=ps.SGD(lr=1.0),
                              loop_of=group)
            return [same, alive, stopped]

        assert await asyncio.to_thread(run) == [True, True, True]
