"""The asyncio driver around one transport connection, shared by both roles.

It reads messages, parses them with the sans-IO ``protocol`` and hands each
to the session; it sends messages; it watches liveness: a peer from whom
nothing arrived for ``heartbeat_timeout`` is dead, and a client pings every
``ping_interval`` so that an idle connection is not mistaken for a dead one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import (
    ConnectionClosedError,
    LimitExceededError,
    TensorwireError,
    TransportError,
    Unavailable,
)
from ..transports import Connection
from . import protocol
from .protocol import Message

__all__ = ("BATCH", "ConnectionDriver", "frames_nbytes")

logger = logging.getLogger(__name__)

#: Messages posted in one loop turn are written together, this many at a time
#: (see ``ConnectionDriver.post``).
BATCH = 32


def frames_nbytes(frames: list[Any]) -> int:
    if len(frames) == 1:
        # A small message: one frame, as protocol.encode makes it and as the
        # transports deliver it (bytearray).
        frame = frames[0]
        kind = type(frame)
        if kind is bytes or kind is bytearray:
            return len(frame)
    total = 0
    for frame in frames:
        kind = type(frame)
        # What serde and the transports hand us, without a memoryview each.
        if kind is bytes or kind is bytearray:
            total += len(frame)
        elif kind is np.ndarray or kind is memoryview:
            total += frame.nbytes
        else:
            try:
                total += memoryview(frame).nbytes
            except TypeError:  # a device buffer
                total += int(getattr(frame, "nbytes", 0))
    return total


class ConnectionDriver:
    """Reads, parses and dispatches messages; sends; watches the peer."""

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
        self.conn = conn
        self._on_message = on_message
        self._on_refused = on_refused
        self._on_close = on_close
        self._timeout = heartbeat_timeout
        self._ping_interval = ping_interval
        self.loop = self._loop = asyncio.get_running_loop()
        self._last_seen = self._loop.time()
        self._tasks: list[asyncio.Task[None]] = []
        # Messages not yet handed to the transport, and the future of their
        # senders (made when someone waits for them).
        self._outbox: list[list[Any]] = []
        self._flushed: asyncio.Future[None] | None = None
        # Set while the transport writes a batch it could not take at once,
        # with the future of that batch's senders.
        self._writing: asyncio.Future[None] | None = None
        self._writing_flushed: asyncio.Future[None] | None = None
        self._turn: asyncio.Handle | None = None
        # Write a turn's first message at once (see post()).
        self._eager = not conn.coalesces_sends
        self.error: TensorwireError | None = None
        # Backpressure (see _count_unsent): bytes posted and not yet
        # written, those of them in the outbox, and whether reading is
        # paused over them.
        self._unsent = 0
        self._outbox_bytes = 0
        self._high_water = max_unsent
        self._low_water = max_unsent // 4
        self.reading_paused = False
        # Set when reading resumes: senders that wait for the output to
        # drain (drained()).
        self._drained: asyncio.Future[None] | None = None

    @property
    def closed(self) -> bool:
        return self.error is not None

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
        conn.deliver_to(self._deliver, small_as_bytearray=True)
        self._tasks.append(self._loop.create_task(self._read_loop()))
        self._tasks.append(self._loop.create_task(self._watchdog()))

    def post(self, message: Message) -> int:
        """Queue ``message`` for sending without waiting; returns its size.

        Messages of one event-loop turn are handed to the transport
        together, every ``BATCH`` messages and at the end of the turn. Where
        that saves work (``conn.coalesces_sends``: tcp://, one system call
        for many small messages, and on a VM a loopback write costs tens of
        microseconds), the turn's first message waits for the others too;
        elsewhere (ucx://, one post per message whatever the batch) it goes
        at once, so that the peer starts on it while this side works on.
        While the transport cannot take more (a full socket), messages wait
        here, in order. Gathering a whole turn before writing anything made
        the two ends take turns instead of working at the same time.

        Raises:
            Unavailable: the connection is gone.
        """
        return self.post_frames(protocol.encode(message))

    def post_frames(self, frames: list[Any]) -> int:
        """``post`` for a message already encoded (``protocol.encode_request``
        and ``encode_response``: the hot paths make no message object). Its
        first frame is bytes, as every encoder of ``protocol`` makes it."""
        if self.error is not None:
            raise _unavailable(self.error)
        # frames_nbytes() of a small message, inlined.
        nbytes = len(frames[0]) if len(frames) == 1 else frames_nbytes(frames)
        self._outbox_bytes += nbytes
        self._unsent += nbytes
        if self._unsent > self._high_water and not self.reading_paused:
            self._pause_reading()
        outbox = self._outbox
        outbox.append(frames)
        if self._writing is None:
            if self._turn is None:
                self._turn = self._loop.call_soon(self._end_turn)
                if self._eager:
                    self._flush()
            elif len(outbox) >= BATCH:
                self._flush()
        return nbytes

    def _pause_reading(self) -> None:
        """Our output to the peer is over the bound: take no more of its
        messages (each may add a reply) until it is under the low-water
        mark. A peer that never reads so holds at most the bound."""
        self.reading_paused = True
        logger.debug("%s: %d bytes unsent, reading paused", self.conn.peer_address,
                     self._unsent)
        self.conn.pause_reading()

    def _sent(self, nbytes: int) -> None:
        """``nbytes`` of the posted output went out (or were dropped)."""
        self._unsent -= nbytes
        if self.reading_paused and self._unsent <= self._low_water:
            self.reading_paused = False
            self._last_seen = self._loop.time()  # we were not listening
            drained, self._drained = self._drained, None
            if drained is not None and not drained.done():
                drained.set_result(None)
            if self.error is None:
                self.conn.resume_reading()

    async def drained(self) -> None:
        """Wait until the unsent output is under the low-water mark (at
        once when it is not over the bound).

        Raises:
            Unavailable: the connection was lost meanwhile.
        """
        if self.error is not None:
            raise _unavailable(self.error)
        if not self.reading_paused:
            return
        if self._drained is None:
            self._drained = self._loop.create_future()
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
                self._flushed = self._loop.create_future()
            await asyncio.shield(self._flushed)
        elif self._writing is not None:
            written = self._writing_flushed
            if written is None:
                written = self._writing_flushed = self._loop.create_future()
            await asyncio.shield(written)
        return frames_nbytes(frames)

    def send_soon(self, message: Message) -> None:
        """Send without waiting (pongs, cancels, credits); a closed driver drops it."""
        if self.error is None:
            self._post(message)

    def _end_turn(self) -> None:
        self._turn = None
        if self._outbox and self._writing is None and self.error is None:
            self._flush()

    def _flush(self) -> None:
        batch, self._outbox = self._outbox, []
        flushed, self._flushed = self._flushed, None
        nbytes, self._outbox_bytes = self._outbox_bytes, 0
        try:
            writing = self.conn.send_nowait(batch)
        except TensorwireError as exc:
            # Closed, or a frame the transport cannot send (a bug: serde
            # makes only contiguous buffers): either way the stream is done.
            _fail(flushed, exc)
            self.close_with(exc)
            return
        if writing is None:
            self._sent(nbytes)
            if flushed is not None:
                flushed.set_result(None)
            return
        self._writing, self._writing_flushed = writing, flushed
        writing.add_done_callback(functools.partial(self._written, nbytes))

    def _written(self, nbytes: int, writing: asyncio.Future[None]) -> None:
        self._sent(nbytes)
        flushed, self._writing, self._writing_flushed = self._writing_flushed, None, None
        error = (ConnectionClosedError("send cancelled") if writing.cancelled()
                 else writing.exception())
        if error is None:
            if flushed is not None:
                flushed.set_result(None)
            if self._outbox and self.error is None:
                self._flush()
            return
        _fail(flushed, error)
        self.close_with(error if isinstance(error, TensorwireError)
                        else TransportError(f"send failed: {error!r}"))

    def _fail_queued(self, error: TensorwireError) -> None:
        """Whoever waits for a message that now cannot go learns why."""
        self._outbox = []
        self._unsent -= self._outbox_bytes
        self._outbox_bytes = 0
        _fail(self._drained, error)
        _fail(self._flushed, error)
        _fail(self._writing_flushed, error)
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
            _fail(self._drained, self.error)
            outbox, flushed = self._outbox, self._flushed
            self._outbox, self._flushed = [], None
            self._outbox_bytes = 0
            if outbox:
                # What was queued still goes out, before the goodbye.
                try:
                    await self.conn.send_many(outbox)
                except TransportError as exc:
                    _fail(flushed, exc)
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

    def _deliver(self, frames: list[Any]) -> None:
        """Parse one received message and hand it to the session."""
        if self.error is not None:
            return
        self._last_seen = self._loop.time()
        try:
            message = protocol.parse(frames)
            frame = frames[0]
            # frames_nbytes() of a small message (as the transports deliver
            # it), inlined.
            self._on_message(message, len(frame) if type(frame) is bytearray
                             and len(frames) == 1 else frames_nbytes(frames))
        except TensorwireError as exc:
            logger.warning("closing connection to %s: %s", self.conn.peer_address, exc)
            self.close_with(exc)
        except Exception as exc:
            logger.exception("RPC session on %s failed", self.conn.peer_address)
            self.close_with(TransportError(f"RPC session failed: {exc!r}"))

    def _refused(self, error: LimitExceededError) -> None:
        """The transport skipped a message beyond our limits: tell the
        session which call it belonged to, when its first frame says."""
        if self.error is not None or self._on_refused is None:
            return
        self._last_seen = self._loop.time()
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
        next_ping = self._loop.time()
        while self.error is None:
            await asyncio.sleep(tick)
            now = self._loop.time()
            # Bytes arriving mid-message count too: a long transfer is not
            # silence.
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


def _fail(waiting: asyncio.Future[None] | None, error: BaseException) -> None:
    if waiting is not None and not waiting.done():
        waiting.set_exception(_unavailable(error))
        waiting.exception()  # retrieved: its sender may have stopped waiting


def _unavailable(error: BaseException) -> Unavailable:
    if isinstance(error, Unavailable):
        return error
    return Unavailable(f"connection lost: {error}")
