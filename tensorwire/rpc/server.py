"""The RPC server: hosts services on any number of addresses."""

from __future__ import annotations

import asyncio
import inspect
import logging
import weakref
from collections.abc import AsyncIterator, Iterable
from typing import Any

from .. import serde
from .._counters import Metrics
from ..errors import (
    ConfigError,
    ConnectionClosedError,
    InvalidArgument,
    LimitExceededError,
    NotFound,
    ProtocolError,
    ResourceExhausted,
    Status,
    TensorwireError,
)
from ..transports import Connection, Listener, listen
from . import protocol
from ._call_table import CallTable
from ._connection_driver import ConnectionDriver
from ._dispatch import (
    Method,
    RequestDispatch,
    ServerCall,
    error_message,
    unpack_arguments,
)
from ._dispatch import (
    encode_value as _encode,
)
from ._slots import Slots
from ._streams import CallStreams
from .config import ServerConfig
from .service import (
    Service,
    describe,
    method,
    service_name,
    signature_text,
)

__all__ = ("Reflection", "Server")

logger = logging.getLogger(__name__)


class Reflection(Service):
    """Built into every server: what it hosts."""

    service_name = "tensorwire.Reflection"

    def __init__(self, server: Server) -> None:
        self._server = server

    @method(idempotent=True)
    async def services(self) -> list[dict[str, Any]]:
        """Every hosted service with its methods, signatures and docstrings."""
        return self._server.describe()


class Server:
    """Hosts services; ``start()`` it on one or more addresses.

    Example::

        server = Server([Store()])
        await server.start("tcp://0.0.0.0:0", "ucx://0.0.0.0:0")
        print(server.addresses)
    """

    def __init__(self, services: Iterable[Service], *, config: ServerConfig | None = None) -> None:
        """Raises ConfigError when two services share a name or a service has no methods."""
        self.config = config or ServerConfig()
        self._metrics = Metrics()
        self._methods: dict[str, Method] = {}
        self._services: dict[str, Service] = {}
        for service in [*services, Reflection(self)]:
            self._add(service)
        self._listeners: list[Listener] = []
        self._sessions: set[_ServerSession] = set()
        self._slots: Slots | None = None
        self._closing = False
        self._closed: asyncio.Event | None = None
        # The server's own codec (it runs on one event loop's thread): a
        # call each way less than serde's per-thread functions.
        self._encoder = serde.Encoder()
        self._decoder = serde.Decoder()

    def _add(self, service: Service) -> None:
        name = service_name(type(service))
        if name in self._services:
            raise ConfigError(f"two services are named {name!r}")
        methods = describe(type(service))
        if not methods:
            raise ConfigError(f"service {name!r} has no @rpc.method methods")
        self._services[name] = service
        for remote, (attr, info) in methods.items():
            full = f"{name}.{remote}"
            self._methods[full] = Method(full, getattr(service, attr), info, self._metrics[full])

    @property
    def addresses(self) -> list[str]:
        """The addresses the server really listens on, in ``start()`` order."""
        return [listener.address for listener in self._listeners]

    async def start(self, *urls: str) -> list[str]:
        """Listen on each URL (``tcp://0.0.0.0:0`` takes a free port).

        Returns the real addresses. Raises TransportError when an address
        cannot be bound (the others stay open).
        """
        if self._slots is None:
            self._slots = Slots(self.config.max_concurrent, asyncio.get_running_loop())
            self._closed = asyncio.Event()
        started = []
        for url in urls:
            listener = await listen(url, self._serve, config=self.config.transport)
            self._listeners.append(listener)
            started.append(listener.address)
            logger.info("serving %s on %s", ", ".join(self._services), listener.address)
        return started

    async def serve_forever(self) -> None:
        """Wait until ``close()``."""
        assert self._closed is not None, "start() the server first"
        await self._closed.wait()

    async def close(self, grace: float | None = None) -> None:
        """Refuse new calls, let calls in flight finish for ``grace`` seconds
        (default: ``config.shutdown_grace``), then cancel the rest and close."""
        if self._closing:
            return
        self._closing = True
        grace = self.config.shutdown_grace if grace is None else grace
        sessions = list(self._sessions)
        for session in sessions:
            session.stop_new_calls()
        running = [task for s in sessions for task in s.call_tasks()]
        if running:
            await asyncio.wait(running, timeout=grace)
        await asyncio.gather(*(listener.close() for listener in self._listeners))
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)
        if self._closed is not None:
            self._closed.set()

    async def __aenter__(self) -> Server:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def metrics(self) -> dict[str, dict[str, Any]]:
        """Per-method calls, errors, bytes in and out, latency p50/p90/p99 (s)."""
        return self._metrics.snapshot()

    def transport_stats(self) -> dict[str, dict[str, int]]:
        """Per connected client (by its address): messages and bytes each way."""
        return {s.driver.conn.peer_address: s.driver.conn.stats() for s in self._sessions}

    def describe(self) -> list[dict[str, Any]]:
        """The hosted services, their methods, signatures and docstrings."""
        out = []
        for name, service in self._services.items():
            methods = [
                {
                    "name": remote,
                    "signature": signature_text(info.signature),
                    "streaming": info.streaming,
                    "idempotent": info.idempotent,
                    "doc": info.doc,
                }
                for remote, (_, info) in describe(type(service)).items()
            ]
            # The class's own docstring only, not one inherited from Service.
            doc = inspect.cleandoc(vars(type(service)).get("__doc__") or "")
            out.append({"name": name, "doc": doc, "methods": methods})
        return out

    # -- connections ---------------------------------------------------------

    async def _serve(self, conn: Connection) -> None:
        # The transport reads on while the handshake is answered: a request
        # beyond the limits right behind the hello is skipped and fails only
        # its own call once the session starts. A first message (the hello)
        # beyond them ends the connection.
        refused: list[LimitExceededError] = []

        def refused_early(error: LimitExceededError) -> None:
            if conn.stats()["messages_received"] <= 1:
                logger.warning("refused %s: its hello is beyond the limits: %s",
                               conn.peer_address, error)
                conn.abort()
            else:
                refused.append(error)

        conn.refuse_oversized(refused_early)
        timeout = self.config.heartbeat_timeout
        try:
            name = await asyncio.wait_for(self._handshake(conn), timeout)
        except TimeoutError:
            logger.warning("handshake with %s failed: no hello within %s s",
                           conn.peer_address, timeout)
            conn.abort()
            return
        except TensorwireError as exc:
            if not isinstance(exc, ConnectionClosedError):
                logger.warning("handshake with %s failed: %s", conn.peer_address, exc)
            conn.abort()
            return
        if name is None:
            return
        session = _ServerSession(self, conn, name, refused)
        self._sessions.add(session)
        try:
            await session.run()
        finally:
            self._sessions.discard(session)

    async def _handshake(self, conn: Connection) -> str | None:
        shake = protocol.ServerHandshake(
            secret=self.config.secret,
            max_concurrent=self.config.max_concurrent_per_connection,
        )
        while not shake.done:
            message = protocol.parse(await conn.recv())
            reply = shake.receive(message)
            if self._closing:
                reply = protocol.Reject(0, Status.UNAVAILABLE, "the server is shutting down")
            await conn.send(protocol.encode(reply))
            if isinstance(reply, protocol.Reject):
                logger.warning("refused %s: %s", conn.peer_address, reply.message)
                await conn.close()
                return None
        return shake.client_name

    def _method(self, name: str) -> Method:
        found = self._methods.get(name)
        if found is None:
            service, _, method_name = name.rpartition(".")
            if service in self._services:
                raise NotFound(f"service {service!r} has no method {method_name!r}")
            raise NotFound(f"no service {service or name!r} on this server")
        return found


