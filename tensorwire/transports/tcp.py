"""tcp://host:port — messages over TCP, with TLS as an option.

Plain TCP drives a non-blocking socket directly from the event loop
(``add_reader`` / ``add_writer``, on asyncio and uvloop alike): sends are
scatter-gather ``sendmsg`` calls over the frames themselves, never joined
into one bytes object, and receives are ``recv`` calls straight into each
frame's final buffer. Both run in the compiled core (``_stream_core.pyx``,
whose ``_on_readable`` is the ``add_reader`` callback itself). asyncio's own
transports would copy the unsent rest of a large write into their buffer
(CPython 3.11 ``_SelectorSocketTransport``), which doubles peak memory for a
large frame.

TLS has to encrypt, which copies anyway, so it runs on asyncio's SSL
transport with a ``BufferedProtocol`` (receives still land in the frame's
buffer) and writes in bounded chunks, so memory stays flat.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import ssl
from typing import Any, cast

from ..errors import ConnectionClosedError, TensorwireError, TransportError
from ._admission import Admission
from ._base import Connection, ConnectionHandler, Listener, serve_connection
from ._delivery import READ_BUDGET_MESSAGES
from ._frames import Allocator
from ._registry import Backend, format_host_port, parse_host_port
from ._spin_gate import SpinGate
from ._stream_connection import StreamConnection
from ._stream_framing import HANDSHAKE
from ._stream_writes import write_some
from .config import TransportConfig

__all__ = ("TCPBackend", "TCPListener", "backend")

logger = logging.getLogger(__name__)

#: TLS writes are cut into pieces this large so that at most about this much
#: plaintext sits encrypted in the transport's buffer.
_TLS_CHUNK = 1 << 20


def _configure(sock: socket.socket, config: TransportConfig) -> None:
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if config.socket_sndbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.socket_sndbuf)
    if config.socket_rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, config.socket_rcvbuf)


def _sockname(sock: socket.socket, peer: bool = False) -> str:
    try:
        name = sock.getpeername() if peer else sock.getsockname()
    except OSError:
        return "tcp://?"
    return format_host_port("tcp", name[0], name[1])


def _translate(exc: OSError, what: str) -> TransportError:
    if isinstance(exc, TransportError):
        return exc
    error = (
        ConnectionClosedError(f"{what}: {exc}")
        if isinstance(exc, ConnectionError | ssl.SSLError)
        else TransportError(f"{what}: {exc}")
    )
    # Without its traceback: the connection keeps the error, and the
    # traceback's frames would keep the connection and the buffer being
    # read into (a cycle; the system call's error says all there is).
    error.__cause__ = exc.with_traceback(None)
    return error


class SocketConnection(StreamConnection):
    """Plain TCP, driven on the raw non-blocking socket."""

    scheme = "tcp"

    def __init__(
        self, sock: socket.socket, config: TransportConfig, allocator: Allocator | None
    ) -> None:
        super().__init__(config, allocator, _sockname(sock), _sockname(sock, peer=True))
        # Read and written by the compiled core (StreamCore).
        self._sock = sock
        self._fd = sock.fileno()
        self._spin_gate = SpinGate(config.tcp_spin) if config.tcp_spin > 0 else None
        self._reading = False
        self._writable: asyncio.Future[None] | None = None

    def start(self) -> None:
        """Send our handshake and start reading."""
        assert self._sock is not None
        try:
            self._sock.send(HANDSHAKE)
            self.bytes_sent += len(HANDSHAKE)
        except OSError as exc:
            self._fail(_translate(exc, f"handshake with {self.peer_address} failed"))
            return
        self._resume_reading()

    def _resume_reading(self) -> None:
        if not self._reading and self._sock is not None:
            self._loop.add_reader(self._fd, self._on_readable)
            self._reading = True

    def _pause_reading(self) -> None:
        if self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False

    # The socket is read by the compiled core's _on_readable (StreamCore),
    # which calls these two when a read fails.

    def _recv_failed(self, exc: OSError) -> None:
        self._fail(_translate(exc, f"receive from {self.peer_address} failed"))

    def _bytes_refused(self, exc: TensorwireError) -> None:
        """The peer's bytes broke the protocol or the limits."""
        logger.warning("dropping connection from %s: %s", self.peer_address, exc)
        self._fail(exc)

    async def _write(self, buffers: list[Any]) -> None:
        while True:
            if self._sock is None:
                raise self._closed_error()
            write_some(self._fd, buffers)
            if not buffers:
                return
            await self._wait_writable()

    async def _wait_writable(self) -> None:
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._writable = waiter
        self._loop.add_writer(self._fd, _set_done, waiter)
        try:
            await waiter
        finally:
            self._writable = None
            if self._sock is not None:
                self._loop.remove_writer(self._fd)

    def _shutdown_write(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_WR)

    def _close_io(self) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        self._pause_reading()
        self._loop.remove_writer(self._fd)
        sock.close()
        if self._writable is not None and not self._writable.done():
            self._writable.set_exception(self._closed_error())


