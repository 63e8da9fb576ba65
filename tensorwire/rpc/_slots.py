"""A counting semaphore for the per-call path."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

__all__ = ("Slots",)


class Slots:
    """Up to ``count`` holders at once; the others wait, first come first served.

    ``asyncio.Semaphore`` costs a coroutine, a context manager and a scan of
    its waiters on every acquire; here an uncontended ``try_acquire()`` is
    one method call, which matters on a path run for every call.
    """

    __slots__ = ("_loop", "free", "waiters")

    def __init__(self, count: int, loop: asyncio.AbstractEventLoop) -> None:
        self.free = count
        self._loop = loop
        self.waiters: deque[asyncio.Future[None]] = deque()

    def locked(self) -> bool:
        """True when an acquire would wait."""
        return self.free <= 0 or bool(self.waiters)

    def try_acquire(self) -> bool:
        """Take a slot if one is free and nobody waits for it."""
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return True
        return False

    async def acquire(self) -> None:
        """Take a slot, waiting in line for one."""
        if self.try_acquire():
            return
        waiter: asyncio.Future[None] = self._loop.create_future()
        self.waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                # The slot was handed over as the cancel landed: pass it on.
                self.release()
            else:
                with contextlib.suppress(ValueError):
                    self.waiters.remove(waiter)
            raise

    def release(self) -> None:
        """Give a slot back: to the first in line, if anyone waits."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.free += 1
