"""An event loop in a background thread, for the blocking facades.

``rpc.SyncClient``, ``ps.SyncClient`` and ``collective.SyncGroup`` run their
async client here. Scheduling and closing share one lock, so a call
submitted from another thread either gets in before ``close()`` or is
refused, never lost; and ``close()`` lets the calls submitted before it end
(they fail fast once the client is closed) before it stops the loop, so no
caller waits forever.

Several facades may share one loop thread (``BackgroundLoop(name,
beside=other)``): ucx:// runs one UCX worker per process, driven by one
event loop, so a process that talks ucx:// through a group and a
parameter-server client must run both on the same loop. Each facade keeps
its own calls and its own ``close()``; the thread stops when the last one
closed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

from .errors import FailedPrecondition

__all__ = ("BackgroundLoop", "HasBackgroundLoop")

T = TypeVar("T")

#: How long close() waits for calls submitted before it to end.
CLOSE_WAIT = 10.0


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (a core dependency on
    Linux), asyncio's elsewhere. A blocking call pays the loop's turns on
    top of two thread hand-offs: tiny ``rpc.SyncClient`` calls over tcp://
    took 174-190 µs at the median on uvloop against 228-246 µs on asyncio's
    loop (the same run, alternating)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class _LoopThread:
    """An event loop in a daemon thread, stopped when its last user leaves."""

    def __init__(self, name: str) -> None:
        self.loop = new_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._lock = threading.Lock()
        self._users = 1

    def join(self) -> None:
        """One more user.

        Raises:
            FailedPrecondition: every earlier user left and the loop stopped.
        """
        with self._lock:
            if self._users == 0:
                raise FailedPrecondition("that background loop was closed")
            self._users += 1

    def leave(self) -> None:
        """One user less; the last one stops the loop and joins the thread."""
        with self._lock:
            self._users -= 1
            last = self._users == 0
        if last:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
            self.loop.close()


class BackgroundLoop:
    """A daemon thread running an event loop; coroutines go in, futures come out.

    Args:
        name: the thread's name.
        beside: run on that facade's loop thread instead of a new one.

    Raises:
        FailedPrecondition: ``beside`` was closed.
    """

    def __init__(self, name: str, *, beside: BackgroundLoop | None = None) -> None:
        if beside is None:
            self._thread = _LoopThread(name)
        else:
            beside._thread.join()
            self._thread = beside._thread
        self.loop = self._thread.loop
        self._lock = threading.Lock()
        self._closed = False
        self._running: set[concurrent.futures.Future[Any]] = set()

    def run(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop.

        What ``asyncio.run_coroutine_threadsafe`` does, with the future
        settled by the task itself as ``coro`` ends rather than by a
        callback one loop turn later, and with everything set up before the
        loop thread is woken (the last step here): a caller waiting on the
        result gets it that much sooner, and the woken thread does not
        wait for this one to finish (issue 25's DDP hook hands every bucket
        over this way). Cancelling the future cancels the task.

        Raises:
            FailedPrecondition: the facade is closed.
        """
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        future.add_done_callback(self._running.discard)
        with self._lock:
            if self._closed:
                coro.close()
                raise FailedPrecondition("the client is closed")
            self._running.add(future)
            self.loop.call_soon_threadsafe(_start, self.loop, coro, future)
        return future

    @staticmethod
    def wait(future: concurrent.futures.Future[T]) -> T:
        """The result; Ctrl-C (or any error here) cancels the call, not only the wait."""
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def close(self, closing: Coroutine[Any, Any, Any] | None = None) -> None:
        """Run ``closing`` (the client's close), let earlier calls end, and
        leave the thread (stopped once no facade shares it any more)."""
        with self._lock:
            if self._closed:
                if closing is not None:
                    closing.close()
                return
            done: concurrent.futures.Future[Any] | None = None
            if closing is not None:
                done = concurrent.futures.Future()
                self.loop.call_soon_threadsafe(_start, self.loop, closing, done)
            self._closed = True
        try:
            if done is not None:
                done.result()
            _, unfinished = concurrent.futures.wait(list(self._running), timeout=CLOSE_WAIT)
            for future in unfinished:
                future.cancel()
        finally:
            self._thread.leave()


def _start(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T],
           future: concurrent.futures.Future[T]) -> None:
    """On the loop thread: run ``coro`` in a task that settles ``future``."""
    if _dropped(coro, future):
        return
    task = loop.create_task(_settle(coro, future))
    future.add_done_callback(functools.partial(_cancel_if_cancelled, loop, task))


def _dropped(coro: Coroutine[Any, Any, Any], future: concurrent.futures.Future[Any]) -> bool:
    """True, with ``coro`` closed unrun, when the caller has cancelled
    ``future`` before ``coro`` began; ``future``'s waiters then hear of it."""
    if not future.cancelled():
        return False
    coro.close()
    _notify_cancelled(future)
    return True


def _notify_cancelled(future: concurrent.futures.Future[Any]) -> None:
    """Tell the waiters of ``future`` (cancelled) that it is over:
    ``concurrent.futures.wait()`` and ``as_completed()`` count a cancelled
    future as done only from this call on (``cancel()`` alone wakes those
    blocked in ``result()``), as ``asyncio.run_coroutine_threadsafe``
    makes it."""
    future.set_running_or_notify_cancel()


async def _settle(coro: Coroutine[Any, Any, T], future: concurrent.futures.Future[T]) -> None:
    """Await ``coro`` and pass its outcome on to ``future`` (unless the
    caller cancelled that first). A call cancelled after ``_start`` made
    this task, but before the task's first step, never begins: the check
    below runs before the task's cancel, which comes in a later turn."""
    if _dropped(coro, future):
        return
    try:
        result = await coro
    except asyncio.CancelledError:
        future.cancel()
        _notify_cancelled(future)
        raise
    except BaseException as exc:
        # KeyboardInterrupt and SystemExit too: the caller's to raise
        # (``future.result()`` does), not the loop thread's. Raised there,
        # as from a plain task, they would stop the loop under every other
        # call of every facade that shares it, and those would wait forever.
        if future.set_running_or_notify_cancel():
            future.set_exception(exc)
    else:
        if future.set_running_or_notify_cancel():
            future.set_result(result)


def _cancel_if_cancelled(loop: asyncio.AbstractEventLoop, task: asyncio.Task[None],
                         future: concurrent.futures.Future[Any]) -> None:
    """``future``'s callback: its caller cancelled it, so cancel ``task``."""
    if future.cancelled() and not loop.is_closed():
        loop.call_soon_threadsafe(task.cancel)


class HasBackgroundLoop(Protocol):
    """A blocking facade whose loop thread another one may share (``loop_of=``)."""

    @property
    def background(self) -> BackgroundLoop:
        """The facade's background loop."""
        ...
