# cython: language_level=3
"""Running a coroutine eagerly: up to its first suspension now, and from a
task after that. The transports' ``Connection.send_nowait`` and the RPC
server's start of a call both do it once per message, so it is compiled
(docs/architecture.md, "The compiled core")."""

import asyncio
from collections.abc import Coroutine

__all__ = ("start_eagerly",)

cdef object _get_running_loop = asyncio.get_running_loop


cpdef object start_eagerly(object coro):
    """Run ``coro`` now up to its first suspension; None if it finished.

    Otherwise a task takes it from there, and its future is returned (what
    Python 3.12's eager tasks do). Cancelling that future reaches ``coro``
    wherever it waits, even before the task's first step. Only for the
    package's own coroutines: until the task exists,
    ``asyncio.current_task()`` inside ``coro`` is the caller's task. An
    exception raised before the first suspension is raised here.
    """
    try:
        yielded = coro.send(None)
    except StopIteration:
        return None
    return _get_running_loop().create_task(_Resumed(coro, yielded))


cdef class _Resumed:
    """A coroutine that goes on with ``coro``, which already yielded ``first``.

    A task drives it as it drives any coroutine (it is registered as a
    ``collections.abc.Coroutine``). Its first ``send`` hands the task what
    ``coro`` yielded; a ``throw`` (a cancel) always goes into ``coro``, also
    when it comes before that first step: a wrapping coroutine that had not
    started would end there and leave ``coro`` suspended forever, waiting in
    a lock's queue, for instance.
    """

    cdef object _coro
    cdef object _first
    cdef bint _started

    def __cinit__(self, object coro, object first):
        self._coro = coro
        self._first = first
        self._started = False

    def send(self, value):
        if not self._started:
            self._started = True
            first = self._first
            self._first = None
            return first
        return self._coro.send(value)

    def throw(self, typ, val=None, tb=None):
        self._started = True
        self._first = None
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)

    def close(self):
        self._coro.close()

    def __await__(self):
        sent = None
        error = None
        while True:
            try:
                yielded = self.send(sent) if error is None else self.throw(error)
            except StopIteration:
                return
            sent, error = None, None
            try:
                sent = yield yielded
            except BaseException as exc:  # thrown in by whoever awaits: a cancel
                error = exc


Coroutine.register(_Resumed)
