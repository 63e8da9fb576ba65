"""The per-call semaphore: first come first served, and a cancel loses no slot."""

from __future__ import annotations

import asyncio

import pytest

from tensorwire.rpc._slots import Slots


async def test_waiters_get_slots_in_order() -> None:
    slots = Slots(1, asyncio.get_running_loop())
    assert slots.try_acquire()
    assert slots.locked() and not slots.try_acquire()
    order: list[int] = []

    async def take(i: int) -> None:
        await slots.acquire()
        order.append(i)
        await asyncio.sleep(0)
        slots.release()

    tasks = [asyncio.create_task(take(i)) for i in range(5)]
    await asyncio.sleep(0)
    slots.release()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4]
    assert not slots.locked()


async def test_a_waiter_cancelled_after_being_handed_the_slot_passes_it_on() -> None:
    slots = Slots(1, asyncio.get_running_loop())
    assert slots.try_acquire()
    first = asyncio.create_task(slots.acquire())
    second = asyncio.create_task(slots.acquire())
    await asyncio.sleep(0)
    slots.release()  # hands the slot to ``first``...
    first.cancel()  # ...which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 1)
    slots.release()
    assert not slots.locked()
    assert slots.try_acquire() and not slots.try_acquire()


async def test_a_cancelled_waiter_leaves_the_line() -> None:
    slots = Slots(1, asyncio.get_running_loop())
    assert slots.try_acquire()
    waiting = asyncio.create_task(slots.acquire())
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    slots.release()
    assert slots.try_acquire()
