"""ucx://host:port — messages over UCX (shared memory, CMA, RDMA, CUDA IPC, TCP).

How a connection is made
    The listener is a tcp:// listener on the URL's port. Each peer opens a
    tcp:// connection to it, the *control channel*, and both sides send one
    hello message over it: ``[b"TWUCX1", worker_address, <connection id>]``.
    Each side then creates a UCX endpoint from the other's worker address
    with UCX error handling **off**: with error handling on, UCX restricts
    itself to transports that can report peer failure and picks TCP even
    between two processes on one host (no shared memory, no CMA), and both
    sides must agree on the mode. Error handling off loses UCX's dead-peer
    detection, so the control channel stays open for the connection's life:
    its end (EOF, RST) means the peer is gone, which fails our pending
    receives at once (a UCX receive posted for a dead peer would never
    complete), and it carries the polite goodbye, since closing a UCX
    endpoint tells the peer nothing.

Tags
    All connections share the process's one UCX worker, and UCX matches tags
    per worker, not per endpoint. So each side picks a 32-bit connection id
    unique in its own worker and tells the peer in its hello; everything the
    peer sends us carries ``id << 32 | kind`` (kind 0: message header, 1:
    frame data). UCX matches messages from one endpoint with one tag in the
    order they were sent, and a message's sends are all posted in one
    synchronous pass (no await in between), so no sequence numbers are
    needed.

Framing
    A message is one header message: the prelude and frame table of
    docs/protocol.md (``<B3xI`` kind and frame count, ``<Q`` per frame size,
    one code byte per frame, zero padding to 8), where a code byte's bit 7
    marks a small host frame whose bytes follow the table inside the header
    message ("inline", at most ``INLINE_BYTES`` in all). Then every other
    non-empty frame follows as its own tagged message, received by UCX
    straight into the buffer the receiver's allocator handed out (host or
    CUDA memory), so large frames land once, in place. Limits are checked on
    the header before anything is allocated.

Goodbye
    ``close()`` waits for queued sends, then sends ``[b"bye", <count of
    messages sent>]`` over the control channel and waits (``close_timeout``)
    for the peer to hang up. The peer delivers the messages still due from
    UCX (data and goodbye travel separately, so the goodbye may overtake
    them), then ends the connection with ConnectionClosedError and closes
    the control channel.

Backpressure (differs from tcp://)
    Frames above UCX's rendezvous threshold (``UCX_RNDV_THRESH``, 8 KiB as
    ucxx sets it) are never buffered: ``send()`` returns once the peer has
    received them into its own buffer. There is no socket buffer to absorb
    a burst, so two peers that both send large frames without either one
    receiving wait for each other forever; keep a receive loop running
    (the RPC layer does). Smaller messages are buffered by UCX.

UCX options and process state
    UCX reads its settings from the environment; the first ucx:// listener
    or connection in a process applies ``config.ucx`` (see
    :mod:`._ucx_runtime`) and later ones must ask for the same, or get
    ConfigError. The UCX worker lives while any ucx:// listener or
    connection does and is destroyed with the last one; nothing needs to be
    shut down by hand. UCX logs to stdout: a child process whose stdout is
    an unread pipe can block on it.

Progress modes
    ``blocking`` (default): the worker is armed and the loop sleeps on its
    epoll descriptor; idle connections cost no CPU. ``polling``: progress
    runs on every loop iteration while any request is in flight, lowest
    latency for one busy core. ucxx's thread modes are refused
    (ConfigError): their completions reach asyncio through a second thread
    and measured 10x the round-trip time here.
"""

from __future__ import annotations

import asyncio
import logging
import struct

from ..errors import ProtocolError, TensorwireError, TransportError
from ._base import Connection, ConnectionHandler, Listener, serve_connection
from ._frames import Allocator
from ._registry import Backend, parse_host_port
from ._ucx_connection import UCXConnection, to_ucx_url
from ._ucx_runtime import Runtime, acquire
from .config import Limits, TransportConfig

__all__ = ("UCXBackend", "UCXConnection", "UCXListener", "backend")

logger = logging.getLogger(__name__)

HELLO = b"TWUCX1"
_ID = struct.Struct("<I")
#: The control channel carries only hellos and goodbyes.
_CONTROL_LIMITS = Limits(max_frame_bytes=64 * 1024, max_frames=4, max_message_bytes=128 * 1024)


