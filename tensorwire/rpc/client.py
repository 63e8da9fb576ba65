"""The RPC client: calls over one multiplexed connection, with typed proxies."""

from __future__ import annotations

import asyncio
import collections.abc
import contextlib
import heapq
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Coroutine, Generator
from heapq import heappush
from typing import Any, TypeAlias, TypeVar, cast, final

from .. import serde
from .._counters import MethodMetrics, Metrics
from ..errors import (
    ConfigError,
    DeadlineExceeded,
    LimitExceededError,
    ProtocolError,
    RemoteError,
    ResourceExhausted,
    TensorwireError,
    TransportError,
    Unavailable,
)
from ..transports import connect as transport_connect
from . import protocol
from ._connection_driver import ConnectionDriver
from ._proxy import Proxy
from ._slots import Slots
from .config import ClientConfig

__all__ = ("Client", "connect")

logger = logging.getLogger(__name__)

S = TypeVar("S")


#: Seconds the client's own deadline timer waits past the deadline.
_DEADLINE_GRACE = 0.05
#: The longest timeout a request carries: a longer one, infinity included,
#: is this (half the protocol's bound: "no deadline" for any practical use).
_LONGEST = protocol.MAX_TIMEOUT / 2


def _sendable(timeout: float) -> float:
    """A call's timeout outside (0, _LONGEST), as its request can carry it:
    none left is 0.0 (the call then fails before it is sent), a longer one
    is ``_LONGEST``.

    Raises:
        ConfigError: the timeout is not a number of seconds (NaN).
    """
    if math.isnan(timeout):
        raise ConfigError(f"a call's timeout must be a number of seconds, got {timeout!r}")
    return 0.0 if timeout <= 0.0 else _LONGEST


def connect(address: str, *, config: ClientConfig | None = None, **options: Any) -> Client:
    """A client for the server at ``address``.

    Use it as ``async with connect(url) as client:`` or
    ``client = await connect(url)``; keyword options build the
    :class:`ClientConfig` (``timeout=5``, ``secret=b"..."``).
    """
    if options:
        base = config or ClientConfig()
        config = type(base)(**{**_fields(base), **options})
    return Client(address, config=config)


