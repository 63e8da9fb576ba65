"""The RPC server: hosts services on any number of addresses."""

from __future__ import annotations

import asyncio
import contextvars
import dis
import inspect
import logging
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from .. import serde
from .._counters import MethodMetrics, Metrics, record_call
from ..errors import (
    ConfigError,
    ConnectionClosedError,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    LimitExceededError,
    NotFound,
    ProtocolError,
    RemoteError,
    ResourceExhausted,
    Status,
    TensorwireError,
    Unavailable,
)
from ..transports import Connection, Listener, listen
from ..transports._eager import start_eagerly
from . import protocol
from ._connection_driver import ConnectionDriver
from ._slots import Slots
from .config import ServerConfig
from .service import (
    MethodInfo,
    Service,
    argument_checker,
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


class _Handler:
    __slots__ = ("check", "func", "info", "inline", "metrics", "name")

    def __init__(self, name: str, func: Callable[..., Any], info: MethodInfo,
                 metrics: MethodMetrics) -> None:
        self.name = name
        self.func = func
        self.info = info
        self.metrics = metrics
        self.check = argument_checker(info.signature)
        # A unary handler that cannot suspend runs to its end at once: it
        # needs no task of its own (Python 3.12's eager tasks, for the case
        # where they are plainly safe), no deadline timer, no cancellation.
        self.inline = not info.streaming and _never_suspends(func)


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
        self._handlers: dict[str, _Handler] = {}
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
            self._handlers[full] = _Handler(full, getattr(service, attr), info,
                                            self._metrics[full])

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

    def _handler(self, name: str) -> _Handler:
        handler = self._handlers.get(name)
        if handler is None:
            service, _, method_name = name.rpartition(".")
            if service in self._services:
                raise NotFound(f"service {service!r} has no method {method_name!r}")
            raise NotFound(f"no service {service or name!r} on this server")
        return handler


class _ServerSession:
    """One client connection on the server."""

    def __init__(self, server: Server, conn: Connection, client_name: str,
                 refused: list[LimitExceededError]) -> None:
        self.server = server
        self.client_name = client_name
        # Requests skipped while the handshake was answered.
        self._refused_early = refused
        self.calls: dict[int, _Call] = {}
        self.driver = ConnectionDriver(conn, self._on_message, self._on_close,
                               heartbeat_timeout=server.config.heartbeat_timeout,
                               on_refused=self._on_refused,
                               max_unsent=server.config.transport.max_unsent_bytes)
        self._accepting = True
        self._done = asyncio.Event()
        # What every call looks up, fixed for the server's life.
        self._handlers = server._handlers
        self._limit = server.config.max_concurrent_per_connection
        self._timeline = server.config.timeline
        self._decoder, self._encoder = server._decoder, server._encoder
        slots = server._slots
        assert slots is not None  # made by start(), before any session
        self._slots = slots

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
        self._accepting = False

    def call_tasks(self) -> list[asyncio.Task[None]]:
        # Only calls that run in a task of their own are kept (_Call.start).
        return [call.task for call in self.calls.values() if call.task is not None]

    async def close(self) -> None:
        self._done.set()
        await self.driver.close()

    def _on_close(self, error: TensorwireError) -> None:
        self._done.set()

    def _on_message(self, message: protocol.Message, nbytes: int) -> None:
        if type(message) is protocol.Request:
            self._start(message, nbytes)
            return
        call = self.calls.get(message.call_id)
        if isinstance(message, protocol.Ping):
            self.driver.send_soon(protocol.Pong(0))
        elif isinstance(message, protocol.Cancel):
            if call is not None:
                # The client freed its slot already: stop counting the call
                # now, not when its handler has finished cleaning up.
                self.calls.pop(message.call_id, None)
                call.cancel()
        elif isinstance(message, protocol.Item | protocol.End):
            # Late items for a call that already ended are dropped.
            if call is not None and call.instream is not None:
                call.count_in(nbytes)
                call.instream.feed(message)
        elif isinstance(message, protocol.Credit):
            if call is not None:
                call.grant(message.count)
        else:
            raise ProtocolError(f"a client may not send {message.kind.name}")

    def _on_refused(self, message: protocol.Message | None,
                    error: LimitExceededError) -> None:
        """A request or stream item beyond the server's limits was skipped:
        that call fails with RESOURCE_EXHAUSTED, the connection goes on."""
        if isinstance(message, protocol.Request):
            handler = self._handlers.get(message.method)
            if handler is not None:
                handler.metrics.observe(0.0, True)
            exhausted = ResourceExhausted(
                f"the request to {message.method} is beyond this server's limits: {error}")
            self.driver.send_soon(_error_message(message.call_id, exhausted))
        elif isinstance(message, protocol.Item):
            call = self.calls.pop(message.call_id, None)
            if call is not None:
                call.cancel()
                exhausted = ResourceExhausted(
                    f"a stream item is beyond this server's limits: {error}")
                self.driver.send_soon(_error_message(message.call_id, exhausted))
        else:
            # No call to blame: the connection cannot go on sensibly.
            raise error

    def _start(self, request: protocol.Request, nbytes: int) -> None:
        call_id = request.call_id
        calls = self.calls
        if call_id in calls:
            raise ProtocolError(f"call id {call_id} is already in use")
        if not self._accepting or len(calls) >= self._limit:
            error: RemoteError = (
                Unavailable("the server is shutting down") if not self._accepting
                else ResourceExhausted(f"more than {self._limit} calls in flight on one connection")
            )
            self.driver.send_soon(_error_message(call_id, error))
            return
        _Call(self, request, nbytes).start(self._handlers.get(request.method))


class _InStream:
    """The async iterator a handler gets for a client-streamed argument."""

    def __init__(self, call: _Call, window: int) -> None:
        self._call = call
        self.window = window
        self._items: deque[protocol.Message] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._consumed = 0
        self._ended = False

    def feed(self, message: protocol.Message) -> None:
        if len(self._items) > self.window:
            self._call.session.driver.close_with(
                ProtocolError("client sent stream items beyond its credit")
            )
            return
        self._items.append(message)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        if self._ended:
            raise StopAsyncIteration
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        message = self._items.popleft()
        if isinstance(message, protocol.End):
            self._ended = True
            raise StopAsyncIteration
        self._consumed += 1
        if self._consumed >= max(1, self.window // 2):
            self._call.session.driver.send_soon(protocol.Credit(self._call.call_id,
                                                                 self._consumed))
            self._consumed = 0
        assert isinstance(message, protocol.Item)
        return _decode(message.value, "stream item", self._call.session._decoder)


def _unpack_arguments(
    request: protocol.Request, handler: _Handler, decoder: serde.Decoder
) -> tuple[list[Any], dict[str, Any]]:
    frames = request.value
    try:
        # Without an empty list of buffers: most requests are one frame.
        value = (decoder.decode(frames[0]) if len(frames) == 1
                 else decoder.decode(frames[0], frames[1:]))
    except serde.DecodeError as exc:
        raise InvalidArgument(f"the arguments of {handler.name} do not decode: {exc}") from None
    if type(value) is list and len(value) == 2:
        # What our client sends, checked without isinstance calls.
        args, kwargs = value
        if type(args) is list and type(kwargs) is dict:
            return args, kwargs
    # isinstance with a tuple of types: a union (list | tuple) is built anew
    # on every call.
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not isinstance(value[0], (list, tuple))
        or not isinstance(value[1], dict)
    ):
        raise InvalidArgument("a request's value must be [args, kwargs]")
    args = value[0]
    return args if type(args) is list else list(args), value[1]


def _check_arguments(handler: _Handler, args: list[Any], kwargs: dict[str, Any]) -> None:
    try:
        handler.check(args, kwargs)
    except TypeError as exc:
        raise _invalid_arguments(handler, exc) from None


def _invalid_arguments(handler: _Handler, error: TypeError) -> InvalidArgument:
    shown = signature_text(handler.info.signature)
    return InvalidArgument(f"arguments do not fit {handler.name}{shown}: {error}")


def _never_suspends(func: Callable[..., Any]) -> bool:
    """True for a coroutine function whose body has no ``await``, ``async
    with`` or ``async for``: every suspension point compiles to YIELD_VALUE."""
    code = getattr(func, "__code__", None)
    if code is None or not inspect.iscoroutinefunction(func):
        return False
    return not any(ins.opname == "YIELD_VALUE" for ins in dis.get_instructions(code))


def _decode(frames: list[Any], what: str, decoder: serde.Decoder) -> Any:
    try:
        return decoder.decode(frames[0], frames[1:])
    except serde.DecodeError as exc:
        raise InvalidArgument(f"{what} does not decode: {exc}") from None


def _error_message(call_id: int, error: BaseException) -> protocol.Error:
    details = None
    if isinstance(error, RemoteError):
        status, type_name, message = int(error.status), error.type_name, error.message
        trace = error.remote_traceback or (_format(error) if error.sends_traceback else "")
        if error.details:
            details = protocol.sendable_details(error.details)
            if details is None:
                logger.warning("the details of %s are not sent: not plain values, or over "
                               "%d bytes", type_name, protocol.MAX_ERROR_DETAILS)
    else:
        status, type_name, message = int(Status.INTERNAL), type(error).__qualname__, str(error)
        trace = _format(error)
    return protocol.Error(call_id, status, _clip(type_name, 256), _clip(message),
                          _clip(trace, keep_end=True), details)


def _clip(text: str, limit: int = protocol.MAX_ERROR_TEXT, *, keep_end: bool = False) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut.

    A message keeps its start; a traceback its end, where the error is.
    """
    if len(text) <= limit:
        return text
    keep = limit - 64  # room for the note, which is shorter than 64 characters
    note = f" ... [{len(text) - keep} characters cut] ... "
    return note + text[-keep:] if keep_end else text[:keep] + note


def _format(error: BaseException) -> str:
    return "".join(traceback.format_exception(error))


class _Call:
    """One call running on the server."""

    def __init__(self, session: _ServerSession, request: protocol.Request, nbytes: int) -> None:
        self.session = session
        self.call_id = request.call_id
        self.request = request
        self.request_bytes = nbytes
        self._credit = 0
        self._credit_event: asyncio.Event | None = None
        self.instream: _InStream | None = None
        self.metrics: MethodMetrics | None = None
        self._expired = False
        # The session's loop, not get_running_loop(): on Python 3.11 that asks
        # the OS for the pid every time, and this runs for every call.
        self._loop = session.driver.loop
        # Set by start() when the call goes on in a task of its own.
        self.task: asyncio.Task[None] | None = None

    def start(self, handler: _Handler | None) -> None:
        """Run the call: at once, to its end, when its handler cannot
        suspend (no task, no deadline timer, no entry among the session's
        calls in flight: ``_Handler.inline``); else in a task of its own,
        which a CANCEL or the deadline cancels."""
        if handler is not None and handler.inline and self.request.stream_arg < 0:
            try:
                # A context of its own, as a task would have.
                task = contextvars.copy_context().run(start_eagerly, self._run(handler))
            except asyncio.CancelledError:
                return  # a handler that cancels itself gets no reply, as in a task
            if task is None:
                return  # the usual case: answered already
            # It waited for one of the server's slots.
            assert isinstance(task, asyncio.Task)
        else:
            task = self._loop.create_task(self._run(handler))
        self.task = task
        self.session.calls[self.call_id] = self
        task.add_done_callback(self.forget)

    def grant(self, count: int) -> None:
        self._credit += max(0, count)
        if self._credit_event is not None:
            self._credit_event.set()

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()

    def _expire(self) -> None:
        self._expired = True
        self.forget()
        self.cancel()

    def forget(self, _: object = None) -> None:
        """Stop counting this call against the connection's limit."""
        calls = self.session.calls
        if calls.get(self.call_id) is self:
            del calls[self.call_id]

    def count_in(self, nbytes: int) -> None:
        if self.metrics is not None:
            self.metrics.bytes_in += nbytes

    async def _send(self, message: protocol.Message) -> None:
        sent = await self.session.driver.send(message)
        if self.metrics is not None:
            self.metrics.bytes_out += sent

    async def _run(self, handler: _Handler | None) -> None:
        """The one path of every call: arguments, the handler, its answer
        (RESPONSE, stream items, or ERROR), metrics and the timeline."""
        request = self.request
        slots = self.session._slots
        started = time.perf_counter()
        failed = True
        reply: list[Any] | None = None  # its frames
        try:
            if handler is None:
                handler = self.session.server._handler(request.method)  # raises NotFound
            self.metrics = handler.metrics
            self.metrics.bytes_in += self.request_bytes
            if not slots.try_acquire():
                await slots.acquire()
            try:
                args, kwargs = self._arguments(handler)
                # A timer on the loop rather than asyncio.timeout(): cheaper,
                # and a handler that cannot suspend needs none.
                timer = None
                if request.timeout is not None and not handler.inline:
                    timer = self._loop.call_later(request.timeout, self._expire)
                try:
                    if handler.info.streaming:
                        await self._stream(handler, args, kwargs)
                    else:
                        result = await handler.func(*args, **kwargs)
                        reply = protocol.encode_response(
                            self.call_id, _encode(result, handler.name, self.session._encoder))
                except asyncio.CancelledError:
                    if not self._expired or self.task is None or self.task.uncancel() > 0:
                        raise
                    raise DeadlineExceeded(
                        f"{request.method} did not finish within its deadline "
                        f"of {request.timeout:.3g} s"
                    ) from None
                finally:
                    if timer is not None:
                        timer.cancel()
            finally:
                slots.release()
            failed = False
        except asyncio.CancelledError:
            # Never swallowed; a cancel from the client needs no reply.
            raise
        except Exception as exc:
            if not isinstance(exc, RemoteError):
                logger.debug("%s raised", request.method, exc_info=exc)
            reply = protocol.encode(_error_message(self.call_id, exc))
        finally:
            if self.metrics is not None:
                record_call(self.metrics, self.session._timeline, request.method, "rpc.server",
                            started, failed)
        # The call's slot is free, and its metrics complete, before the
        # client has its answer and may send the next call.
        self.forget()
        if reply is None:
            return
        try:
            sent = self.session.driver.post_frames(reply)
        except Unavailable:
            return  # the connection is gone: nobody to answer
        if self.metrics is not None:
            self.metrics.bytes_out += sent

    def _arguments(self, handler: _Handler) -> tuple[list[Any], dict[str, Any]]:
        args, kwargs = _unpack_arguments(self.request, handler, self.session._decoder)
        stream_arg = self.request.stream_arg
        if stream_arg >= 0:
            if stream_arg > len(args):
                raise InvalidArgument(f"stream argument {stream_arg} is out of range")
            window = self.session.server.config.stream_window
            self.instream = _InStream(self, window)
            args.insert(stream_arg, self.instream)
        _check_arguments(handler, args, kwargs)
        if self.instream is not None:
            self.session.driver.send_soon(protocol.Credit(self.call_id, self.instream.window))
        return args, kwargs

    async def _stream(self, handler: _Handler, args: list[Any], kwargs: dict[str, Any]) -> None:
        self._credit_event = asyncio.Event()
        generator = handler.func(*args, **kwargs)
        try:
            async for item in generator:
                while self._credit <= 0:
                    self._credit_event.clear()
                    await self._credit_event.wait()
                self._credit -= 1
                await self._send(protocol.Item(
                    self.call_id, _encode(item, handler.name, self.session._encoder)))
        finally:
            await generator.aclose()
        await self._send(protocol.End(self.call_id))


def _encode(value: Any, method_name: str, encoder: serde.Encoder) -> list[Any]:
    try:
        header, buffers = encoder.encode(value)
    except serde.EncodeError as exc:
        raise _unencodable(method_name, exc) from None
    return [header, *buffers]


def _unencodable(method_name: str, error: serde.EncodeError) -> Internal:
    return Internal(f"the result of {method_name} cannot be encoded: {error}")

