"""A blocking client for plain training loops.

Runs a :class:`Client` on an event loop in a background thread. ``call``
blocks; ``submit`` returns a ``concurrent.futures.Future`` so communication
overlaps computation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar, cast

from ._proxy import Proxy
from .client import Client
from .config import ClientConfig

__all__ = ("SyncClient",)

S = TypeVar("S")
T = TypeVar("T")

#: How long close() waits for calls submitted before it to end.
_CLOSE_WAIT = 10.0


class SyncClient:
    """Blocking calls from any thread; one background event-loop thread.

    Example::

        with SyncClient("tcp://10.0.0.1:7000") as client:
            store = client.proxy(Store)
            store.put("w", weights)                      # blocks
            future = client.submit("Store.get", "w")     # returns at once
            ...                                          # compute meanwhile
            w = future.result()
    """

    def __init__(self, address: str, *, config: ClientConfig | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"tensorwire-client {address}", daemon=True
        )
        self._thread.start()
        self._client = Client(address, config=config)
        self._closed = False
        # Held while scheduling and while closing: a submit() from another
        # thread either gets in before close() or is refused, never lost.
        self._lock = threading.Lock()
        # Scheduled and not yet finished: close() lets them finish (they fail
        # fast once the client is closed) before it stops the loop.
        self._running: set[concurrent.futures.Future[Any]] = set()

    def _run(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        with self._lock:
            if self._closed:
                coro.close()
                raise RuntimeError("the SyncClient is closed")
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
            self._running.add(future)
        future.add_done_callback(self._running.discard)
        return future

    @staticmethod
    def _wait(future: concurrent.futures.Future[T]) -> T:
        try:
            return future.result()
        except BaseException:
            # Ctrl-C (or any error here) must not leave the call running.
            future.cancel()
            raise

    def connect(self) -> SyncClient:
        """Connect now (calls connect on demand anyway)."""
        self._run(self._client.connect()).result()
        return self

    def call(self, method: str, /, *args: Any, timeout: float | None = None,
             idempotent: bool = False, **kwargs: Any) -> Any:
        """Call and wait for the result; raises what ``Client.call`` raises."""
        return self._wait(self.submit(method, *args, timeout=timeout, idempotent=idempotent,
                                      **kwargs))

    def submit(self, method: str, /, *args: Any, timeout: float | None = None,
               idempotent: bool = False, **kwargs: Any) -> concurrent.futures.Future[Any]:
        """Start a call; its future's ``cancel()`` cancels it on the server too."""
        return self._run(
            self._client.call(method, *args, timeout=timeout, idempotent=idempotent, **kwargs)
        )

    def stream(self, method: str, /, *args: Any, timeout: float | None = None,
               **kwargs: Any) -> Iterator[Any]:
        """Iterate over a streaming method's items, blocking for each."""
        # The iterator must be made on the loop: its deadline is loop time.
        iterator = self._run(
            _value(lambda: self._client.stream(method, *args, timeout=timeout, **kwargs))
        ).result()
        try:
            while True:
                try:
                    yield self._run(_anext(iterator)).result()
                except StopAsyncIteration:
                    return
        finally:
            self._run(_aclose(iterator)).result()

    def proxy(self, cls: type[S], *, timeout: float | None = None) -> S:
        """A typed stand-in for ``cls`` with blocking methods (streams: iterators)."""
        return cast(S, Proxy(self, cls, timeout))

    def metrics(self) -> dict[str, dict[str, Any]]:
        """See ``Client.metrics``."""
        return self._run(_value(self._client.metrics)).result()

    def close(self) -> None:
        """Close the connection and stop the background thread."""
        with self._lock:
            if self._closed:
                return
            closing = asyncio.run_coroutine_threadsafe(self._client.close(), self._loop)
            self._closed = True
        closing.result()
        _, unfinished = concurrent.futures.wait(list(self._running), timeout=_CLOSE_WAIT)
        for future in unfinished:
            future.cancel()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


async def _anext(iterator: Any) -> Any:
    return await iterator.__anext__()


async def _aclose(iterator: Any) -> None:
    await iterator.aclose()


async def _value(fn: Callable[[], T]) -> T:
    return fn()
