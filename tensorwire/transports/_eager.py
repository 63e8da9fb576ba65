"""Running a transport's coroutine eagerly: up to its first suspension
now, and from a task after that (``Connection.send_nowait``)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any

__all__ = ("start_eagerly",)

def start_eagerly(coro: Coroutine[Any, None, None]) -> asyncio.Future[None] | None:
    """Run ``coro`` now up to its first suspension; None if it finished.

    Otherwise a task takes it from there, and its future is returned (what
    Python 3.12's eager tasks do). Cancelling that future reaches ``coro``
    wherever it waits, even before the task's first step. Only for the
    transports' own coroutines: until the task exists,
    ``asyncio.current_task()`` inside ``coro`` is the caller's task. An
    exception raised before the first suspension is raised here.
    """
    try:
        yielded = coro.send(None)
    except StopIteration:
        return None
    return asyncio.get_running_loop().create_task(_Resumed(coro, yielded))


_STARTED: Any = object()


class _Resumed(Coroutine[Any, Any, None]):
    """A coroutine that goes on with ``coro``, which already yielded ``first``.

    A task drives it as it drives any coroutine. Its first ``send`` hands the
    task what ``coro`` yielded; a ``throw`` (a cancel) always goes into
    ``coro``, also when it comes before that first step: a wrapping
    coroutine that had not started would end there and leave ``coro``
    suspended forever, waiting in a lock's queue, for instance.
    """

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, None, None], first: Any) -> None:
        self._coro = coro
        self._first = first

    def send(self, value: Any) -> Any:
        first = self._first
        if first is not _STARTED:
            self._first = _STARTED
            return first
        return self._coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        self._first = _STARTED
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, Any, None]:
        sent: Any = None
        error: BaseException | None = None
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
