"""The transport interface: connections that move messages (lists of
frames), listeners that accept them, and running a listener's handler.

Frames and their allocation are in ``_frames.py``; the limit checks, the
receive queue and the admission of connections have modules of their own.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .._eager import start_eagerly
from ..errors import ConnectionClosedError, LimitExceededError
from ._frames import Allocator

__all__ = ("Connection", "ConnectionHandler", "Listener", "serve_connection")

logger = logging.getLogger(__name__)

ConnectionHandler = Callable[["Connection"], Awaitable[None]]


class Connection(abc.ABC):
    """One end of a connection that moves messages, in order and whole.

    A message is a list of frames; a frame is a host buffer (anything with the
    buffer protocol, contiguous) or a device buffer (``__cuda_array_interface__``).
    Concurrent ``send`` calls never interleave their frames.
    """

    #: The transport's URL scheme ("tcp", "ucx", "inproc").
    scheme: str = ""
    #: True where ``send_nowait`` of many messages costs about what one does
    #: (a byte stream: one system call), so a sender of many small messages
    #: gains by handing them over together rather than each as it comes.
    coalesces_sends: bool = False
    #: True where :attr:`last_activity` moves with every whole message
    #: received (at the latest as the read that completed it ends): a
    #: consumer that watches the peer's liveness then need not note the
    #: time of each message itself.
    stamps_messages: bool = False
    #: Counters the transport keeps (see :meth:`stats`).
    messages_sent: int = 0
    messages_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    #: Bytes of CUDA frames, sent or received, that went through host memory
    #: because the transport cannot move device memory (tcp://): 0 where
    #: every device frame went device to device (ucx://, inproc://).
    device_bytes_staged: int = 0

    def stats(self) -> dict[str, int]:
        """Messages and bytes this connection sent and received.

        Bytes are the frames' bytes; a byte stream (tcp://) counts what goes
        over the socket: its 8-byte handshake and the framing too.
        ``device_bytes_staged`` counts the CUDA frames' bytes that were
        copied through host memory on the way.
        """
        return {"messages_sent": self.messages_sent,
                "messages_received": self.messages_received,
                "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "device_bytes_staged": self.device_bytes_staged}

    @property
    @abc.abstractmethod
    def local_address(self) -> str:
        """The URL of this end."""

    @property
    @abc.abstractmethod
    def peer_address(self) -> str:
        """The URL of the other end."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """True once the connection is closed, aborted or broken."""

    @property
    def last_activity(self) -> float | None:
        """Event-loop time at which the peer last showed progress, even mid-message.

        Liveness checks use it so that a peer in the middle of a long
        transfer is not mistaken for a silent one. Progress is a whole
        message or a sizeable piece of one (a frame, or 64 KiB on a byte
        stream), not a byte: a peer that trickles a message byte by byte
        (a slow-loris) shows none. ``None`` where the transport cannot tell
        (then only whole messages count).
        """
        return None

    @abc.abstractmethod
    async def send(self, frames: Sequence[Any]) -> None:
        """Send one message; returns once the frames may be reused.

        Cancelling a send that has not started drops the message. Once part
        of it is out, the rest is written in the background (the next send
        waits for it), so the peer's framing holds and the connection lives;
        the frames must then stay unchanged until it has gone. A failure
        part-way through, by contrast, closes the connection.

        Raises:
            ConnectionClosedError: the connection is closed or broke.
            TransportError: a frame is not a usable buffer.
        """

    async def send_many(self, messages: Sequence[Sequence[Any]]) -> None:
        """Send several messages, in order, as few writes as the transport allows.

        The messages do not interleave with other sends. Raises what
        :meth:`send` raises.
        """
        for frames in messages:
            await self.send(frames)

    def send_nowait(self, messages: Sequence[Sequence[Any]]) -> asyncio.Future[None] | None:
        """Send several messages, in order, without waiting where possible.

        Returns None when they went out at once. Otherwise they go out from
        a background task, after any send in progress, and the returned
        future completes once they have gone, or fails with what
        :meth:`send` raises; the frames must stay unchanged until then.
        A caller that gets a future should await it before the next
        ``send_nowait``: the connection's memory is the caller's to bound.

        Raises:
            ConnectionClosedError: the connection is closed or broke.
            TransportError: a frame is not a usable buffer (nothing was sent).
        """
        if self.closed:
            raise ConnectionClosedError(f"connection to {self.peer_address} is closed")
        return start_eagerly(self.send_many(messages))

    def deliver_to(self, receiver: Callable[[list[Any]], None], *,
                   small_as_bytearray: bool = False) -> bool:
        """Hand every later message to ``receiver`` (called on the event
        loop, allocated with the connection's allocator) instead of to
        ``recv()``, whose callers then only learn how the connection ended.
        Messages already received go to ``receiver`` first. This saves a
        task wake-up per message for a consumer that takes everything at
        once; it gives up pushing back on the sender.

        ``small_as_bytearray``: where the connection has the default
        allocator, the frame of a small message of one host frame, received
        whole in the read-ahead buffer (tcp:// up to 64 KiB, ucx:// up to
        4 KiB), may come as a ``bytearray`` copy instead of an aligned NumPy
        array: a fraction of the cost, for a consumer that only parses such
        frames (the RPC layer; nothing it decodes views its header).

        Returns False when the transport does not deliver this way (then
        keep calling ``recv()``). An exception ``receiver`` raises aborts
        the connection.
        """
        return False

    def pause_reading(self) -> bool:
        """Hand out no more messages, and read no more from the peer, until
        :meth:`resume_reading`: a consumer whose output to this peer is
        backed up stops taking its requests (asyncio's ``pause_reading``,
        HTTP/2 flow control). What already arrived stays queued, bounded by
        one read. Safe to call twice. Returns False where the transport
        cannot pause (inproc://, whose sender waits on a bounded queue
        anyway)."""
        return False

    def resume_reading(self) -> None:
        """Undo :meth:`pause_reading`; safe to call when not paused."""
        return None

    def refuse_oversized(self, on_refused: Callable[[LimitExceededError], None]) -> bool:
        """Skip later messages beyond the limits instead of ending the connection.

        Such a message is still refused before anything is allocated for it;
        its bytes are read and dropped, so the stream keeps its place, and
        ``on_refused`` (called on the event loop, in order with the
        messages delivered) gets the LimitExceededError, whose ``head`` is
        the message's first frame when that is at most ``HEAD_MAX`` bytes
        and within the limits (an RPC layer finds the call id there).
        A message with more frames than ``max_frames`` still ends the
        connection (its frame table alone could be huge).

        Returns False where the transport cannot skip; then an oversized
        message ends the connection, as without this call.
        """
        return False

    @abc.abstractmethod
    async def recv(self, *, allocator: Allocator | None = None) -> list[Any]:
        """Receive the next message as a list of frames.

        Each frame is allocated at its exact size by ``allocator`` (default:
        the connection's; :func:`default_allocator` gives aligned writable
        NumPy uint8 arrays for host frames and CuPy arrays for device frames),
        before its data lands, so the data is written once. A transport may
        take small messages that arrived whole out of its read-ahead buffer
        before they are asked for, with the connection's allocator, while
        the previous ``recv()`` used that allocator too.

        Raises:
            ConnectionClosedError: the peer closed, went away, or we closed.
            LimitExceededError: the peer announced a message beyond the limits
                (the connection is aborted).
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Close politely: finish queued sends, tell the peer, wait briefly."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Close at once, without telling the peer; safe to call twice."""

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<{type(self).__name__} {self.local_address} -> {self.peer_address} {state}>"


async def serve_connection(handler: ConnectionHandler, conn: Connection) -> None:
    """Run a listener's handler on ``conn``, which the handler then owns.

    A handler that raises is logged and its connection aborted; the listener
    and its other connections go on. Cancellation (the listener closing)
    aborts the connection too.
    """
    try:
        await handler(conn)
    except asyncio.CancelledError:
        conn.abort()
        raise
    except Exception:
        logger.exception("connection handler for %s failed", conn.peer_address)
        conn.abort()


class Listener(abc.ABC):
    """Accepts connections and hands each to the ``on_connection`` handler.

    The handler owns its connection. When the handler raises, the listener
    logs it and aborts that connection; other connections are unaffected.
    """

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """The URL this listener really got (the port filled in when 0 was asked)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop accepting, cancel running handlers and abort their connections."""

    async def __aenter__(self) -> Listener:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.address}>"
