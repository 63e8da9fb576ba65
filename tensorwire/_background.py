"""An event loop in a background thread, for the blocking facades.

``rpc.SyncClient`` and ``ps.SyncClient`` both run their async client here.
Scheduling and closing share one lock, so a call submitted from another
thread either gets in before ``close()`` or is refused, never lost; and
``close()`` lets the calls submitted before it end (they fail fast once the
client is closed) before it stops the loop, so no caller waits forever.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from .errors import FailedPrecondition

__all__ = ("BackgroundLoop",)

T = TypeVar("T")

#: How long close() waits for calls submitted before it to end.
CLOSE_WAIT = 10.0


class BackgroundLoop:
    """A daemon thread running an event loop; coroutines go in, futures come out."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._lock = threading.Lock()
        self._closed = False
        self._running: set[concurrent.futures.Future[Any]] = set()

    def run(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop.

        Raises:
            FailedPrecondition: the facade is closed.
        """
        with self._lock:
            if self._closed:
                coro.close()
                raise FailedPrecondition("the client is closed")
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
            self._running.add(future)
        future.add_done_callback(self._running.discard)
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
        """Run ``closing`` (the client's close), let earlier calls end, stop the thread."""
        with self._lock:
            if self._closed:
                if closing is not None:
                    closing.close()
                return
            done = (asyncio.run_coroutine_threadsafe(closing, self.loop)
                    if closing is not None else None)
            self._closed = True
        try:
            if done is not None:
                done.result()
            _, unfinished = concurrent.futures.wait(list(self._running), timeout=CLOSE_WAIT)
            for future in unfinished:
                future.cancel()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
            self.loop.close()