def _set_done(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class TLSConnection(StreamConnection, asyncio.BufferedProtocol):
    """TCP with TLS, on asyncio's SSL transport."""

    scheme = "tcp"

    def __init__(self, config: TransportConfig, allocator: Allocator | None) -> None:
        super().__init__(config, allocator, "tcp://?", "tcp://?")
        self._transport: asyncio.Transport | None = None
        self._paused = False
        self._drained: asyncio.Future[None] | None = None
        self._reading = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's SSL transport is not an asyncio.Transport subclass.
        self._transport = cast(asyncio.Transport, transport)
        if self._error is not None:  # refused by the listener (max_connections)
            self._close_io()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self._local_address = _sockname(sock)
            self._peer_address = _sockname(sock, peer=True)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._transport.write(HANDSHAKE)
        self.bytes_sent += len(HANDSHAKE)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._error is None:
            try:
                return self._reader.get_buffer()
            except TensorwireError as exc:  # the receive allocator failed
                self._fail(exc)
        return memoryview(bytearray(4096))  # failed: what still comes is dropped

    def buffer_updated(self, nbytes: int) -> None:
        if self._error is not None:
            return
        self._budget = READ_BUDGET_MESSAGES
        try:
            self._reader.buffer_updated(nbytes)
        except TensorwireError as exc:
            logger.warning("dropping connection from %s: %s", self.peer_address, exc)
            self._fail(exc)
            return
        self._note_progress(nbytes)
        if not self._after_read() and self._transport is not None and self._reading:
            self._transport.pause_reading()
            self._reading = False

    def eof_received(self) -> bool:
        self._on_eof()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None:
            self._on_eof()
        else:
            self._fail(ConnectionClosedError(f"connection to {self.peer_address} lost: {exc}"))
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def _resume_reading(self) -> None:
        if not self._reading and self._transport is not None:
            self._transport.resume_reading()
            self._reading = True

    async def _write(self, buffers: list[Any]) -> None:
        while buffers:
            transport = self._transport
            if transport is None or transport.is_closing():
                raise self._closed_error()
            view = memoryview(buffers[0]).cast("B")
            transport.write(view[:_TLS_CHUNK])
            if len(view) > _TLS_CHUNK:
                buffers[0] = view[_TLS_CHUNK:]
            else:
                del buffers[0]
            while self._paused and self._error is None:
                self._drained = self._loop.create_future()
                await self._drained
        if self._error is not None:
            raise self._closed_error()

    def _shutdown_write(self) -> None:
        # TLS 1.3 has no half-close that every peer honours: the goodbye
        # frame already told the peer, which closes its side on it.
        pass

    def _close_io(self) -> None:
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.abort()


async def _open_socket(host: str, port: int, config: TransportConfig) -> socket.socket:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    last: OSError | None = None
    for family, type_, proto, _, sockaddr in infos:
        sock = socket.socket(family, type_, proto)
        try:
            _configure(sock, config)
            await loop.sock_connect(sock, sockaddr)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
        except BaseException:
            sock.close()
            raise
    raise last or OSError(errno.EHOSTUNREACH, f"no address for {host}")


class TCPListener(Listener):
    """Accepts tcp:// connections; one bad peer never stops the others."""

    def __init__(
        self,
        sock: socket.socket,
        on_connection: ConnectionHandler,
        config: TransportConfig,
        allocator: Allocator | None,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock: socket.socket | None = sock
        self._address = _sockname(sock)
        self._on_connection = on_connection
        self._config = config
        self._allocator = allocator
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self._admission = Admission(config, self._address)
        if config.ssl_server is None:
            self._loop.add_reader(sock.fileno(), self._on_acceptable)

    @property
    def address(self) -> str:
        return self._address

    async def start_tls(self) -> None:
        assert self._sock is not None and self._config.ssl_server is not None
        self._server = await self._loop.create_server(
            self._make_tls_protocol, sock=self._sock, ssl=self._config.ssl_server,
            ssl_handshake_timeout=self._config.handshake_timeout,
        )

    def _make_tls_protocol(self) -> TLSConnection:
        conn = TLSConnection(self._config, self._allocator)
        if self._admission.admit("a TLS peer"):
            self._spawn(conn)
        else:
            conn.abort()  # connection_made then closes the transport
        return conn

    def _on_acceptable(self) -> None:
        while self._sock is not None:
            try:
                client, peer = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # EMFILE and friends: log and keep the listener alive.
                logger.warning("accept on %s failed: %s", self._address, exc)
                return
            if not self._admission.admit(format_host_port("tcp", peer[0], peer[1])):
                client.close()
                continue
            try:
                _configure(client, self._config)
                conn = SocketConnection(client, self._config, self._allocator)
            except OSError as exc:
                logger.warning("dropping new connection on %s: %s", self._address, exc)
                client.close()
                self._admission.handshaken()
                self._admission.closed()
                continue
            conn.start()
            self._spawn(conn)

    def _spawn(self, conn: StreamConnection) -> None:
        # The connection leaves the count when it ends, which may be long
        # after its handler returned (a handler may hand it on).
        conn.on_end = self._admission.closed
        task = self._loop.create_task(self._serve(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: StreamConnection) -> None:
        try:
            await conn.wait_handshake(self._config.handshake_timeout)
        except TensorwireError as exc:
            # Protocol violations were logged where they were found, and a
            # peer that hung up before its handshake (a port probe) is no
            # news; what is left is the timeout.
            if exc is not conn.failure:
                logger.warning("dropping connection from %s: %s", conn.peer_address, exc)
            conn.abort()
            return
        finally:
            self._admission.handshaken()
        await serve_connection(self._on_connection, conn)

    async def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        if self._server is not None:
            self._server.close()
        else:
            self._loop.remove_reader(sock.fileno())
            sock.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class TCPBackend(Backend):
    """The tcp:// transport."""

    async def connect(
        self, address: str, config: TransportConfig, allocator: Allocator | None
    ) -> Connection:
        host, port = parse_host_port(address, "tcp")
        url = f"tcp://{address}"
        try:
            async with asyncio.timeout(config.connect_timeout):
                if config.ssl_client is not None:
                    return await self._connect_tls(host, port, config, allocator)
                sock = await _open_socket(host, port, config)
                conn = SocketConnection(sock, config, allocator)
                try:
                    conn.start()
                    await conn.wait_handshake(config.connect_timeout)
                except BaseException:
                    # A timeout or cancel from outside lands here as a
                    # CancelledError: the socket must not outlive it.
                    conn.abort()
                    raise
                return conn
        except TimeoutError:
            raise TransportError(
                f"connecting to {url} timed out after {config.connect_timeout} s"
            ) from None
        except OSError as exc:
            raise _translate(exc, f"cannot connect to {url}") from exc

    async def _connect_tls(
        self, host: str, port: int, config: TransportConfig, allocator: Allocator | None
    ) -> Connection:
        loop = asyncio.get_running_loop()
        sock = await _open_socket(host, port, config)
        try:
            _, conn = await loop.create_connection(
                lambda: TLSConnection(config, allocator),
                sock=sock,
                ssl=config.ssl_client,
                server_hostname=config.ssl_server_hostname or host,
                ssl_handshake_timeout=config.handshake_timeout,
            )
        except BaseException:
            sock.close()
            raise
        try:
            await conn.wait_handshake(config.connect_timeout)
        except BaseException:
            conn.abort()
            raise
        return conn

    async def listen(
        self,
        address: str,
        on_connection: ConnectionHandler,
        config: TransportConfig,
        allocator: Allocator | None,
    ) -> Listener:
        host, port = parse_host_port(address, "tcp")
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
            family, type_, proto, _, sockaddr = infos[0]
            sock = socket.socket(family, type_, proto)
        except OSError as exc:
            raise _translate(exc, f"cannot listen on tcp://{address}") from exc
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(sockaddr)
            sock.listen(socket.SOMAXCONN)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise _translate(exc, f"cannot listen on tcp://{address}") from exc
        listener = TCPListener(sock, on_connection, config, allocator)
        if config.ssl_server is not None:
            await listener.start_tls()
        return listener


backend = TCPBackend()
