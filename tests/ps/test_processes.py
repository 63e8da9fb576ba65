"""The parameter server across real processes on loopback, over tcp:// and ucx://.

Shards run as ``tensorwire ps serve`` children, workers in spawned processes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import importlib.util
import multiprocessing
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorwire as tw
from tensorwire import ps
from tensorwire.ps import _checkpoint

from . import workers as w

UCX = pytest.param("ucx://127.0.0.1:0", id="ucx", marks=pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed"))
URLS = [pytest.param("tcp://127.0.0.1:0", id="tcp"), UCX]
WORKERS = 3


@pytest.fixture(scope="module")
def pool() -> Iterator[concurrent.futures.ProcessPoolExecutor]:
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(WORKERS, mp_context=context) as executor:
        yield executor


@pytest.fixture
def resume() -> Iterator[Any]:
    """An event workers in the pool can wait for; set on the way out, so a
    failed test leaves no worker waiting."""
    with multiprocessing.get_context("spawn").Manager() as manager:
        event = manager.Event()
        try:
            yield event
        finally:
            event.set()


@contextlib.asynccontextmanager
async def shards(url: str, count: int = 2, *options: str) -> AsyncIterator[list[str]]:
    async with contextlib.AsyncExitStack() as stack:
        started = [await stack.enter_async_context(w.shard_process(url, *options))
                   for _ in range(count)]
        yield [address for _, address in started]


async def run_workers(pool: concurrent.futures.Executor, fn: Any, *per_worker: Any) -> list[Any]:
    loop = asyncio.get_running_loop()
    return list(await asyncio.gather(*(
        loop.run_in_executor(pool, functools.partial(fn, *args)) for args in per_worker
    )))


@pytest.mark.parametrize("url", URLS)
@pytest.mark.parametrize("optimizer", [ps.SGD(lr=0.05, momentum=0.9, weight_decay=0.01),
                                       ps.Adam(lr=0.01)], ids=["sgd", "adam"])
async def test_sync_training_matches_one_process(pool: concurrent.futures.Executor, url: str,
                                                 optimizer: ps.Optimizer) -> None:
    steps = 8
    async with shards(url) as addresses:
        results = await run_workers(pool, w.train, *(
            (addresses, rank, WORKERS, steps, optimizer) for rank in range(WORKERS)))
    start = results[0]["start"]
    # The first worker's initial values won, and every worker got them.
    assert any(all(np.array_equal(start[k], w.initial(r)[k]) for k in start)
               for r in range(WORKERS))
    for result in results:
        for name in start:
            np.testing.assert_array_equal(result["start"][name], start[name])
    expected = w.reference(start, WORKERS, steps, optimizer)
    for result in results:
        for name, value in expected.items():
            np.testing.assert_allclose(result["final"][name], value, rtol=1e-5, atol=1e-6)
    assert results[0]["imbalance"] < 1.2  # 5 KB in 1 KiB chunks on two shards


@pytest.mark.parametrize("url", URLS)
async def test_ssp_bound_holds_under_a_slow_worker(pool: concurrent.futures.Executor,
                                                   url: str) -> None:
    steps, staleness = 12, 2
    async with shards(url) as addresses:
        seen = await run_workers(pool, w.count, *(
            (addresses, rank, WORKERS, steps, "ssp", staleness, 0.05 if rank == 2 else 0.0)
            for rank in range(WORKERS)))
    lead = 0.0
    for rank, views in enumerate(seen):
        for clock, counts in enumerate(views, 1):
            assert counts[rank] == clock  # our own pushes are all in
            assert min(counts) >= clock - staleness, (rank, clock, counts)
            lead = max(lead, clock - min(counts))
    # The fast workers did run ahead (this is not lock-step), but no further.
    assert lead == staleness


@pytest.mark.parametrize("url", URLS)
async def test_async_workers_do_not_wait_for_a_slow_one(
        pool: concurrent.futures.Executor, url: str) -> None:
    steps = 12
    async with shards(url) as addresses:
        seen = await run_workers(pool, w.count, *(
            (addresses, rank, WORKERS, steps, "async", 0, 0.25 if rank == 2 else 0.0)
            for rank in range(WORKERS)))
    for rank in (0, 1):
        assert seen[rank][-1][rank] == steps
        assert seen[rank][-1][2] < steps - 3  # finished far ahead of the slow worker
    assert seen[2][-1] == [steps] * WORKERS


@pytest.mark.parametrize("compression", ["fp16", "int8"])
async def test_compressed_sync_training_stays_close(pool: concurrent.futures.Executor,
                                                    compression: str) -> None:
    steps, optimizer = 6, ps.SGD(lr=0.05)
    async with shards("tcp://127.0.0.1:0") as addresses:
        results = await run_workers(pool, w.train, *(
            (addresses, rank, WORKERS, steps, optimizer, compression)
            for rank in range(WORKERS)))
    expected = w.reference(results[0]["start"], WORKERS, steps, optimizer)
    for name, value in expected.items():
        np.testing.assert_allclose(results[0]["final"][name], value, rtol=0.05, atol=0.05)
        np.testing.assert_array_equal(results[1]["final"][name], results[0]["final"][name])


@pytest.mark.parametrize("url", URLS)
async def test_a_killed_shard_restores_its_checkpoint_and_training_continues(
        pool: concurrent.futures.Executor, resume: Any, tmp_path: Path, url: str) -> None:
    steps, optimizer = 30, ps.SGD(lr=0.02, momentum=0.5)
    # The last worker waits before pushing step `held` until the shard was
    # restarted, so no shard gets past step `held` before the kill: without
    # that, a test process held up for some twenty steps killed the shard
    # after training had finished, and it restored a checkpoint behind step 30
    # that no push would ever move on.
    held = 12
    options = ("--checkpoint-dir", str(tmp_path / "s0"), "--checkpoint-every", "3")
    loop = asyncio.get_running_loop()
    async with w.shard_process(url, *options) as (victim, first), \
            w.shard_process(url) as (_, second):
        addresses = [first, second]
        training = asyncio.gather(*(
            loop.run_in_executor(pool, functools.partial(
                w.train, addresses, rank, WORKERS, steps, optimizer, "none", 30.0,
                hold=(held, resume) if rank == WORKERS - 1 else None))
            for rank in range(WORKERS)))
        async with tw.connect(first, timeout=60) as probe:
            # Join the job as a worker other than 0 would (waiting for worker
            # 0's values); then a sync-mode pull at clock t returns once
            # step t was applied to these chunks.
            job = ps.Job(WORKERS, "sync", 0, optimizer).to_wire()
            specs = [ps.TensorSpec.of(k, v) for k, v in w.initial(0).items()]
            chunks = ps.place(ps.chunk_tensors(specs, w.CHUNK_BYTES), 2).on_shard(0)
            keys, sizes = [c.key for c in chunks], [c.size for c in chunks]
            await probe.call("tensorwire.ps.Shard.init", job, 1, keys, [], sizes, 30)
            await probe.call("tensorwire.ps.Shard.pull", 0, 1, keys, 30)
            # The periodic checkpoints are written in the background and may
            # trail the kill by a few steps: one is surely on disk before it.
            await probe.call("tensorwire.ps.Shard.checkpoint")
            await probe.call("tensorwire.ps.Shard.pull", 0, 10, keys, 30)
        os.kill(victim.pid, signal.SIGKILL)
        await victim.wait()
        found = _checkpoint.latest(tmp_path / "s0")
        assert found is not None
        restored_step = found[1]["step"]
        assert 0 < restored_step <= held
        async with w.shard_process(first, *options) as (_, again):
            assert again == first
            resume.set()
            results = await asyncio.wait_for(training, 90)
            async with tw.connect(first, timeout=10) as probe:
                status = await probe.call("tensorwire.ps.Shard.status")
    # Training went on from the checkpoint: the steps since it were lost (and
    # counted), the rest completed on the restarted shard.
    assert status["restored_from"] == str(found[0])
    assert status["step"] == steps
    assert status["lost_steps"] <= held - restored_step
    for result in results[1:]:
        for name, value in results[0]["final"].items():
            np.testing.assert_array_equal(result["final"][name], value)
    assert all(np.isfinite(v).all() for v in results[0]["final"].values())
    if status["lost_steps"] == 0:
        expected = w.reference(results[0]["start"], WORKERS, steps, optimizer)
        for name, value in expected.items():
            np.testing.assert_allclose(results[0]["final"][name], value, rtol=1e-5, atol=1e-6)


async def test_sigterm_stops_a_shard_with_a_last_checkpoint(tmp_path: Path) -> None:
    async with w.shard_process("tcp://127.0.0.1:0", "--checkpoint-dir", str(tmp_path)) as (
            child, address):
        client = await ps.connect([address], worker=0, num_workers=1, optimizer=ps.SGD(lr=1))
        await client.init({"w": np.zeros(3, np.float32)})
        await client.push_pull({"w": np.ones(3, np.float32)})
        await client.close()
        child.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(child.wait(), 30) == 0
    found = _checkpoint.latest(tmp_path)
    assert found is not None and found[1]["step"] == 1


def test_tensorwire_demo_trains() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tensorwire", "demo", "--epochs", "4", "--min-accuracy", "0.85"],
        capture_output=True, text=True, timeout=110, cwd=w.ROOT)
    assert result.returncode == 0, result.stderr
    assert "final test accuracy" in result.stdout


@pytest.mark.parametrize("url", URLS)
async def test_sync_training_goes_on_across_adding_and_removing_a_shard(
        pool: concurrent.futures.Executor, url: str) -> None:
    # Adam: its moments must move with the chunks, or the result would differ.
    steps, optimizer = 9, ps.Adam(lr=0.01)
    async with shards(url, 3) as (first, second, third):
        moves = {3: [first, second, third], 6: [second, third]}
        results = await run_workers(pool, w.train_moving, *(
            (
                [first, second], rank, WORKERS, steps, optimizer, moves if rank == 0 else {}
            ) for rank in range(WORKERS)))
    expected = w.reference(results[0]["start"], WORKERS, steps, optimizer)
    for result in results:
        # Every worker learned both new placements from a shard's redirect.
        assert result["version"] == 2 and result["addresses"] == [second, third]
        for name, value in expected.items():
            np.testing.assert_allclose(result["final"][name], value, rtol=1e-5, atol=1e-6)
    added, removed = results[0]["reports"]
    specs = [ps.TensorSpec.of(k, v) for k, v in w.initial(0).items()]
    before = ps.place(ps.chunk_tensors(specs, w.CHUNK_BYTES), 2)
    total = sum(before.loads())
    # Each move shifted what the placement plan said (with seven chunks, more
    # than a third: test_placement checks 1/(k+1) on a real model), with the
    # chunks' Adam moments (and any sync step being collected) beside them.
    plan = ps.relocate(before, ["a", "b"], ["a", "b", "c"])
    assert added["parameter_bytes_moved"] == before.moved_bytes(plan)
    assert 3 * added["parameter_bytes_moved"] <= added["bytes_moved"]
    assert added["version"] == 1 and removed["version"] == 2
    assert 0 < removed["parameter_bytes_moved"] < 0.6 * total


@pytest.mark.parametrize("consistency", ["ssp", "async"])
async def test_stale_modes_lose_and_double_nothing_across_placement_changes(
        pool: concurrent.futures.Executor, consistency: str) -> None:
    steps = 12
    async with shards("tcp://127.0.0.1:0", 3) as (first, second, third):
        moves = {3: [first, second, third], 7: [third, first]}
        counts = await run_workers(pool, w.count_moving, *(
            ([first, second], rank, WORKERS, steps, consistency, 1 if consistency == "ssp" else 0,
             moves if rank == 0 else {}) for rank in range(WORKERS)))
    for result in counts:
        # Every counter of every tensor took each worker's push exactly once.
        assert result == [float(steps)] * (2 * WORKERS), result
