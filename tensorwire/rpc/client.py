"""The RPC client: calls over one multiplexed connection, with typed proxies."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Coroutine, Generator
from typing import Any, TypeAlias, TypeVar, cast

from .. import serde
from .._counters import MethodMetrics, Metrics, record_call
from ..errors import (
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
from ._call_table import CallTable
from ._calls import CLIENT, CallState
from ._calls_in_flight import LONGEST, CallsInFlight, UnaryCall, until_drained
from ._client_core import ClientCore, SessionCore, sendable, split_stream
from ._connection_driver import ConnectionDriver
from ._proxy import Proxy
from ._slots import Slots
from ._streams import CallStreams
from .config import ClientConfig

__all__ = ("Client", "connect")

logger = logging.getLogger(__name__)

S = TypeVar("S")


#: The longest timeout a request carries (see _calls_in_flight.LONGEST).
_LONGEST = LONGEST
_sendable = sendable
_split_stream = split_stream


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


#: What ``_ClientSession.pending`` holds for a call: a plain unary call's
#: ``UnaryCall`` (compiled, a CallState with a future), else the ``CallStreams`` of
#: a call with a stream (a streamed result, a streamed argument, or both).
_InFlight: TypeAlias = "UnaryCall | CallStreams"


class _ClientSession(SessionCore):
    """One connection of a client: ``SessionCore`` (compiled: what every
    call reads of it), opened, and the handlers of its messages."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.driver = None
        self.loop = asyncio.get_running_loop()
        self.slots = Slots(1, self.loop)
        self.error = None
        # The calls in flight (compiled): RESPONSEs resolve their futures
        # there; every other message comes to _on_message.
        self.calls = CallsInFlight(self.loop, self._on_message, client._encoder)
        self.pending: CallTable[_InFlight] = self.calls.pending

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
            self.calls,
            self._on_close,
            heartbeat_timeout=config.heartbeat_timeout,
            ping_interval=config.heartbeat_interval,
            on_refused=self._on_refused,
            max_unsent=config.transport.max_unsent_bytes,
        )
        self.driver.start()

    async def wait_for_slot(self, deadline: float, method: str) -> None:
        """``take_slot()``, waiting within the call's deadline: for one of
        the calls in flight that the server allows (only a client with
        more calls than that waits here), then until the server has taken
        enough of what was sent (``until_drained``).

        Raises:
            TimeoutError: the deadline passed while it waited for a slot.
            DeadlineExceeded: it passed while the output drained.
            Unavailable: the connection was lost meanwhile.
        """
        async with asyncio.timeout_at(deadline):
            await self.slots.acquire()
        try:
            driver = _driver(self)
            if self.error is not None:
                raise Unavailable(f"connection to {self.client.address} lost: {self.error}")
            if driver.reading_paused:
                await until_drained(driver, deadline, method)
        except BaseException:
            self.slots.release()
            raise

    def _on_message(self, message: protocol.Message, nbytes: int) -> None:
        """Every message but a unary call's RESPONSE (see ``calls``)."""
        if isinstance(message, protocol.Pong):
            return
        if not isinstance(
            message,
            protocol.Response | protocol.Error | protocol.Item | protocol.End | protocol.Credit,
        ):
            raise ProtocolError(f"a server may not send {message.kind.name}")
        streams = self.pending.get(message.call_id)
        if type(streams) is CallStreams:
            streams.receive(message, nbytes)  # raises ProtocolError: the connection ends
        # else the call ended already (cancelled, timed out): dropped

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
        if type(pending) is not CallStreams:
            self.calls.fail(message.call_id, exhausted)  # a unary call
            return
        # A stream: the consumer still gets the items before this one, then
        # the error, in order; the server stops producing.
        if pending.state.result_streams:
            pending.cancel()
        pending.end_with(exhausted)

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
        self.calls.fail_all(lost)

    async def close(self) -> None:
        if self.driver is not None:
            await self.driver.close()


class Client(ClientCore):
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

    def _streaming_argument(
        self, session: _ClientSession, method: str, source: AsyncIterable[Any],
        metrics: MethodMetrics,
    ) -> tuple[CallStreams, Callable[[int], asyncio.Task[None]]]:
        """For a call with a streamed argument: its streams (the waiter of
        its answer), and what starts sending the items once the call has
        its id."""
        # Probing as a plain call does (see _calls_in_flight): a method
        # that streams its result answers with its first item.
        probing = session.calls.probes(method)
        streams = CallStreams(CallState(CLIENT, True, probing, 1 if probing else 0),
                              _driver(session), method, metrics, probing=probing)
        streams.state.send(protocol.Kind.REQUEST)
        return streams, lambda call_id: self._start_pump(streams, call_id, source)

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
        payload = self._encoder.encode_arguments(args, kwargs)
        metrics = self._metrics[method]
        started = time.perf_counter()
        error = True
        loop = asyncio.get_running_loop()
        try:
            # Each wait is bounded by the deadline on its own: a timeout held
            # across ``yield`` would cancel the consumer's code between items.
            async with asyncio.timeout_at(deadline):
                await session.slots.acquire()
            try:
                streams = self._register(session, method, source is not None, metrics)
                pump: asyncio.Task[None] | None = None
                try:
                    driver = _driver(session)
                    remaining = deadline - loop.time()
                    if not 0.0 < remaining < _LONGEST:
                        remaining = _sendable(remaining)
                    async with asyncio.timeout_at(deadline):
                        metrics.bytes_out += await driver.send(protocol.Request(
                            streams.call_id, method, remaining, stream_arg, payload))
                    streams.open()
                    if source is not None:
                        pump = self._start_pump(streams, streams.call_id, source)
                    while True:
                        async with asyncio.timeout_at(deadline):
                            item = await streams.next_item()
                        if item is None:
                            break
                        yield self._decoder.decode(item.value[0], item.value[1:])
                finally:
                    streams.cancel()  # unless the call is over for the server
                    session.pending.pop(streams.call_id, None)
                    await _stop(pump)
            finally:
                session.slots.release()
            error = False
        except DeadlineExceeded:
            raise  # the server's own, with its message and traceback
        except TimeoutError:
            raise DeadlineExceeded(f"{method} did not finish within its deadline") from None
        finally:
            record_call(metrics, self.config.timeline, method, "rpc.client", started, error)

    def _start_pump(self, streams: CallStreams, call_id: int,
                    source: AsyncIterable[Any]) -> asyncio.Task[None]:
        streams.call_id = call_id
        return asyncio.get_running_loop().create_task(self._pump(streams, source))

    async def _pump(self, streams: CallStreams, source: AsyncIterable[Any]) -> None:
        """Send the items of a streamed argument, within the server's credit."""
        try:
            async for item in source:
                if not await streams.send_item(self._encode(item)):
                    return  # the call is over (the server answered): stop
            await streams.send_end()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # The caller's iterable failed: end the call with that error.
            streams.end_with(exc)

    def _register(self, session: _ClientSession, method: str, arg_streams: bool,
                  metrics: MethodMetrics) -> CallStreams:
        """A streaming call's streams, under a new call id, its REQUEST
        recorded (the caller sends it)."""
        if session.error is not None:
            raise Unavailable(f"connection to {self.address} lost: {session.error}")
        state = CallState(CLIENT, arg_streams, True, self.config.stream_window)
        state.send(protocol.Kind.REQUEST)
        streams = CallStreams(state, _driver(session), method, metrics)
        streams.call_id = session.calls.add(streams, math.inf)
        return streams

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
