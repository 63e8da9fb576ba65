"""A blocking client for plain training loops.

Runs a :class:`Client` on an event loop in a background thread. ``call``
blocks; ``submit`` returns a ``concurrent.futures.Future`` so communication
overlaps computation.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

from .._background import BackgroundLoop
from ._proxy import Proxy
from .client import Client
from .config import ClientConfig

__all__ = ("SyncClient",)

S = TypeVar("S")
T = TypeVar("T")


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
        self._background = BackgroundLoop(f"tensorwire-client {address}")
        self._client = Client(address, config=config)
        self._run = self._background.run
        self._wait = self._background.wait

    def connect(self) -> SyncClient:
        """Connect now (calls connect on demand anyway)."""
        self._run(self._client.connect()).result()
        return self

    def call(self, method: str, /, *args: Any, timeout: float | None = None,
             idempotent: bool = False, **kwargs: Any) -> Any:
        """Call and wait for the result; raises what ``Client.call`` raises."""
        return self._call(method, timeout, idempotent, *args, **kwargs)

    def _call(self, method: str, timeout: float | None, idempotent: bool, /,
              *args: Any, **kwargs: Any) -> Any:
        """``call`` with its options by position (what proxies call)."""
        return self._wait(self._run(self._client._call(method, timeout, idempotent,
                                                       *args, **kwargs)))

    def submit(self, method: str, /, *args: Any, timeout: float | None = None,
               idempotent: bool = False, **kwargs: Any) -> concurrent.futures.Future[Any]:
        """Start a call; its future's ``cancel()`` cancels it on the server too."""
        return self._run(self._client._call(method, timeout, idempotent, *args, **kwargs))

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
        """Close the connection, let calls submitted before it end, stop the thread."""
        self._background.close(self._client.close())

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
