"""start_eagerly: a coroutine runs at once up to its first suspension."""

from __future__ import annotations

import asyncio

import pytest

from tensorwire._eager import start_eagerly


async def test_a_coroutine_that_never_suspends_needs_no_task() -> None:
    ran: list[str] = []

    async def quick() -> None:
        ran.append("done")

    assert start_eagerly(quick()) is None
    assert ran == ["done"]


async def test_the_part_before_the_first_suspension_runs_at_once() -> None:
    steps: list[str] = []
    gate = asyncio.get_running_loop().create_future()

    async def two_steps() -> None:
        steps.append("first")
        steps.append(await gate)

    future = start_eagerly(two_steps())
    assert steps == ["first"] and future is not None
    gate.set_result("second")
    await asyncio.wait_for(future, 1)
    assert steps == ["first", "second"]


async def test_errors_before_and_after_the_first_suspension() -> None:
    async def fails_at_once() -> None:
        raise ValueError("at once")

    with pytest.raises(ValueError, match="at once"):
        start_eagerly(fails_at_once())

    async def fails_later() -> None:
        await asyncio.sleep(0)
        raise ValueError("later")

    future = start_eagerly(fails_later())
    assert future is not None
    with pytest.raises(ValueError, match="later"):
        await future


async def test_cancelling_the_task_reaches_the_coroutine() -> None:
    cleaned: list[bool] = []

    async def waits() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            cleaned.append(True)

    future = start_eagerly(waits())
    assert future is not None
    await asyncio.sleep(0)
    future.cancel()
    with pytest.raises(asyncio.CancelledError):
        await future
    assert cleaned == [True]


async def test_a_cancel_before_the_first_step_reaches_the_coroutine() -> None:
    # The task has not run yet when its future is cancelled: the coroutine,
    # already waiting in a lock's queue, must still leave that queue, or the
    # lock is stuck for everyone after it.
    lock = asyncio.Lock()
    cleaned: list[bool] = []

    async def queued() -> None:
        try:
            async with lock:
                pass
        finally:
            cleaned.append(True)

    await lock.acquire()
    future = start_eagerly(queued())
    assert future is not None
    future.cancel()
    lock.release()
    with pytest.raises(asyncio.CancelledError):
        await future
    assert cleaned == [True]
    await asyncio.wait_for(lock.acquire(), 1)


async def test_the_returned_future_can_be_awaited_like_the_coroutine() -> None:
    gate = asyncio.get_running_loop().create_future()

    async def two_steps() -> str:
        return str(await gate)

    future = start_eagerly(two_steps())  # type: ignore[arg-type]
    assert future is not None
    gate.set_result(7)
    assert await future == "7"
