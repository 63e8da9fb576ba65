"""The background loop of the blocking facades (tensorwire._background): what a
call submitted from another thread gets back, cancelling, ordering, closing."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tensorwire._background import CLOSE_WAIT, BackgroundLoop
from tensorwire.errors import FailedPrecondition


@pytest.fixture
def background() -> Iterator[BackgroundLoop]:
    bg = BackgroundLoop("test-background")
    yield bg
    bg.close()


def test_a_call_returns_its_result_or_raises_its_error(background: BackgroundLoop) -> None:
    async def add(a: int, b: int) -> int:
        await asyncio.sleep(0)
        return a + b

    async def fail() -> None:
        await asyncio.sleep(0)
        raise KeyError("missing")

    assert background.run(add(2, 3)).result(10) == 5
    with pytest.raises(KeyError, match="missing"):
        background.run(fail()).result(10)


def test_the_future_is_settled_in_the_turn_the_coroutine_ends(
    background: BackgroundLoop,
) -> None:
    # A caller waiting on the future hears of the end at once, not one loop
    # turn later (as with asyncio.run_coroutine_threadsafe's callback).
    seen: list[bool] = []
    future: concurrent.futures.Future[None] | None = None
    submitted = threading.Event()

    async def body() -> None:
        submitted.wait(10)
        loop = asyncio.get_running_loop()
        # Runs in the next turn: the future must be done by then.
        loop.call_soon(lambda: seen.append(future is not None and future.done()))

    future = background.run(body())
    submitted.set()
    future.result(10)
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.001)
    assert seen == [True]


def test_cancelling_the_future_cancels_the_call(background: BackgroundLoop) -> None:
    started, stopped = threading.Event(), threading.Event()

    async def forever() -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        finally:
            stopped.set()

    future = background.run(forever())
    assert started.wait(10)
    assert future.cancel()
    assert stopped.wait(10)
    with pytest.raises(concurrent.futures.CancelledError):
        future.result(10)


def test_a_call_cancelled_before_it_starts_never_runs(background: BackgroundLoop) -> None:
    ran: list[str] = []
    gate = threading.Event()

    async def block() -> None:
        gate.wait(10)  # holds the loop thread: the next call cannot start yet

    async def record(name: str) -> None:
        ran.append(name)

    background.run(block())
    late = background.run(record("late"))
    assert late.cancel()
    gate.set()
    background.run(record("after")).result(10)
    assert ran == ["after"]


def test_calls_start_in_the_order_they_were_submitted(background: BackgroundLoop) -> None:
    started: list[int] = []

    async def note(i: int) -> int:
        started.append(i)
        await asyncio.sleep(0)
        return i

    futures = [background.run(note(i)) for i in range(50)]
    assert [f.result(10) for f in futures] == list(range(50))
    assert started == list(range(50))


def test_a_closed_loop_refuses_calls_and_closes_their_coroutines() -> None:
    bg = BackgroundLoop("test-closed")
    bg.close()
    ran: list[Any] = []

    async def body() -> None:
        ran.append(1)

    coro = body()
    with pytest.raises(FailedPrecondition, match="closed"):
        bg.run(coro)
    assert coro.cr_frame is None  # closed, so no "never awaited" warning
    assert ran == []


async def _until_cancelled(started: threading.Event) -> None:
    """Say it started, then wait until cancelled."""
    started.set()
    await asyncio.sleep(3600)


def test_wait_and_as_completed_count_a_cancelled_call_as_done(
    background: BackgroundLoop,
) -> None:
    # concurrent.futures.wait() and as_completed() count a cancelled future
    # as done only once set_running_or_notify_cancel() has told them, which
    # cancel() alone does not: a call whose coroutine ended cancelled, and
    # one its caller cancelled, must both be seen to end.
    async def cancelled_inside() -> None:
        await asyncio.sleep(0)
        raise asyncio.CancelledError

    ended = background.run(cancelled_inside())
    done, _ = concurrent.futures.wait([ended], timeout=10)
    assert ended.cancelled() and ended in done

    started = threading.Event()
    stopped = background.run(_until_cancelled(started))
    assert started.wait(10)
    assert stopped.cancel()
    assert list(concurrent.futures.as_completed([stopped], timeout=10)) == [stopped]


def test_close_does_not_wait_out_a_call_cancelled_while_it_waits() -> None:
    # close() waits for earlier calls (concurrent.futures.wait, up to
    # CLOSE_WAIT); a caller that cancels its call meanwhile (Ctrl-C in
    # BackgroundLoop.wait) ends that wait.
    background = BackgroundLoop("test-background-close")
    started = threading.Event()
    future = background.run(_until_cancelled(started))
    assert started.wait(10)
    canceller = threading.Timer(0.3, future.cancel)
    canceller.start()
    began = time.monotonic()
    background.close()
    canceller.join()
    assert time.monotonic() - began < CLOSE_WAIT / 2


def test_a_call_cancelled_after_its_task_was_made_but_before_it_ran_never_runs(
    background: BackgroundLoop,
) -> None:
    # _start has made the call's task; a plain callback queued behind it
    # holds the loop thread while the caller cancels. The task's first
    # step comes before the cancel reaches the task: it must not run the
    # coroutine.
    ran: list[str] = []
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        release.wait(10)

    async def record() -> None:
        ran.append("ran")

    late = background.run(record())
    background.loop.call_soon_threadsafe(hold)
    assert holding.wait(10)
    assert not late.done() and late.cancel()
    release.set()
    background.run(asyncio.sleep(0)).result(10)  # every turn before it has run
    done, _ = concurrent.futures.wait([late], timeout=10)
    assert ran == [] and late in done


@pytest.mark.parametrize("exit_error", [SystemExit, KeyboardInterrupt])
def test_a_call_that_raises_systemexit_gives_it_to_its_caller_and_the_loop_goes_on(
    background: BackgroundLoop, exit_error: type[BaseException],
) -> None:
    async def leave() -> None:
        await asyncio.sleep(0)
        raise exit_error("from a call")

    with pytest.raises(exit_error, match="from a call"):
        background.run(leave()).result(10)

    async def add(a: int, b: int) -> int:
        await asyncio.sleep(0)
        return a + b

    assert background.run(add(1, 2)).result(10) == 3  # the loop thread still runs