def _fields(config: ClientConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


@final
class _Pending:
    """A streaming call in flight, or a unary call with a streamed argument:
    its future, its queue of messages (streams), its credit.

    A plain unary call waits on a bare future instead (see ``_ClientSession.pending``).
    Either future's result is ``(message, nbytes)``.
    """

    __slots__ = ("credit", "credit_event", "future", "items", "metrics", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop, streaming: bool,
                 metrics: MethodMetrics) -> None:
        self.future: asyncio.Future[tuple[protocol.Message, int]] = loop.create_future()
        self.metrics = metrics
        self.items: deque[protocol.Message] | None = deque() if streaming else None
        self.waiter: asyncio.Future[None] | None = None
        self.credit = 0
        self.credit_event: asyncio.Event | None = None

    def deliver(self, message: protocol.Message, nbytes: int) -> None:
        if self.items is None or isinstance(message, protocol.Response):
            if not self.future.done():
                self.future.set_result((message, nbytes))
            return
        self.metrics.bytes_in += nbytes
        self.items.append(message)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def fail(self, error: BaseException) -> None:
        _fail(self.future, error)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(error)

    def grant(self, count: int) -> None:
        self.credit += max(0, count)
        if self.credit_event is not None:
            self.credit_event.set()


#: What ``_ClientSession.pending`` holds for a call: a bare future for a plain
#: unary call (the hot path: no object of ours per call), else a _Pending.
_InFlight: TypeAlias = "asyncio.Future[tuple[protocol.Message, int]] | _Pending"


def _fail(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
        future.exception()  # retrieved: a stream may never look at it


class _ClientSession:
    """One connection of a client."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.pending: dict[int, _InFlight] = {}
        self.ids = itertools.count(1)
        self.driver: ConnectionDriver | None = None
        self.loop = asyncio.get_running_loop()
        self.slots = Slots(1, self.loop)
        self.error: TensorwireError | None = None
        # Deadlines of unary calls: one loop timer for the earliest instead
        # of one per call (a timer costs several times a heap push). Entries
        # of calls that ended stay until the heap grows past ``compact_at``.
        # Client.call pushes here itself (a method call less per call).
        self.deadlines: list[tuple[float, int]] = []
        self.compact_at = 64
        self.timer_at = math.inf
        self._timer: asyncio.TimerHandle | None = None

    def compact(self) -> None:
        """Drop the deadlines of calls that ended."""
        heap = self.deadlines
        pending = self.pending
        heap[:] = [entry for entry in heap if entry[1] in pending]
        heapq.heapify(heap)
        self.compact_at = 2 * len(heap) + 64

    def arm(self, when: float) -> None:
        """Wake up at ``when`` to expire the calls due then."""
        if self._timer is not None:
            self._timer.cancel()
        self.timer_at = when
        self._timer = self.loop.call_at(when, self._expire_due)

    def _expire_due(self) -> None:
        self._timer, self.timer_at = None, math.inf
        heap = self.deadlines
        now = self.loop.time()
        while heap and heap[0][0] <= now:
            _, call_id = heapq.heappop(heap)
            pending = self.pending.get(call_id)
            if pending is not None:
                # The deadline passed: end the wait.
                _fail(pending.future if type(pending) is _Pending else pending, TimeoutError())
        if heap:
            self.arm(heap[0][0])

    async def open(self) -> None:
        config = self.client.config
        conn = await transport_connect(self.client.address, config=config.transport)
        try:
            shake = protocol.ClientHandshake(secret=config.secret, name=config.name)
            async with asyncio.timeout(config.connect_timeout):
                await conn.send(protocol.encode(shake.start()))
                while not shake.done:
                    reply = shake.receive(protocol.parse(await conn.recv()))
                    if reply is not None:
                        await conn.send(protocol.encode(reply))
        except TimeoutError:
            conn.abort()
            raise Unavailable(f"handshake with {self.client.address} timed out") from None
        except BaseException:
            conn.abort()
            raise
        self.slots = Slots(shake.max_concurrent or 1, self.loop)
        self.driver = ConnectionDriver(
            conn,
            self._on_message,
            self._on_close,
            heartbeat_timeout=config.heartbeat_timeout,
            ping_interval=config.heartbeat_interval,
            on_refused=self._on_refused,
            max_unsent=config.transport.max_unsent_bytes,
        )
        self.driver.start()

    @property
    def alive(self) -> bool:
        return self.driver is not None and not self.driver.closed

    def _on_message(self, message: protocol.Message, nbytes: int) -> None:
        if type(message) is protocol.Response:
            # The hot path: a unary call's answer.
            pending = self.pending.get(message.call_id)
            if pending is not None:
                if type(pending) is _Pending:
                    pending.deliver(message, nbytes)
                elif not pending.done():
                    pending.set_result((message, nbytes))
            return
        if isinstance(message, protocol.Pong):
            return
        if not isinstance(
            message,
            protocol.Response | protocol.Error | protocol.Item | protocol.End | protocol.Credit,
        ):
            raise ProtocolError(f"a server may not send {message.kind.name}")
        pending = self.pending.get(message.call_id)
        if pending is None:
            return  # the call ended already (cancelled, timed out)
        if type(pending) is not _Pending:
            if not isinstance(message, protocol.Credit) and not pending.done():
                pending.set_result((message, nbytes))
            return
        if isinstance(message, protocol.Credit):
            pending.grant(message.count)
            return
        pending.deliver(message, nbytes)

    def _on_refused(self, message: protocol.Message | None,
                    error: LimitExceededError) -> None:
        """A reply beyond the client's limits was skipped: its call fails
        with RESOURCE_EXHAUSTED, the connection goes on."""
        if message is None or isinstance(message, protocol.Request):
            raise error  # no call to blame: the connection ends
        pending = self.pending.get(message.call_id)
        if pending is None:
            return
        exhausted = ResourceExhausted(
            f"a reply from {self.client.address} is beyond this client's limits: {error}")
        if type(pending) is not _Pending:
            _fail(pending, exhausted)
            return
        if pending.items is None:
            pending.fail(exhausted)
            return
        # A stream: the consumer still gets the items before this one, then
        # the error, in order; the server stops producing.
        if self.driver is not None:
            self.driver.send_soon(protocol.Cancel(message.call_id))
        pending.deliver(protocol.Error(message.call_id, int(exhausted.status),
                                       type(exhausted).__name__, exhausted.message, ""), 0)

    def _on_close(self, error: TensorwireError) -> None:
        self.error = error
        lost: RemoteError
        if isinstance(error, Unavailable):
            lost = error
        elif isinstance(error, LimitExceededError):
            # The transport could not skip it: every call on the connection
            # is lost, and they learn which limit did it.
            lost = ResourceExhausted(f"connection to {self.client.address} dropped: {error}")
        else:
            lost = Unavailable(f"connection to {self.client.address} lost: {error}")
        for pending in list(self.pending.values()):
            if type(pending) is _Pending:
                pending.fail(lost)
            else:
                _fail(pending, lost)
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self.timer_at = None, math.inf
        self.deadlines.clear()

    async def close(self) -> None:
        if self.driver is not None:
            await self.driver.close()


class Client:
    """Calls methods on one server; many calls share one connection.

    Reconnects on the next call after the connection is lost; calls to
    methods marked ``idempotent`` are retried once after a reconnect.
    """

    def __init__(self, address: str, *, config: ClientConfig | None = None) -> None:
        self.address = address
        self.config = config or ClientConfig()
        self._session: _ClientSession | None = None
        self._connecting: asyncio.Lock | None = None
        self._failures = 0
        self._next_attempt = 0.0
        self._metrics = Metrics()
        self._closed = False
        # The client's own codec (it runs on one event loop's thread): a
        # call each way less than serde's per-thread functions.
        self._encoder = serde.Encoder()
        self._decoder = serde.Decoder()

    # -- lifetime ------------------------------------------------------------

    async def connect(self) -> Client:
        """Connect now (calls connect on demand anyway).

        Raises:
            Unavailable: the server cannot be reached.
            Unauthenticated: the server refused our secret.
            ProtocolError: the server speaks another protocol version.
        """
        await self._ready()
        return self

    def __await__(self) -> Generator[Any, None, Client]:
        return self.connect().__await__()

    async def __aenter__(self) -> Client:
        return await self.connect()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection; calls in flight fail with ``Unavailable``."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def metrics(self) -> dict[str, dict[str, Any]]:
        """Per-method calls, errors, bytes in and out, latency p50/p90/p99 (s)."""
        return self._metrics.snapshot()

    def transport_stats(self) -> dict[str, dict[str, int]]:
        """The current connection's messages and bytes each way, by server address."""
        session = self._session
        if session is None or session.driver is None:
            return {}
        return {self.address: session.driver.conn.stats()}

    async def _ready(self) -> _ClientSession:
        if self._closed:
            raise Unavailable("the client is closed")
        session = self._session
        if session is not None and session.alive:
            return session
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            session = self._session
            if session is not None and session.alive:
                return session
            return await self._reconnect()

    async def _ready_by(self, deadline: float, method: str) -> _ClientSession:
        """Connect, within the call's deadline."""
        try:
            async with asyncio.timeout_at(deadline):
                return await self._ready()
        except TimeoutError:
            raise DeadlineExceeded(
                f"{method}: could not connect to {self.address} within the call's deadline"
            ) from None

    async def _reconnect(self) -> _ClientSession:
        config = self.config
        last: BaseException | None = None
        for _ in range(config.reconnect_attempts):
            delay = self._next_attempt - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            session = _ClientSession(self)
            try:
                async with asyncio.timeout(config.connect_timeout):
                    await session.open()
            except (TransportError, Unavailable, TimeoutError) as exc:
                last = exc
                self._failures += 1
                backoff = config.reconnect_backoff * 2 ** (self._failures - 1)
                self._next_attempt = time.monotonic() + min(backoff, config.reconnect_backoff_max)
                logger.debug("connecting to %s failed: %s", self.address, exc)
                continue
            if self._closed:
                # close() ran while we were connecting.
                await session.close()
                raise Unavailable("the client is closed")
            self._failures = 0
            self._next_attempt = 0.0
            self._session = session
            return session
        raise Unavailable(f"cannot reach {self.address}: {last}") from last

    # -- calls ---------------------------------------------------------------

    def call(
        self, method: str, /, *args: Any, timeout: float | None = None,
        idempotent: bool = False, **kwargs: Any,
    ) -> Coroutine[Any, Any, Any]:
        """Call ``"Service.method"``; awaiting the call returns its result.

        One argument may be an async iterable: its items stream to the
        server, which receives an async iterator in that place.

        Raises:
            RemoteError: a subclass naming the status (``NotFound``,
                ``InvalidArgument``, ``DeadlineExceeded``, ``Unavailable``,
                ``Internal`` with the remote traceback, ...).
            EncodeError: an argument cannot be encoded.
        """
        return self._call(method, timeout, idempotent, *args, **kwargs)

    async def _call(self, method: str, timeout: float | None, idempotent: bool, /,
                    *args: Any, **kwargs: Any) -> Any:
        """``call``, with its options by position: a typed proxy's method is
        this with them bound (``functools.partial``: no Python frame of its
        own, no keyword dict built for the options on every call)."""
        # The request is queued without waiting: the answer cannot come
        # before it has gone. A call that ends early (deadline, cancel) may
        # leave its request still going out, so its arguments must stay
        # unchanged until then, as with any send cut short. The session's
        # deadline heap, not asyncio.timeout: this runs for every call, and a
        # heap push costs a fraction of the context manager. One coroutine
        # from here to the answer, attempts included: each level of awaiting
        # costs on every call.
        session = self._session
        # _deadline(), inlined.
        loop = session.loop if session is not None else asyncio.get_running_loop()
        remaining = self.config.timeout if timeout is None else timeout
        if not 0.0 < remaining < _LONGEST:
            remaining = _sendable(remaining)
        deadline = loop.time() + remaining
        # Whether the call has waited (to connect, for a slot, to retry) and
        # must work out anew how much of its time remains.
        waited = False
        for arg in args:
            if type(arg) not in _PLAIN:
                args, source, stream_arg = _split_stream(args)
                break
        else:  # the usual case, without _split_stream's calls
            source, stream_arg = None, -1
        # A list, not the tuple: msgpack packs a list in C, a tuple through
        # a Python callback (the server takes either).
        header, buffers = self._encoder.encode_nested([list(args), kwargs])
        payload = [header, *buffers]
        metrics = self._metrics[method]
        # Once, after losing the connection; never with a streamed argument.
        retry = idempotent and source is None
        while True:
            started = time.perf_counter()
            try:
                session = self._session
                # session.alive, inlined
                driver = None if session is None else session.driver
                if session is None or driver is None or driver.error is not None:
                    session = await self._ready_by(deadline, method)
                    driver = _driver(session)
                    waited = True
                error = True
                try:
                    slots = session.slots
                    if slots.free > 0 and not slots.waiters:  # try_acquire(), inlined
                        slots.free -= 1
                    else:
                        # Only a client with more calls than the server allows
                        # in flight waits here, and the deadline bounds the wait.
                        async with asyncio.timeout_at(deadline):
                            await slots.acquire()
                        waited = True
                        if session.error is not None:
                            slots.release()
                            raise Unavailable(
                                f"connection to {self.address} lost: {session.error}")
                    try:
                        loop = session.loop
                        if driver.reading_paused:
                            await _until_drained(driver, deadline, method)
                            waited = True
                        if waited:
                            remaining = deadline - loop.time()
                        if remaining <= 0.0:
                            # Not sent: a handler that cannot suspend would
                            # still run, and answer after the deadline.
                            raise DeadlineExceeded(
                                f"{method}: the deadline passed before the call was sent")
                        call_id = next(session.ids)
                        pending: _InFlight
                        if source is None:
                            future = pending = loop.create_future()
                        else:
                            pending = _Pending(loop, False, metrics)
                            future = pending.future
                        session.pending[call_id] = pending
                        # The server enforces the same deadline; waiting a
                        # moment longer lets its DEADLINE_EXCEEDED, which says
                        # where the time went, arrive first.
                        expires = deadline + _DEADLINE_GRACE
                        heap = session.deadlines
                        heappush(heap, (expires, call_id))
                        if len(heap) > session.compact_at:
                            session.compact()
                        if expires < session.timer_at:
                            session.arm(expires)
                        pump: asyncio.Task[None] | None = None
                        try:
                            metrics.bytes_out += driver.post_frames(protocol.encode_request(
                                call_id, method, remaining, stream_arg, payload))
                            if source is not None:
                                assert type(pending) is _Pending
                                pending.credit_event = asyncio.Event()
                                pump = loop.create_task(
                                    self._pump(session, call_id, pending, source))
                            message, nbytes = await future
                        except BaseException:
                            self._cancel_remote(session, call_id)
                            raise
                        finally:
                            session.pending.pop(call_id, None)
                            if pump is not None:
                                await _stop(pump)
                    finally:
                        if slots.waiters:  # release(), inlined
                            slots.release()
                        else:
                            slots.free += 1
                    metrics.bytes_in += nbytes
                    if type(message) is not protocol.Response:
                        raise _unexpected(message, method)
                    frames = message.value
                    # Without an empty list of buffers: most answers are one frame.
                    result = (self._decoder.decode(frames[0]) if len(frames) == 1
                              else self._decoder.decode(frames[0], frames[1:]))
                    error = False
                    return result
                except DeadlineExceeded:
                    raise  # the server's own, with its message and traceback
                except TimeoutError:
                    raise DeadlineExceeded(
                        f"{method} did not finish within its deadline") from None
                finally:
                    metrics.observe(time.perf_counter() - started, error)
                    if self.config.timeline is not None:
                        self.config.timeline.add_since(method, "rpc.client", started,
                                                       error=error)
            except Unavailable:
                if not retry:
                    raise
                retry = False
                waited = True
                logger.info("retrying idempotent %s after losing the connection", method)

    def _deadline(self, timeout: float | None) -> float:
        session = self._session
        # The session's loop when connected: get_running_loop() asks the OS
        # for the pid on every call on Python 3.11.
        loop = session.loop if session is not None else asyncio.get_running_loop()
        return loop.time() + (self.config.timeout if timeout is None else timeout)
    def stream(
        self, method: str, /, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        """Call a streaming method; iterate over what it yields.

        The server sends at most ``config.stream_window`` items ahead of what
        this iterator has consumed. Leaving the loop early cancels the call.
        """
        return self._stream(method, args, kwargs, self._deadline(timeout))

    async def _stream(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], deadline: float
    ) -> AsyncIterator[Any]:
        session = await self._ready_by(deadline, method)
        args, source, stream_arg = _split_stream(args)
        payload = self._encode([list(args), kwargs])
        window = self.config.stream_window
        metrics = self._metrics[method]
        started = time.perf_counter()
        error = True
        loop = asyncio.get_running_loop()
        finished = False
        try:
            # Each wait is bounded by the deadline on its own: a timeout held
            # across ``yield`` would cancel the consumer's code between items.
            async with asyncio.timeout_at(deadline):
                await session.slots.acquire()
            try:
                call_id, pending = self._register(session, metrics, streaming=True)
                pump: asyncio.Task[None] | None = None
                try:
                    driver = _driver(session)
                    remaining = deadline - loop.time()
                    if not 0.0 < remaining < _LONGEST:
                        remaining = _sendable(remaining)
                    async with asyncio.timeout_at(deadline):
                        metrics.bytes_out += await driver.send(
                            protocol.Request(call_id, method, remaining, stream_arg, payload)
                        )
                    driver.send_soon(protocol.Credit(call_id, window))
                    if source is not None:
                        pending.credit_event = asyncio.Event()
                        pump = loop.create_task(self._pump(session, call_id, pending, source))
                    consumed = 0
                    assert pending.items is not None
                    while True:
                        while not pending.items:
                            if pending.future.done():
                                pending.future.result()  # raises the connection error
                            pending.waiter = loop.create_future()
                            async with asyncio.timeout_at(deadline):
                                await pending.waiter
                        message = pending.items.popleft()
                        if isinstance(message, protocol.End):
                            finished = True
                            break
                        if isinstance(message, protocol.Error):
                            finished = True
                            raise _remote(message)
                        assert isinstance(message, protocol.Item)
                        consumed += 1
                        if consumed >= max(1, window // 2):
                            driver.send_soon(protocol.Credit(call_id, consumed))
                            consumed = 0
                        yield self._decoder.decode(message.value[0], message.value[1:])
                finally:
                    if not finished:
                        self._cancel_remote(session, call_id)
                    session.pending.pop(call_id, None)
                    await _stop(pump)
            finally:
                session.slots.release()
            error = False
        except DeadlineExceeded:
            raise  # the server's own, with its message and traceback
        except TimeoutError:
            raise DeadlineExceeded(f"{method} did not finish within its deadline") from None
        finally:
            metrics.observe(time.perf_counter() - started, error)
            if self.config.timeline is not None:
                self.config.timeline.add_since(method, "rpc.client", started, error=error)

    async def _pump(
        self, session: _ClientSession, call_id: int, pending: _Pending, source: AsyncIterable[Any]
    ) -> None:
        driver = _driver(session)
        event = pending.credit_event
        assert event is not None
        try:
            async for item in source:
                while pending.credit <= 0:
                    event.clear()
                    await event.wait()
                pending.credit -= 1
                await driver.send(protocol.Item(call_id, self._encode(item)))
            await driver.send(protocol.End(call_id))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # The caller's iterable failed: end the call with that error.
            pending.fail(exc)

    def _encode(self, value: Any) -> list[Any]:
        header, buffers = self._encoder.encode(value)
        return [header, *buffers]

    def _register(self, session: _ClientSession, metrics: MethodMetrics, *,
                  streaming: bool) -> tuple[int, _Pending]:
        if session.error is not None:
            raise Unavailable(f"connection to {self.address} lost: {session.error}")
        call_id = next(session.ids)
        pending = _Pending(session.loop, streaming, metrics)
        session.pending[call_id] = pending
        return call_id, pending

    def _cancel_remote(self, session: _ClientSession, call_id: int) -> None:
        driver = session.driver
        if driver is not None and call_id in session.pending:
            driver.send_soon(protocol.Cancel(call_id))

    # -- proxies and introspection ----------------------------------------------

    def proxy(self, cls: type[S], *, timeout: float | None = None) -> S:
        """A typed stand-in for ``cls`` whose methods call the server.

        Unary methods return awaitables, streaming methods async iterators.
        """
        return cast(S, Proxy(self, cls, timeout))

    async def services(self) -> list[dict[str, Any]]:
        """What the server hosts: services, methods, signatures, docstrings."""
        result: list[dict[str, Any]] = await self.call(
            "tensorwire.Reflection.services", idempotent=True
        )
        return result


async def _until_drained(driver: ConnectionDriver, deadline: float, method: str) -> None:
    """Wait, within the call's deadline, until the server has taken enough
    of what this client sent (``TransportConfig.max_unsent_bytes``): a
    server that does not read then holds the client's calls back instead of
    growing its outbox.

    Raises:
        DeadlineExceeded: the deadline passed first (the call was not sent).
        Unavailable: the connection was lost meanwhile.
    """
    try:
        async with asyncio.timeout_at(deadline):
            await driver.drained()
    except TimeoutError:
        raise DeadlineExceeded(f"{method}: the deadline passed before the call was sent "
                               f"(the server is not taking what was sent)") from None


def _driver(session: _ClientSession) -> ConnectionDriver:
    driver = session.driver
    if driver is None:
        raise Unavailable("not connected")
    return driver


async def _stop(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _split_stream(
    args: tuple[Any, ...],
) -> tuple[tuple[Any, ...], AsyncIterable[Any] | None, int]:
    """Take the async-iterable argument (if any) out of ``args``."""
    index = _aiter_index(args)
    if index < 0:
        return args, None, -1
    return args[:index] + args[index + 1 :], args[index], index


#: Argument types that are never async iterables, checked first: the ABC's
#: isinstance() costs several times a set lookup, for every argument.
_PLAIN = frozenset({int, float, str, bytes, bool, type(None), list, tuple, dict})


def _aiter_index(args: tuple[Any, ...]) -> int:
    for index, arg in enumerate(args):
        if type(arg) not in _PLAIN and isinstance(arg, collections.abc.AsyncIterable):
            return index
    return -1


def _remote(message: protocol.Error) -> RemoteError:
    cls = RemoteError.for_status(message.status, message.type_name)
    return cls(message.message, type_name=message.type_name,
               remote_traceback=message.traceback, details=message.details)


def _unexpected(message: protocol.Message, method: str) -> Exception:
    """What a unary call raises for an answer that is not a RESPONSE."""
    if isinstance(message, protocol.Error):
        return _remote(message)
    return ProtocolError(f"unexpected {message.kind.name} for unary call {method}")
