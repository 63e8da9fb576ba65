"""The worker's links to the shards: connections, send windows, retries.

Every shard method is idempotent, so a call to a shard that is unreachable
is retried (with backoff, up to ``PSConfig.retry_timeout``); a shard that
comes back may have restarted from a checkpoint, so the worker's latest
push is sent again before a retried pull. Shards are called through a
typed proxy of :class:`~tensorwire.ps.server.Shard`.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

from .. import rpc
from ..errors import DeadlineExceeded, PlacementMoved, Unavailable
from ._compress import Payload
from .config import PSConfig
from .server import Shard

__all__ = ("Link", "ShardLinks", "Window")

logger = logging.getLogger(__name__)

T = TypeVar("T")
P = ParamSpec("P")
# How long after the server-side wait the RPC deadline falls, so the shard's
# DeadlineExceeded (which names the workers behind) arrives first.
_MARGIN = 5.0


class Window:
    """At most ``limit`` messages in flight to one shard (None: no limit);
    the others wait in a priority queue, lowest key first (ByteScheduler,
    Peng et al. 2019: a bounded window so an urgent message need not queue
    behind everything already sent)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.active = 0
        self._queue: list[tuple[tuple[int, ...], int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    @contextlib.asynccontextmanager
    async def slot(self, key: tuple[int, ...]) -> AsyncIterator[None]:
        """Hold one of the window's places while the block runs."""
        if self.limit is not None and (self.active >= self.limit or self._queue):
            waiter = asyncio.get_running_loop().create_future()
            heapq.heappush(self._queue, (key, next(self._order), waiter))
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._release()  # granted just as we were cancelled
                raise
        else:
            self.active += 1
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        while self._queue:
            _, _, waiter = heapq.heappop(self._queue)
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on
                return
        self.active -= 1


class Link:
    """One shard connection, its send window, and the wall time during
    which at least one call to it was in flight."""

    def __init__(self, client: rpc.Client, window: int | None, timeout: float) -> None:
        self.client = client
        #: The shard's methods, each call with ``timeout``.
        self.shard = client.proxy(Shard, timeout=timeout)
        self.window = Window(window)
        self.host: str | None = None
        self.busy = 0.0
        self.active = 0
        self._since = 0.0
        #: At the last bandwidth measurement: (busy seconds, bytes, waited seconds).
        self.mark = (0.0, 0.0, 0.0)
        #: The bandwidth estimate rebalance() uses (bytes/s).
        self.estimate: float | None = None

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        """Count the block's wall time as busy (overlapping calls once)."""
        if self.active == 0:
            self._since = time.monotonic()
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1
            if self.active == 0:
                self.busy += time.monotonic() - self._since

    def busy_now(self) -> float:
        """Seconds with a call in flight so far, the current stretch included."""
        return self.busy + (time.monotonic() - self._since if self.active else 0.0)


class ShardLinks:
    """One worker's links to every shard it knows, and calls that retry.

    Attributes:
        addresses: the shards of the current placement, in its order.
        pushed: per chunk, the clock and payload of this worker's latest
            push, sent again after a shard reconnects.
        seen: per chunk, the clock of this worker's latest read of it.
    """

    def __init__(self, addresses: Sequence[str], *, worker: int, config: PSConfig) -> None:
        self.addresses = list(addresses)
        self.worker = worker
        self.config = config
        self._links: dict[str, Link] = {}
        self.pushed: dict[str, tuple[int, Payload]] = {}
        self.seen: dict[str, int] = {}
        self.closed = False
        # Set by close(): wakes calls waiting out a reconnection backoff.
        self._closing = asyncio.Event()
        for address in self.addresses:
            self.link(address)

    def link(self, address: str) -> Link:
        """The link to ``address``, made on first use (not yet connected)."""
        link = self._links.get(address)
        if link is None:
            window = self.config.window if self.config.priority else None
            link = self._links[address] = Link(
                rpc.Client(address, config=self.config.rpc), window,
                self.config.timeout + _MARGIN)
        return link

    async def hello(self, address: str) -> None:
        """Connect to ``address`` and learn its host, unless done before.

        Raises:
            Unavailable: the shard stayed unreachable.
        """
        link = self.link(address)
        if link.host is None:
            await link.client.connect()
            info = await self.call(address, Shard.hello)
            link.host = str(info["host"])

    async def close(self) -> None:
        """Close every link; calls in flight and waiting to retry fail."""
        self.closed = True
        self._closing.set()
        await asyncio.gather(*(link.client.close() for link in self._links.values()),
                             return_exceptions=True)

    async def call(self, address: str, method: Callable[Concatenate[Shard, P], Awaitable[T]],
                   *args: P.args, **kwargs: P.kwargs) -> T:
        """``method`` of the shard at ``address`` (a :class:`Shard` method, so
        the arguments are checked against it), retrying while the shard is
        unreachable (all methods are idempotent).

        While the shard is unreachable, a call that carries a placement
        ``version`` asks the other shards whether a later placement moved
        its chunks away.

        Raises:
            PlacementMoved: the shard serves a later placement version.
            Unavailable: the shard stayed unreachable, or the links were closed.
            DeadlineExceeded: the shard's wait for other workers ran out.
        """
        return await self._call(address, None, method, args, kwargs)

    async def read(self, address: str, resend: tuple[Sequence[str], int],
                   method: Callable[Concatenate[Shard, P], Awaitable[T]],
                   *args: P.args, **kwargs: P.kwargs) -> T:
        """:meth:`call` for a method that reads chunks (pull, push_pull).

        A shard that comes back may have restarted from a checkpoint and lost
        this worker's last push, so with ``resend=(keys, clock)`` that push of
        ``keys`` goes again before each retry (a copy the shard already has
        is ignored).

        Raises:
            What :meth:`call` raises.
        """
        return await self._call(address, resend, method, args, kwargs)

    async def _call(self, address: str, resend: tuple[Sequence[str], int] | None,
                    method: Callable[..., Awaitable[T]], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> T:
        remote = getattr(self.link(address).shard, method.__name__)
        version = kwargs.get("version")
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.config.retry_timeout
        pause = 0.05
        while True:
            try:
                result = await remote(*args, **kwargs)
            except Unavailable as exc:
                if self.closed or loop.time() + pause > give_up:
                    raise
                logger.warning("shard %s unavailable (%s); retrying", address, exc)
                if version is not None:
                    # A shard that left the placement may have been stopped:
                    # the others know where its chunks went.
                    newer = await self._newest_version(address)
                    if newer > version:
                        raise PlacementMoved(
                            f"shard {address} is unreachable and the placement moved on to "
                            f"version {newer}", version=newer) from None
            except DeadlineExceeded as exc:
                # Which shard: the wait it describes is that shard's.
                raise DeadlineExceeded(
                    f"shard {address}: {exc.message}", type_name=exc.type_name,
                    remote_traceback=exc.remote_traceback, details=exc.details) from None
            else:
                return cast(T, result)
            # A backoff between reconnection attempts, cut short by close().
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), pause)
            if self.closed:
                raise Unavailable(f"shard {address}: the client was closed")
            pause = min(pause * 2, 1.0)
            if resend is not None:
                try:
                    await self._resend(self.link(address).shard, *resend, version)
                except Unavailable:
                    continue

    async def _newest_version(self, unreachable: str) -> int:
        """The latest placement version the other shards of the placement
        serve, asked briefly (0 when none answers)."""
        others = [a for a in self.addresses if a != unreachable]

        async def ask(address: str) -> int:
            info = await self.link(address).client.proxy(Shard, timeout=2.0).hello()
            return int(info["version"])

        answers = await asyncio.gather(*(ask(a) for a in others), return_exceptions=True)
        return max((a for a in answers if isinstance(a, int)), default=0)

    async def _resend(self, shard: Shard, keys: Sequence[str], clock: int,
                      version: int | None) -> None:
        """Push again this worker's latest payloads of ``keys`` from before ``clock``."""
        by_clock: dict[int, list[str]] = {}
        for key in keys:
            last = self.pushed.get(key)
            if last is not None and last[0] < clock:
                by_clock.setdefault(last[0], []).append(key)
        for pushed, group in by_clock.items():
            seen = min(self.seen.get(k, 0) for k in group)
            await shard.push(self.worker, pushed, group, [self.pushed[k][1] for k in group],
                             seen, self.config.timeout, version=version or 0)
