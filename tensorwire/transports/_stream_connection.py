"""What every byte-stream connection shares: the handshake, handing the
frame reader's messages to ``recv()`` or a receiver, pausing, close.

The per-message part (reading a socket, handing messages out within the
fairness budget, writing at once) is compiled, in ``_stream_core.pyx``;
sending is in ``_stream_sending.py``. A concrete driver supplies the I/O:
``_write`` (send a list of buffers),
``_pause_reading`` / ``_resume_reading``, ``_shutdown_write`` and
``_close_io``; it reads the socket it sets as ``_sock`` with the core's
``_on_readable``, or feeds received bytes to ``self._reader`` itself and
calls ``_note_progress()`` / ``_after_read()``; and ``_on_eof()`` /
``_fail()``.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Callable
from typing import Any

from ..errors import ConnectionClosedError, LimitExceededError, TensorwireError, TransportError
from ._delivery import READ_BUDGET_MESSAGES, RecvQueue, call_consumer
from ._frames import Allocator, default_allocator
from ._stream_core import StreamCore
from ._stream_framing import GOODBYE, FrameReader
from ._stream_sending import StreamSending
from .config import TransportConfig

__all__ = ("StreamConnection",)

logger = logging.getLogger(__name__)


class StreamConnection(StreamCore, StreamSending):
    """A connection over an ordered byte stream, speaking docs/protocol.md.

    The per-message work (reading, handing out, writing at once) is its
    compiled first base, ``StreamCore``; here is the rest."""

    coalesces_sends = True
    # Each batch of whole messages handed out moves last_activity
    # (StreamCore._hand_out).
    stamps_messages = True

    def __init__(
        self,
        config: TransportConfig,
        allocator: Allocator | None,
        local_address: str,
        peer_address: str,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._config = config
        self._allocator = allocator or default_allocator
        self._local_address = local_address
        self._peer_address = peer_address
        self._reader = FrameReader(config.limits)
        self._queue = RecvQueue(self._loop)
        self._send_lock = asyncio.Lock()
        self._handshake: asyncio.Future[None] = self._loop.create_future()
        self._peer_gone: asyncio.Future[None] = self._loop.create_future()
        self._error: TensorwireError | None = None
        self._closing = False
        self._last_activity: float | None = None
        self._unseen_bytes = 0
        # Whether the last recv() took the connection's allocator: only then
        # are small messages allocated ahead of the next recv().
        self._read_ahead = self._allocator is default_allocator
        # Set by deliver_to(): messages go there instead of to recv().
        self._receiver: Callable[[list[Any]], None] | None = None
        # Set by refuse_oversized().
        self._on_refused: Callable[[LimitExceededError], None] | None = None
        # The rest of a message whose sender was cancelled mid-write.
        self._tail: asyncio.Task[None] | None = None
        # Called once when the connection ends (set by a listener).
        self.on_end: Callable[[], None] | None = None
        # Messages this read callback may still hand out (READ_BUDGET_MESSAGES),
        # and whether a later turn was asked to go on (see _pump).
        self._budget = READ_BUDGET_MESSAGES
        self._yielded = False

    # -- Connection API ------------------------------------------------------

    @property
    def local_address(self) -> str:
        return self._local_address

    @property
    def peer_address(self) -> str:
        return self._peer_address

    @property
    def last_activity(self) -> float | None:
        return self._last_activity

    def stats(self) -> dict[str, int]:
        stats = super().stats()
        stats["device_bytes_staged"] += self._reader.staged_bytes
        return stats

    async def recv(self, *, allocator: Allocator | None = None) -> list[Any]:
        queue = self._queue
        if queue.ready:
            return queue.ready.popleft()
        if self._error is not None:
            raise self._closed_error()
        self._read_ahead = allocator is None and self._allocator is default_allocator
        return await queue.wait(allocator, self._kick)

    def deliver_to(self, receiver: Callable[[list[Any]], None], *,
                   small_as_bytearray: bool = False) -> bool:
        self._receiver = receiver
        # Every message is now allocated with the connection's allocator as
        # soon as announced: the reader may do it itself for small ones.
        reader = self._reader
        reader.auto_allocate = self._allocator is default_allocator
        reader.small_as_bytearray = reader.auto_allocate and small_as_bytearray
        ready = self._queue.ready
        while ready and self._error is None:
            self._hand_over(receiver, ready.popleft())
        if self._error is None:
            self._kick()
        return True

    def pause_reading(self) -> bool:
        # No message is handed out any more (the reader's hand_out stops),
        # and the next _pump() stops the driver's reading.
        self._reader.paused = True
        return True

    def resume_reading(self) -> None:
        if self._reader.paused:
            self._reader.paused = False
            if self._error is None:
                self._kick()

    def refuse_oversized(self, on_refused: Callable[[LimitExceededError], None]) -> bool:
        self._on_refused = on_refused
        self._reader.skip_oversized = True
        return True

    def _refused(self, error: LimitExceededError) -> None:
        logger.info("skipped a message from %s: %s", self._peer_address, error)
        assert self._on_refused is not None
        failure = call_consumer(self._on_refused, error, "refusal handler", self._peer_address)
        if failure is not None:
            self._fail(failure)

    def _hand_over(self, receiver: Callable[[list[Any]], None], message: list[Any]) -> None:
        error = call_consumer(receiver, message, "message receiver", self._peer_address)
        if error is not None:
            self._fail(error)

    def _kick(self) -> None:
        if self._pump():
            self._resume_reading()

    async def close(self) -> None:
        if self.closed:
            self.abort()
            return
        self._closing = True
        try:
            async with asyncio.timeout(self._config.close_timeout):
                async with self._send_lock:
                    await self._after_tail()
                    if self._error is None:
                        await self._send_buffers([GOODBYE])
                        self._shutdown_write()
                await asyncio.shield(self._peer_gone)
        except (TimeoutError, TensorwireError, OSError) as exc:
            logger.debug("polite close of %s cut short: %s", self, exc)
        finally:
            self._fail(ConnectionClosedError(f"connection to {self._peer_address} was closed"))

    def abort(self) -> None:
        self._fail(ConnectionClosedError(f"connection to {self._peer_address} was aborted"))

    # -- for drivers ---------------------------------------------------------

    @property
    def failure(self) -> TensorwireError | None:
        """The error that ended the connection, once it has ended."""
        return self._error

    async def wait_handshake(self, seconds: float) -> None:
        """Wait for the peer's handshake (already sent by the driver).

        Raises:
            TransportError: the peer is not a tensorwire endpoint, went away,
                or was too slow.
        """
        try:
            async with asyncio.timeout(seconds):
                await asyncio.shield(self._handshake)
        except TimeoutError:
            self._fail(ConnectionClosedError("handshake timed out"))
            raise TransportError(
                f"no tensorwire handshake from {self._peer_address} within {seconds} s"
            ) from None

    def _on_eof(self) -> None:
        if self._error is None:
            if self._reader.mid_message:
                reason = f"connection to {self._peer_address} broke in the middle of a message"
            else:
                reason = f"connection closed by the peer {self._peer_address}"
            self._fail(ConnectionClosedError(reason))
        self._set_peer_gone()

    def _fail(self, error: TensorwireError) -> None:
        """Close the I/O and fail everything waiting; the first error sticks."""
        if self._error is not None:
            return
        self._error = error
        self._close_io()
        if not self._handshake.done():
            self._handshake.set_exception(error)
            self._handshake.exception()
        self._set_peer_gone()
        self._queue.fail(error)
        # What the connection held goes now, by reference counting: the
        # receive buffers, and the consumer's callbacks (they refer back to
        # it, a cycle only the cycle collector would break).
        self._reader.release()
        self._receiver = None
        self._on_refused = None
        self.ended()

    def ended(self) -> None:
        """Call ``on_end`` (once), the connection having ended."""
        on_end, self.on_end = self.on_end, None
        if on_end is not None:
            on_end()

    # -- internals -------------------------------------------------------------

    def _set_peer_gone(self) -> None:
        if not self._peer_gone.done():
            self._peer_gone.set_result(None)

    def _closed_error(self) -> TensorwireError:
        error = self._error
        if error is None:
            return ConnectionClosedError(f"connection to {self._peer_address} is closing")
        if isinstance(error, ConnectionClosedError):
            return error
        closed = ConnectionClosedError(f"connection to {self._peer_address} failed: {error}")
        closed.__cause__ = error
        return closed

    @abc.abstractmethod
    def _resume_reading(self) -> None: ...

    @abc.abstractmethod
    def _close_io(self) -> None: ...
