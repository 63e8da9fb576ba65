"""Sending on a byte stream: messages as the buffers of one scatter-gather
write (``_stream_writes.outgoing_many``, compiled), the send lock, writing
from a task what the socket did not take at once, and finishing a message
whose sender was cancelled part-way (the peer's framing must hold).

A part of :class:`~._stream_connection.StreamConnection`, in a module of its own: the
connection's state it works on is declared below for the type checker.
``send_nowait`` and writing at once are per message, and compiled
(``_stream_core.pyx``); the driver (tcp://) supplies ``_write`` and
``_shutdown_write``.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ConnectionClosedError, TensorwireError
from ._base import Connection
from ._stream_writes import outgoing_many

__all__ = ("StreamSending",)


class StreamSending(Connection):
    """The sending half of :class:`StreamConnection`."""

    if TYPE_CHECKING:
        _loop: asyncio.AbstractEventLoop
        _peer_address: str
        _error: TensorwireError | None
        _send_lock: asyncio.Lock
        # The rest of a message whose sender was cancelled mid-write.
        _tail: asyncio.Task[None] | None

        def _closed_error(self) -> TensorwireError: ...
        def _fail(self, error: TensorwireError) -> None: ...
        # Compiled, in StreamCore (_stream_core.pyx).
        def _count_out(self, messages: int, nbytes: int) -> None: ...
        def _may_write_now(self) -> bool: ...
        def _write_at_once(self, buffers: list[Any]) -> asyncio.Task[None] | None: ...

    async def send(self, frames: Sequence[Any]) -> None:
        if self.closed:
            raise self._closed_error()
        buffers, nbytes = outgoing_many((frames,), self)
        self._count_out(1, nbytes)
        if not self._may_write_now():
            await self._send_locked(buffers)
            return
        rest = self._write_at_once(buffers)
        if rest is not None:
            # Shielded: a cancelled sender leaves the rest to be finished,
            # as the peer's framing needs (and the next send waits for it).
            await asyncio.shield(rest)

    async def send_many(self, messages: Sequence[Sequence[Any]]) -> None:
        # One scatter-gather write for the lot: under load (many RPC replies
        # at once) that is one syscall instead of one per message.
        if self.closed:
            raise self._closed_error()
        buffers, nbytes = outgoing_many(messages, self)
        self._count_out(len(messages), nbytes)
        await self._send_locked(buffers)

    async def _send_locked(self, buffers: list[Any]) -> None:
        async with self._send_lock:
            await self._after_tail()
            if self.closed:
                raise self._closed_error()
            await self._send_buffers(buffers)

    async def _send_buffers(self, buffers: list[Any]) -> None:
        count, first = len(buffers), buffers[0] if buffers else None
        try:
            await self._write(buffers)
        except asyncio.CancelledError:
            # _write consumes ``buffers`` from the front. If part of the
            # message is out, the rest must follow or the peer's framing is
            # lost: finish it in the background, and the connection lives.
            started = len(buffers) != count or (buffers and buffers[0] is not first)
            if started and buffers and self._error is None:
                self._tail = self._loop.create_task(self._finish(buffers))
            raise
        except OSError as exc:
            raise self._write_failed(exc) from exc

    def _write_failed(self, exc: OSError) -> TensorwireError:
        """Fail the connection after a write error; the error to raise."""
        if not isinstance(exc, TensorwireError):
            error = ConnectionClosedError(f"send to {self._peer_address} failed: {exc}")
            error.__cause__ = exc
            self._fail(error)
        return self._closed_error()

    async def _after_tail(self) -> None:
        """Wait (under the send lock) for the rest of a cancelled send."""
        tail = self._tail
        if tail is not None:
            await asyncio.wait([tail])

    async def _finish(self, buffers: list[Any], *, report: bool = False) -> None:
        """Write the rest of a message; ``report``: raise what failed (someone
        awaits this task), else only fail the connection."""
        try:
            await self._write(buffers)
        except OSError as exc:
            error = self._write_failed(exc)
            if report:
                raise error from exc
        finally:
            self._tail = None

    @abc.abstractmethod
    async def _write(self, buffers: list[Any]) -> None:
        """Write all of ``buffers`` in order, removing from the front of the
        list what has gone out (so that a cancelled write can be finished)."""

    @abc.abstractmethod
    def _shutdown_write(self) -> None: ...