class _ServerSession:
    """One client connection on the server."""

    def __init__(self, server: Server, conn: Connection, client_name: str,
                 refused: list[LimitExceededError]) -> None:
        self.server = server
        self.client_name = client_name
        # Requests skipped while the handshake was answered.
        self._refused_early = refused
        # The calls running in a task of their own (most unary calls are
        # answered at once and never listed: _dispatch).
        self.calls: CallTable[_Call] = CallTable()
        self._done = asyncio.Event()
        # What every call looks up, fixed for the server's life.
        self._limit = server.config.max_concurrent_per_connection
        self._timeline = server.config.timeline
        self._decoder, self._encoder = server._decoder, server._encoder
        slots = server._slots
        assert slots is not None  # made by start(), before any session
        self._slots = slots
        # REQUESTs start their calls in RequestDispatch (compiled); the rest
        # comes to _on_message. Only the driver holds it, and lets go of it
        # when closed (no cycle: issue 21); the session keeps a weak
        # reference, to stop new calls.
        dispatch = RequestDispatch(self, self._on_message, _Call)
        self._dispatch = weakref.ref(dispatch)
        self.driver = ConnectionDriver(conn, dispatch, self._on_close,
                                       heartbeat_timeout=server.config.heartbeat_timeout,
                                       on_refused=self._on_refused,
                                       max_unsent=server.config.transport.max_unsent_bytes)
        dispatch.attach(self.driver)

    async def run(self) -> None:
        self.driver.start(refused=self._refused_early)
        try:
            await self._done.wait()
        finally:
            tasks = self.call_tasks()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.driver.close()

    def stop_new_calls(self) -> None:
        dispatch = self._dispatch()
        if dispatch is not None:  # else the connection is closed
            dispatch.accepting = False

    def call_tasks(self) -> list[asyncio.Task[None]]:
        # Only calls that run in a task of their own are kept (_dispatch).
        return [call.task for call in self.calls.values() if call.task is not None]

    async def close(self) -> None:
        self._done.set()
        await self.driver.close()

    def _on_close(self, error: TensorwireError) -> None:
        self._done.set()

    def _on_message(self, message: protocol.Message, nbytes: int) -> None:
        """Every message but a REQUEST (see ``_dispatch``)."""
        call = self.calls.get(message.call_id)
        if isinstance(message, protocol.Ping):
            self.driver.send_soon(protocol.Pong(0))
        elif isinstance(message, protocol.Cancel):
            if call is not None:
                # The client freed its slot already: stop counting the call
                # now, not when its handler has finished cleaning up.
                self.calls.pop(message.call_id, None)
                call.cancel()
        elif isinstance(message, protocol.Item | protocol.End | protocol.Credit):
            # For a call that ended they are dropped (they may have crossed
            # its end); otherwise its CallState judges them, and one the
            # client may not send (an ITEM beyond its credit, ...) raises
            # ProtocolError: the connection ends.
            if call is not None:
                call.call_streams().receive(message, nbytes)
        else:
            raise ProtocolError(f"a client may not send {message.kind.name}")

    def _on_refused(self, message: protocol.Message | None,
                    error: LimitExceededError) -> None:
        """A request or stream item beyond the server's limits was skipped:
        that call fails with RESOURCE_EXHAUSTED, the connection goes on."""
        if isinstance(message, protocol.Request):
            found = self.server._methods.get(message.method)
            if found is not None:
                found.metrics.observe(0.0, True)
            exhausted = ResourceExhausted(
                f"the request to {message.method} is beyond this server's limits: {error}")
            self.driver.send_soon(error_message(message.call_id, exhausted))
        elif isinstance(message, protocol.Item):
            call = self.calls.pop(message.call_id, None)
            if call is not None:
                call.cancel()
                exhausted = ResourceExhausted(
                    f"a stream item is beyond this server's limits: {error}")
                self.driver.send_soon(error_message(message.call_id, exhausted))
        else:
            # No call to blame: the connection cannot go on sensibly.
            raise error


