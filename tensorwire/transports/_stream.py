"""What every byte-stream connection shares: framing, waiters, close.

A concrete driver supplies the I/O: ``_write`` (send a list of buffers),
``_pause_reading`` / ``_resume_reading``, ``_shutdown_write`` and
``_close_io``; it feeds received bytes to ``self._reader`` and calls
``_after_read()`` / ``_on_eof()`` / ``_fail()``.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ConnectionClosedError, LimitExceededError, TensorwireError, TransportError
from ._base import (
    READ_BUDGET_MESSAGES,
    Allocator,
    Connection,
    RecvQueue,
    call_consumer,
    consumer_failed,
    default_allocator,
    device_nbytes,
    host_view,
    is_device_frame,
    start_eagerly,
)
from ._frame_table import ONE_DATA_PRELUDE, ONE_FRAME_WORDS
from ._wire import (
    GOODBYE,
    FrameReader,
    Refused,
    pack_header,
    pack_one_frame,
)
from .config import TransportConfig

__all__ = ("StreamConnection", "outgoing")

logger = logging.getLogger(__name__)

#: Mid-message bytes show the peer alive (``last_activity``) only this many
#: at a time: any useful transfer rate passes a quantum every fraction of a
#: second, a peer trickling bytes to hold the connection open never does.
LIVENESS_QUANTUM = 64 * 1024

#: Small messages that arrived whole are handed to the queue of received
#: messages even before a recv() asks for them, up to this many: a burst of
#: small messages from one read then costs the consumer no wake-up and the
#: socket no pause and resume per message. The bound keeps a consumer that
#: does not call recv() pushing back on its sender.
READ_AHEAD_MESSAGES = 64


def outgoing(frames: Sequence[Any], owner: Connection | None = None) -> list[Any]:
    """The buffers that put ``frames`` on a byte stream: header, then frames.

    Host frames go as zero-copy views; a CUDA frame is first copied to host
    memory, since a socket cannot read device memory, and counted in the
    ``device_bytes_staged`` of ``owner`` (the connection that sends it).
    """
    if len(frames) == 1 and type(frames[0]) is bytes:
        # A small RPC message (its header frame holds the value).
        frame = frames[0]
        return [pack_one_frame(len(frame)), frame]
    sizes: list[int] = []
    devices: list[str] | None = None
    views: list[Any] = []
    for index, frame in enumerate(frames):
        # bytes and memoryviews (what serde and the RPC layer send) skip
        # the device check, which costs a failed attribute lookup.
        if type(frame) not in _HOST_TYPES and is_device_frame(frame):
            from ._device import device_to_host

            if devices is None:
                devices = ["cpu"] * index
            nbytes = device_nbytes(frame)
            sizes.append(nbytes)
            devices.append("cuda")
            views.append(device_to_host(frame).data)
            if owner is not None:
                owner.device_bytes_staged += nbytes
        else:
            view = host_view(frame)
            sizes.append(view.nbytes)
            if devices is not None:
                devices.append("cpu")
            views.append(view)
    return [pack_header(sizes, devices), *views]


_HOST_TYPES = frozenset({bytes, bytearray, memoryview})


def _outgoing_many(messages: Sequence[Sequence[Any]], owner: Connection) -> list[Any]:
    buffers: list[Any] = []
    append = buffers.append
    pack = ONE_FRAME_WORDS.pack
    for frames in messages:
        if len(frames) == 1:
            frame = frames[0]
            if type(frame) is bytes:
                # outgoing()'s first case (pack_one_frame), inlined: a batch
                # of small RPC messages.
                append(pack(ONE_DATA_PRELUDE, len(frame), 0))
                append(frame)
                continue
        buffers.extend(outgoing(frames, owner))
    return buffers


class StreamConnection(Connection):
    """A connection over an ordered byte stream, speaking docs/protocol.md."""

    coalesces_sends = True

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
        # Set by pause_reading(): no message is handed out, nothing read.
        self._held = False
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
    def closed(self) -> bool:
        return self._error is not None or self._closing

    @property
    def last_activity(self) -> float | None:
        return self._last_activity

    def stats(self) -> dict[str, int]:
        stats = super().stats()
        stats["device_bytes_staged"] += self._reader.staged_bytes
        return stats

    async def send(self, frames: Sequence[Any]) -> None:
        if self.closed:
            raise self._closed_error()
        buffers = outgoing(frames, self)
        self._count_out(1, buffers)
        await self._send_locked(buffers)

    async def send_many(self, messages: Sequence[Sequence[Any]]) -> None:
        # One scatter-gather write for the lot: under load (many RPC replies
        # at once) that is one syscall instead of one per message.
        if self.closed:
            raise self._closed_error()
        buffers = _outgoing_many(messages, self)
        self._count_out(len(messages), buffers)
        await self._send_locked(buffers)

    def _count_out(self, messages: int, buffers: list[Any]) -> int:
        """Count ``messages`` going out as ``buffers``; returns their bytes."""
        self.messages_sent += messages
        nbytes = sum(map(len, buffers))  # bytes, or memoryviews cast to "B"
        self.bytes_sent += nbytes
        return nbytes

    def send_nowait(self, messages: Sequence[Sequence[Any]]) -> asyncio.Future[None] | None:
        if self.closed:
            raise self._closed_error()
        buffers = _outgoing_many(messages, self)
        nbytes = self._count_out(len(messages), buffers)
        if not self._writes_now or self._send_lock.locked() or self._tail is not None:
            # Started now, not from a task's first step: it takes its place
            # in the send lock's queue before this returns, so a send()
            # called afterwards cannot overtake it.
            return start_eagerly(self._send_locked(buffers))
        try:
            self._write_now(buffers, nbytes)
        except OSError as exc:
            raise self._write_failed(exc) from exc
        if not buffers:
            return None
        # The socket is full part-way: the rest follows from a task, and the
        # next send waits for it, as after a cancelled send.
        tail = self._tail = self._loop.create_task(self._finish(buffers, report=True))
        return tail

    async def _send_locked(self, buffers: list[Any]) -> None:
        async with self._send_lock:
            await self._after_tail()
            if self.closed:
                raise self._closed_error()
            await self._send_buffers(buffers)

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
        # The next _pump() stops, and with it the driver's reading.
        self._held = True
        return True

    def resume_reading(self) -> None:
        if self._held:
            self._held = False
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

    def _note_progress(self, nbytes: int) -> None:
        """``nbytes`` more arrived (and were parsed): update ``last_activity``."""
        self.bytes_received += nbytes
        self._unseen_bytes += nbytes
        if self._reader.events or self._unseen_bytes >= LIVENESS_QUANTUM:
            self._unseen_bytes = 0
            self._last_activity = self._loop.time()

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

    def _after_read(self) -> bool:
        """Hand out what the reader produced; False: stop reading for now."""
        if not self._handshake.done() and not self._reader.awaiting_handshake:
            self._handshake.set_result(None)
        return self._pump()

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

    def _go_on(self) -> None:
        """A later turn's share of the work a read callback left (see _pump)."""
        self._yielded = False
        self._budget = READ_BUDGET_MESSAGES
        if self._error is None:
            self._kick()

    def _pump(self) -> bool:
        if self._held:
            return False
        reader = self._reader
        events = reader.events
        while True:
            while events:
                if self._budget <= 0:
                    # Fairness: give the loop back; a later turn goes on
                    # (meanwhile the driver does not read).
                    if not self._yielded:
                        self._yielded = True
                        self._loop.call_soon(self._go_on)
                    return False
                self._budget -= 1
                event = events.popleft()
                if type(event) is not list:
                    if isinstance(event, Refused):
                        self.messages_received += 1
                        self._refused(event.error)
                        if self._error is not None:
                            return False
                        continue
                    self._fail(
                        ConnectionClosedError(f"connection closed by the peer {self._peer_address}")
                    )
                    return False
                self.messages_received += 1
                receiver = self._receiver
                if receiver is None:
                    self._queue.deliver(event)
                    continue
                try:  # call_consumer, inlined: this runs for every message
                    receiver(event)
                except Exception as exc:
                    self._fail(consumer_failed(exc, "message receiver", self._peer_address))
                    return False
                if self._error is not None or self._held:
                    return False
            if reader.frames_announced is None:
                return self._error is None
            if self._receiver is not None:
                if not self._allocate(self._allocator):
                    return False
                continue
            if not self._queue.waiters:
                if (
                    self._read_ahead
                    and reader.message_buffered
                    and len(self._queue.ready) < READ_AHEAD_MESSAGES
                ):
                    # Already received whole: take it out of the read-ahead
                    # buffer now (see READ_AHEAD_MESSAGES).
                    reader.allocate(default_allocator)
                    continue
                return False
            waiter, allocator = self._queue.waiters[0]
            if not self._allocate(allocator or self._allocator):
                return False
            self._queue.bind(waiter)

    def _allocate(self, allocator: Allocator) -> bool:
        """Allocate the announced message; False: that failed the connection."""
        try:
            self._reader.allocate(allocator)
        except TensorwireError as exc:
            self._fail(exc)
            return False
        except Exception as exc:
            error = TransportError(f"receive allocator failed: {exc!r}")
            error.__cause__ = exc
            self._fail(error)
            return False
        return True

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

    #: Whether the driver can write without waiting (``_write_now``).
    _writes_now = False

    def _write_now(self, buffers: list[Any], nbytes: int) -> None:
        """Write what the socket takes now of ``buffers`` (``nbytes`` in
        all), removing it from their front; raises OSError when the write
        fails."""
        raise NotImplementedError

    @abc.abstractmethod
    async def _write(self, buffers: list[Any]) -> None:
        """Write all of ``buffers`` in order, removing from the front of the
        list what has gone out (so that a cancelled write can be finished)."""

    @abc.abstractmethod
    def _resume_reading(self) -> None: ...

    @abc.abstractmethod
    def _shutdown_write(self) -> None: ...

    @abc.abstractmethod
    def _close_io(self) -> None: ...
