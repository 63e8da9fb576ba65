"""The asyncio driver around one transport connection, shared by both roles.

It reads messages, parses them with the sans-IO ``protocol`` and hands each
to the session; it sends messages; it watches liveness: a peer from whom
nothing arrived for ``heartbeat_timeout`` is dead, and a client pings every
``ping_interval`` so that an idle connection is not mistaken for a dead one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import (
    ConnectionClosedError,
    LimitExceededError,
    TensorwireError,
    TransportError,
    Unavailable,
)
from ..transports import Connection
from . import protocol
from ._driver_core import BATCH, DriverCore, fail_waiter, frames_nbytes, unavailable
from .protocol import Message

__all__ = ("BATCH", "ConnectionDriver", "frames_nbytes")

logger = logging.getLogger(__name__)


class ConnectionDriver(DriverCore):
    """Reads, parses and dispatches messages; sends; watches the peer.

    The per-message work (delivering, the outbox, the output bound) is
    compiled, in ``DriverCore`` (_driver_core.pyx); this class starts,
    closes, reads and watches.
    """

    def __init__(
        self,
        conn: Connection,
        on_message: Callable[[Message, int], None],
        on_close: Callable[[TensorwireError], None],
        *,
        heartbeat_timeout: float,
        ping_interval: float | None = None,
        on_refused: Callable[[Message | None, LimitExceededError], None] | None = None,
        max_unsent: int = 64 << 20,
    ) -> None:
        super().__init__(conn, on_message, max_unsent=max_unsent)
        self._on_refused = on_refused
        self._on_close = on_close
        self._timeout = heartbeat_timeout
        self._ping_interval = ping_interval
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, *, refused: Sequence[LimitExceededError] = ()) -> None:
        """Start reading and watching; ``refused``: messages the transport
        skipped before (a session learns of them first)."""
        conn = self.conn
        # Both before anything more is read (the transport parses as bytes
        # arrive): a message beyond our limits then fails only its own call
        # (RESOURCE_EXHAUSTED), where the transport can skip it, and where it
        # can, the transport calls _deliver itself as messages complete (no
        # task wake-up per message); recv() then only raises when the
        # connection ends.
        if self._on_refused is not None:
            conn.refuse_oversized(self._refused)
        for error in refused:
            self._refused(error)
        # The driver itself: a MessageReceiver, which the transport calls
        # by a C call (its receive, which is _deliver).
        conn.deliver_to(self, small_as_bytearray=True)
        self._tasks.append(self.loop.create_task(self._read_loop()))
        self._tasks.append(self.loop.create_task(self._watchdog()))

    async def drained(self) -> None:
        """Wait until the unsent output is under the low-water mark (at
        once when it is not over the bound).

        Raises:
            Unavailable: the connection was lost meanwhile.
        """
        if self.error is not None:
            raise unavailable(self.error)
        if not self.reading_paused:
            return
        if self._drained is None:
            self._drained = self.loop.create_future()
        await asyncio.shield(self._drained)

    def _post(self, message: Message) -> list[Any]:
        frames = protocol.encode(message)
        self.post_frames(frames)
        return frames

    async def send(self, message: Message) -> int:
        """Send ``message``, waiting only while the transport cannot take it
        at once; returns the bytes it took. A cancelled wait does not take
        the message back: it still goes out, in order.

        Raises:
            Unavailable: the connection is gone.
        """
        frames = self._post(message)
        if self._outbox and self._outbox[-1] is frames:
            if self._flushed is None:
                self._flushed = self.loop.create_future()
            await asyncio.shield(self._flushed)
        elif self._writing is not None:
            written = self._writing_flushed
            if written is None:
                written = self._writing_flushed = self.loop.create_future()
            await asyncio.shield(written)
        return frames_nbytes(frames)

    def send_soon(self, message: Message) -> None:
        """Send without waiting (pongs, cancels, credits); a closed driver drops it."""
        if self.error is None:
            self._post(message)

    def _fail_queued(self, error: TensorwireError) -> None:
        """Whoever waits for a message that now cannot go learns why."""
        self._outbox = []
        self._unsent -= self._outbox_bytes
        self._outbox_bytes = 0
        fail_waiter(self._drained, error)
        fail_waiter(self._flushed, error)
        fail_waiter(self._writing_flushed, error)
        self._flushed = self._writing_flushed = None

    def close_with(self, error: TensorwireError) -> None:
        """Abort the connection and tell the session why; idempotent."""
        if self.error is not None:
            return
        self.error = error
        self.conn.abort()
        self._fail_queued(error)
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self._on_close(error)

    async def close(self) -> None:
        """Close the connection politely and wait for the driver's tasks."""
        if self.error is None:
            self.error = ConnectionClosedError("closed by this side")
            fail_waiter(self._drained, self.error)
            outbox, flushed = self._outbox, self._flushed
            self._outbox, self._flushed = [], None
            self._outbox_bytes = 0
            if outbox:
                # What was queued still goes out, before the goodbye.
                try:
                    await self.conn.send_many(outbox)
                except TransportError as exc:
                    fail_waiter(flushed, exc)
                    flushed = None
            if flushed is not None:
                flushed.set_result(None)
            with contextlib.suppress(TransportError):
                await self.conn.close()
            for task in self._tasks:
                task.cancel()
            self._on_close(self.error)
        await self.wait_closed()

    async def wait_closed(self) -> None:
        current = asyncio.current_task()
        pending = [t for t in self._tasks if t is not current]
        await asyncio.gather(*pending, return_exceptions=True)
        # The driver is done: let go of its tasks and of the session's
        # callbacks, which refer back to it, so that a closed connection's
        # objects go by reference counting alone (issue 21).
        self._tasks = [t for t in self._tasks if not t.done()]
        self._on_message = _ignore_message
        self._on_refused = None
        self._on_close = _ignore_close

    async def _read_loop(self) -> None:
        conn = self.conn
        try:
            while True:
                self._deliver(await conn.recv())
        except asyncio.CancelledError:
            raise
        except TensorwireError as exc:
            if not isinstance(exc, ConnectionClosedError):
                logger.warning("closing connection to %s: %s", conn.peer_address, exc)
            # Kept without its traceback, whose frames would keep this
            # driver and its connection (a cycle; see wait_closed).
            self.close_with(exc.with_traceback(None))

    def _refused(self, error: LimitExceededError) -> None:
        """The transport skipped a message beyond our limits: tell the
        session which call it belonged to, when its first frame says."""
        if self.error is not None or self._on_refused is None:
            return
        self._last_seen = self.loop.time()
        message: Message | None = None
        if error.head is not None:
            try:
                message = protocol.parse([error.head])
            except TensorwireError:
                message = None
        try:
            self._on_refused(message, error)
        except TensorwireError as exc:
            logger.warning("closing connection to %s: %s", self.conn.peer_address, exc)
            self.close_with(exc)

    async def _watchdog(self) -> None:
        tick = min(self._ping_interval or self._timeout, self._timeout / 4)
        next_ping = self.loop.time()
        while self.error is None:
            await asyncio.sleep(tick)
            now = self.loop.time()
            # Bytes arriving mid-message count too: a long transfer is not
            # silence. Where the transport stamps whole messages
            # (conn.stamps_messages), _deliver leaves them to it.
            seen = max(self._last_seen, self.conn.last_activity or 0.0)
            silent = now - seen
            # Paused over our own unsent output, we do not listen: the peer
            # is not silent, and it goes when a write to it fails.
            if silent > self._timeout and not self.reading_paused:
                self.close_with(
                    Unavailable(f"{self.conn.peer_address} was silent for {silent:.1f} s")
                )
                return
            if self._ping_interval is not None and now >= next_ping:
                next_ping = now + self._ping_interval
                self.send_soon(protocol.Ping(0))


def _ignore_message(message: Message, nbytes: int) -> None:
    pass


def _ignore_close(error: TensorwireError) -> None:
    pass
