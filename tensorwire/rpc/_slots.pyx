# cython: language_level=3
"""A counting semaphore for the per-call path, compiled (both roles take
and give back a slot on every call)."""

import asyncio
from collections import deque

cdef object _CancelledError = asyncio.CancelledError


cdef class Slots:
    """Up to ``count`` holders at once; the others wait, first come first served.

    ``asyncio.Semaphore`` costs a coroutine, a context manager and a scan of
    its waiters on every acquire; here an uncontended ``try_acquire()`` is
    one C call, which matters on a path run for every call.
    """

    # Its fields are declared in _slots.pxd: free, _loop, waiters.

    def __init__(self, Py_ssize_t count, loop):
        self.free = count
        self._loop = loop
        self.waiters = deque()

    cpdef bint locked(self):
        """True when an acquire would wait."""
        return self.free <= 0 or bool(self.waiters)

    cpdef bint try_acquire(self):
        """Take a slot if one is free and nobody waits for it."""
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return True
        return False

    async def acquire(self):
        """Take a slot, waiting in line for one."""
        if self.try_acquire():
            return
        waiter = self._loop.create_future()
        self.waiters.append(waiter)
        try:
            await waiter
        except _CancelledError:
            if waiter.done() and not waiter.cancelled():
                # The slot was handed over as the cancel landed: pass it on.
                self.release()
            else:
                try:
                    self.waiters.remove(waiter)
                except ValueError:
                    pass
            raise

    cpdef void release(self) except *:
        """Give a slot back: to the first in line, if anyone waits."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.free += 1