def _control_config(config: TransportConfig) -> TransportConfig:
    # The control connection lives as long as its ucx:// connection: the
    # tcp:// listener's caps on it are the ucx:// listener's.
    return TransportConfig(
        limits=_CONTROL_LIMITS,
        connect_timeout=config.connect_timeout,
        handshake_timeout=config.handshake_timeout,
        close_timeout=config.close_timeout,
        max_connections=config.max_connections,
        max_pending_connections=config.max_pending_connections,
    )


async def _hello(control: Connection, runtime: Runtime, recv_id: int) -> tuple[bytes, int]:
    """Exchange worker addresses and connection ids over the control channel.

    Raises:
        ProtocolError: the peer's hello is malformed.
        ConnectionClosedError: the peer went away.
    """
    await control.send([HELLO, runtime.address, _ID.pack(recv_id)])
    message = await control.recv()
    if len(message) != 3 or bytes(message[0]) != HELLO or memoryview(message[2]).nbytes != 4:
        raise ProtocolError(f"{control.peer_address} sent no valid ucx:// hello")
    (send_id,) = _ID.unpack(bytes(message[2]))
    return bytes(message[1]), send_id


async def _establish(
    control: Connection,
    runtime: Runtime,
    config: TransportConfig,
    allocator: Allocator | None,
    within: float,
) -> UCXConnection:
    """Run the hello on ``control`` and build the connection; owns ``control``.

    On success the connection takes over one runtime reference; on failure
    ``control`` is aborted and the reference released.
    """
    recv_id = runtime.new_id()
    try:
        async with asyncio.timeout(within):
            peer_worker, send_id = await _hello(control, runtime, recv_id)
        return UCXConnection(runtime, control, config, allocator, recv_id, send_id, peer_worker)
    except BaseException:
        control.abort()
        runtime.free_id(recv_id)
        runtime.release()
        raise


class UCXListener(Listener):
    """Accepts ucx:// peers on a tcp:// control port."""

    def __init__(
        self,
        runtime: Runtime,
        on_connection: ConnectionHandler,
        config: TransportConfig,
        allocator: Allocator | None,
    ) -> None:
        self._rt: Runtime | None = runtime
        self._on_connection = on_connection
        self._config = config
        self._allocator = allocator
        self._tcp: Listener | None = None
        self._address = "ucx://?"

    async def start(self, address: str) -> None:
        from .tcp import backend as tcp_backend

        self._tcp = await tcp_backend.listen(
            address, self._serve, _control_config(self._config), None
        )
        self._address = to_ucx_url(self._tcp.address)

    @property
    def address(self) -> str:
        return self._address

    async def _serve(self, control: Connection) -> None:
        rt = self._rt
        if rt is None:
            control.abort()
            return
        rt.refs += 1
        try:
            conn = await _establish(
                control, rt, self._config, self._allocator, self._config.handshake_timeout
            )
        except asyncio.CancelledError:
            raise
        except (TensorwireError, OSError, TimeoutError) as exc:
            logger.warning("dropping ucx:// connection from %s: %s", control.peer_address, exc)
            return
        await serve_connection(self._on_connection, conn)

    async def close(self) -> None:
        tcp, self._tcp = self._tcp, None
        if tcp is not None:
            await tcp.close()
        rt, self._rt = self._rt, None
        if rt is not None:
            rt.release()


class UCXBackend(Backend):
    """The ucx:// transport."""

    async def connect(
        self, address: str, config: TransportConfig, allocator: Allocator | None
    ) -> Connection:
        from .tcp import backend as tcp_backend

        parse_host_port(address, "ucx")
        runtime = acquire(config.ucx)
        url = f"ucx://{address}"
        try:
            control = await tcp_backend.connect(address, _control_config(config), None)
        except TransportError as exc:
            runtime.release()
            raise type(exc)(str(exc).replace(f"tcp://{address}", url)) from exc
        except BaseException:
            runtime.release()
            raise
        try:
            return await _establish(control, runtime, config, allocator, config.connect_timeout)
        except TimeoutError:
            raise TransportError(
                f"ucx:// handshake with {url} timed out after {config.connect_timeout} s"
            ) from None

    async def listen(
        self,
        address: str,
        on_connection: ConnectionHandler,
        config: TransportConfig,
        allocator: Allocator | None,
    ) -> Listener:
        parse_host_port(address, "ucx")
        runtime = acquire(config.ucx)
        listener = UCXListener(runtime, on_connection, config, allocator)
        try:
            await listener.start(address)
        except BaseException:
            await listener.close()
            raise
        return listener


backend = UCXBackend()