class _ArgumentStream:
    """The async iterator a handler gets for a client-streamed argument:
    the call's streams (``CallStreams``), decoded."""

    def __init__(self, streams: CallStreams, decoder: serde.Decoder) -> None:
        self._streams = streams
        self._decoder = decoder

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        item = await self._streams.next_item()
        if item is None:
            raise StopAsyncIteration
        return _decode(item.value, "stream item", self._decoder)


def _decode(frames: list[Any], what: str, decoder: serde.Decoder) -> Any:
    try:
        return decoder.decode(frames[0], frames[1:])
    except serde.DecodeError as exc:
        raise InvalidArgument(f"{what} does not decode: {exc}") from None


class _Call(ServerCall):
    """One call running on the server: ``ServerCall`` (compiled), with its
    streams."""

    def call_streams(self) -> CallStreams:
        """The call's streams (made on first use: a CREDIT may come before
        the handler starts), driven through its CallState."""
        if self.streams is None:
            self.streams = CallStreams(self.state, self.session.driver, self.request.method,
                                       self.metrics, self.call_id)
        return self.streams

    def _arguments(self, method: Method) -> tuple[list[Any], dict[str, Any]]:
        args, kwargs = unpack_arguments(self.request, method, self.session._decoder)
        stream_arg = self.request.stream_arg
        if stream_arg >= 0:
            if stream_arg > len(args):
                raise InvalidArgument(f"stream argument {stream_arg} is out of range")
            args.insert(stream_arg, _ArgumentStream(self.call_streams(), self.session._decoder))
        method.check(args, kwargs)
        if stream_arg >= 0:
            streams = self.call_streams()
            streams.metrics = self.metrics
            streams.open()
        return args, kwargs

    async def _stream(self, method: Method, args: list[Any], kwargs: dict[str, Any]) -> None:
        streams = self.call_streams()
        streams.metrics = self.metrics
        encoder = self.session._encoder
        generator = method.func(*args, **kwargs)
        try:
            async for item in generator:
                if not await streams.send_item(_encode(item, method.name, encoder)):
                    return  # the call is over: nothing more goes out
        finally:
            await generator.aclose()
        await streams.send_end()
