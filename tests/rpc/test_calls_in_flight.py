"""The client's table of calls in flight without a connection: deadlines
that arrive out of order expire each at its own time, in order, and the
entries of calls that ended do not pile up."""

from __future__ import annotations

import asyncio

import pytest

from tensorwire.rpc._calls_in_flight import CallsInFlight


class _Waiter:
    """What a non-unary waiter gives CallsInFlight: a future and fail()."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.future: asyncio.Future[None] = loop.create_future()

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


def _table(loop: asyncio.AbstractEventLoop) -> CallsInFlight:
    return CallsInFlight(loop, lambda message, nbytes: None)


async def test_deadlines_out_of_order_expire_each_in_time_and_in_order() -> None:
    loop = asyncio.get_running_loop()
    calls = _table(loop)
    start = loop.time()
    # In order, then earlier ones, then a later one again, and a tie.
    offsets = [0.20, 0.30, 0.05, 0.25, 0.10, 0.40, 0.30]
    waiters = [_Waiter(loop) for _ in offsets]
    expired: list[tuple[int, float]] = []
    for index, (offset, waiter) in enumerate(zip(offsets, waiters, strict=True)):
        calls.add(waiter, start + offset)
        waiter.future.add_done_callback(
            lambda _, index=index: expired.append((index, loop.time())))
    await asyncio.wait([w.future for w in waiters])
    for waiter in waiters:
        with pytest.raises(TimeoutError):
            waiter.future.result()
    # Each at (not before) its deadline, in deadline order, ties by call id.
    assert [index for index, _ in expired] == [2, 4, 0, 3, 1, 6, 5]
    for index, at in expired:
        assert at >= start + offsets[index]
        assert at - (start + offsets[index]) < 0.1


async def test_an_earlier_deadline_after_later_ones_is_not_held_up() -> None:
    loop = asyncio.get_running_loop()
    calls = _table(loop)
    start = loop.time()
    late = [_Waiter(loop) for _ in range(3)]
    for waiter in late:
        calls.add(waiter, start + 5)
    early = _Waiter(loop)
    calls.add(early, start + 0.05)
    with pytest.raises(TimeoutError):
        await early.future
    assert loop.time() - start < 1
    assert not any(waiter.future.done() for waiter in late)
    calls.fail_all(TimeoutError())


async def test_deadlines_of_ended_calls_do_not_pile_up() -> None:
    loop = asyncio.get_running_loop()
    calls = _table(loop)
    start = loop.time()
    # One call that never ends, then many that end in turn, their deadlines
    # in order and out of order.
    calls.add(_Waiter(loop), start + 60)
    for n in range(2000):
        call_id = calls.add(_Waiter(loop), start + 30 + (n % 7 if n % 2 else n))
        del calls.pending[call_id]
        assert len(calls.deadlines) + len(calls.in_order) <= 2 * 2 + 64
    calls.fail_all(TimeoutError())
    assert not calls.deadlines and not calls.in_order


async def test_many_deadlines_in_order_expire_in_order() -> None:
    loop = asyncio.get_running_loop()
    calls = _table(loop)
    start = loop.time()
    # Calls that end first move the front of the queue on; the live ones
    # then outgrow its first size.
    for n in range(40):
        del calls.pending[calls.add(_Waiter(loop), start + 0.01 + n * 1e-4)]
    waiters = [_Waiter(loop) for _ in range(300)]
    expired: list[int] = []
    for index, waiter in enumerate(waiters):
        calls.add(waiter, start + 0.02 + index * 1e-4)
        waiter.future.add_done_callback(lambda _, index=index: expired.append(index))
    await asyncio.wait([w.future for w in waiters])
    assert expired == list(range(300))
    assert loop.time() >= start + 0.02 + 299 * 1e-4
