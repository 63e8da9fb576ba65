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
from collections.abc import Callable
from typing import Any

from ..errors import ConnectionClosedError, TensorwireError, TransportError, Unavailable
from ..transports import Connection
from . import protocol
from .protocol import Message

__all__ = ("Channel", "frames_nbytes")

logger = logging.getLogger(__name__)


def frames_nbytes(frames: list[Any]) -> int:
    total = 0
    for frame in frames:
        try:
            total += memoryview(frame).nbytes
        except TypeError:  # a device buffer
            total += int(getattr(frame, "nbytes", 0))
    return total


class Channel:
    """Reads, parses and dispatches messages; sends; watches the peer."""

    def __init__(
        self,
        conn: Connection,
        on_message: Callable[[Message, int], None],
        on_close: Callable[[TensorwireError], None],
        *,
        heartbeat_timeout: float,
        ping_interval: float | None = None,
    ) -> None:
        self.conn = conn
        self._on_message = on_message
        self._on_close = on_close
        self._timeout = heartbeat_timeout
        self._ping_interval = ping_interval
        self.loop = self._loop = asyncio.get_running_loop()
        self._last_seen = self._loop.time()
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self._writing = False
        self._outbox: list[list[Any]] | None = None
        self._flushed: asyncio.Future[None] | None = None
        self.error: TensorwireError | None = None

    @property
    def closed(self) -> bool:
        return self.error is not None

    def start(self) -> None:
        self._tasks.append(self._loop.create_task(self._read_loop()))
        self._tasks.append(self._loop.create_task(self._watchdog()))

    async def send(self, message: Message) -> int:
        """Send ``message``; returns the bytes it took.

        A message goes out at once. Only while a write is stuck (the socket
        is full) do later messages queue up; the stuck writer then sends them
        all in one ``send_many``. Gathering more eagerly would make the two
        ends take turns instead of working at the same time.

        Raises:
            Unavailable: the connection is gone.
        """
        if self.error is not None:
            raise _unavailable(self.error)
        frames = protocol.encode(message)
        if self._writing:
            if self._outbox is None:
                self._outbox = []
                self._flushed = self._loop.create_future()
            self._outbox.append(frames)
            flushed = self._flushed
            assert flushed is not None
            # Shielded: one sender giving up must not fail the others.
            await asyncio.shield(flushed)
            return frames_nbytes(frames)
        self._writing = True
        try:
            await self.conn.send(frames)
        except asyncio.CancelledError:
            # The transport finishes a message it had started; what queued
            # behind it still goes out, from a task of the channel's own.
            self._drain_later()
            raise
        except BaseException as exc:
            self._writing = False
            self._fail_queued(exc)
            if isinstance(exc, ConnectionClosedError):
                self.close_with(exc)
                raise _unavailable(exc) from exc
            raise
        if self._outbox:
            await self._drain()
        else:
            self._writing = False
        return frames_nbytes(frames)

    async def _drain(self) -> None:
        """Send what queued behind a stuck write, batch by batch."""
        in_flight: asyncio.Future[None] | None = None
        try:
            while self._outbox:
                batch, in_flight = self._outbox, self._flushed
                self._outbox, self._flushed = None, None
                await self.conn.send_many(batch)
                assert in_flight is not None
                in_flight.set_result(None)
                in_flight = None
        except asyncio.CancelledError:
            if in_flight is not None:
                # Started batches are finished by the transport.
                in_flight.set_result(None)
            self._drain_later()
            raise
        except BaseException as exc:
            if in_flight is not None:
                in_flight.set_exception(_unavailable(exc))
            self._writing = False
            self._fail_queued(exc)
            if isinstance(exc, ConnectionClosedError):
                self.close_with(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            self._writing = False

    def _drain_later(self) -> None:
        if not self._outbox:
            self._writing = False
            return
        task = self._loop.create_task(self._drain())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _fail_queued(self, exc: BaseException) -> None:
        """Whoever queued behind a failed write learns that it failed too."""
        queued, self._flushed, self._outbox = self._flushed, None, None
        if queued is not None:
            queued.set_exception(_unavailable(exc))

    def send_soon(self, message: Message) -> None:
        """Send without waiting (pongs, cancels); failures only close the channel."""
        if self.error is not None:
            return
        task = self._loop.create_task(self._send_quietly(message))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_quietly(self, message: Message) -> None:
        with contextlib.suppress(TensorwireError):
            await self.send(message)

    def close_with(self, error: TensorwireError) -> None:
        """Abort the connection and tell the session why; idempotent."""
        if self.error is not None:
            return
        self.error = error
        self.conn.abort()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self._on_close(error)

    async def close(self) -> None:
        """Close the connection politely and wait for the channel's tasks."""
        if self.error is None:
            self.error = ConnectionClosedError("closed by this side")
            with contextlib.suppress(TransportError):
                await self.conn.close()
            for task in self._tasks:
                task.cancel()
            self._on_close(self.error)
        await self.wait_closed()

    async def wait_closed(self) -> None:
        current = asyncio.current_task()
        pending = [t for t in (*self._tasks, *self._background) if t is not current]
        await asyncio.gather(*pending, return_exceptions=True)

    async def _read_loop(self) -> None:
        conn = self.conn
        try:
            while True:
                frames = await conn.recv()
                self._last_seen = self._loop.time()
                message = protocol.parse(frames)
                self._on_message(message, frames_nbytes(frames))
        except asyncio.CancelledError:
            raise
        except TensorwireError as exc:
            if not isinstance(exc, ConnectionClosedError):
                logger.warning("closing connection to %s: %s", conn.peer_address, exc)
            self.close_with(exc)
        except Exception as exc:
            logger.exception("RPC session on %s failed", conn.peer_address)
            self.close_with(TransportError(f"RPC session failed: {exc!r}"))

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
            if silent > self._timeout:
                self.close_with(
                    Unavailable(f"{self.conn.peer_address} was silent for {silent:.1f} s")
                )
                return
            if self._ping_interval is not None and now >= next_ping:
                next_ping = now + self._ping_interval
                self.send_soon(protocol.Ping(0))


def _unavailable(error: BaseException) -> Unavailable:
    if isinstance(error, Unavailable):
        return error
    return Unavailable(f"connection lost: {error}")
