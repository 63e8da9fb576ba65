"""The transport interface: connections that move messages (lists of frames)."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Generator, Sequence
from typing import Any, Literal

import numpy as np

from ..errors import ConnectionClosedError, LimitExceededError, TransportError
from ._pool import POOL_MIN_BYTES, buffer_pool
from .config import Limits, TransportConfig

__all__ = (
    "READ_BUDGET_BYTES",
    "READ_BUDGET_MESSAGES",
    "Admission",
    "Allocator",
    "Connection",
    "ConnectionHandler",
    "FrameInfo",
    "Listener",
    "default_allocator",
)

logger = logging.getLogger(__name__)

Device = Literal["cpu", "cuda"]
#: Fairness: one read callback of a connection hands out at most this many
#: messages (the consumer's work on them, such as RPC handlers run inline,
#: happens inside the callback) and reads at most about this many bytes,
#: then gives the event loop back; the rest follows on a later turn. A peer
#: that pipelines at full speed otherwise keeps the loop from every other
#: connection, timer and accept (issue 21).
READ_BUDGET_MESSAGES = 64
READ_BUDGET_BYTES = 1 << 20

#: Host frames are writable NumPy uint8 arrays aligned to this many bytes, so
#: that any dtype (and AVX-512 loads) can view them without a copy.
ALIGNMENT = 64


@dataclasses.dataclass(slots=True)
class FrameInfo:
    """What the receiver knows of a frame before its data lands.

    Attributes:
        index: position of the frame in its message.
        nbytes: exact size of the frame.
        device: ``"cpu"`` for host memory, ``"cuda"`` for device memory.
    """

    # Not frozen: one is built per received frame, and a frozen dataclass's
    # __init__ costs twice as much.
    index: int
    nbytes: int
    device: Device = "cpu"


#: Returns a writable buffer of exactly ``info.nbytes`` bytes: host memory
#: (anything with the writable buffer protocol) for ``"cpu"`` frames, an object
#: with ``__cuda_array_interface__`` for ``"cuda"`` frames.
Allocator = Callable[[FrameInfo], Any]
ConnectionHandler = Callable[["Connection"], Awaitable[None]]


def host_empty(nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A writable uint8 array of ``nbytes`` whose data is ALIGNMENT-aligned.

    Large ones come from the process's :func:`buffer_pool`.
    """
    if nbytes >= POOL_MIN_BYTES:
        return buffer_pool().empty(nbytes, align=ALIGNMENT)
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    # ctypes.addressof(c_char.from_buffer()) costs half of ``raw.ctypes.data``,
    # and this runs for every message received.
    offset = -ctypes.addressof(ctypes.c_char.from_buffer(raw.data)) % ALIGNMENT
    return raw[offset : offset + nbytes]


def default_allocator(info: FrameInfo) -> Any:
    """Allocate each frame at its exact size where it belongs.

    Host frames of ``POOL_MIN_BYTES`` and more come from :func:`buffer_pool`.
    """
    if info.device == "cuda":
        from ._device import device_empty

        return device_empty(info.nbytes)
    return host_empty(info.nbytes)


def is_device_frame(frame: Any) -> bool:
    """True when ``frame`` lives in GPU memory."""
    return hasattr(frame, "__cuda_array_interface__") and not _has_buffer_protocol(frame)


def _has_buffer_protocol(obj: Any) -> bool:
    try:
        memoryview(obj)
    except TypeError:
        return False
    return True


def device_nbytes(frame: Any) -> int:
    """Size of a contiguous CUDA buffer from ``__cuda_array_interface__``."""
    cai = frame.__cuda_array_interface__
    if cai.get("strides") is not None:
        itemsize = np.dtype(cai["typestr"]).itemsize
        expected = itemsize
        for dim, stride in zip(reversed(cai["shape"]), reversed(cai["strides"]), strict=True):
            if stride != expected and dim > 1:
                raise TransportError("CUDA frames must be C-contiguous")
            expected *= dim
    count = 1
    for dim in cai["shape"]:
        count *= dim
    return count * int(np.dtype(cai["typestr"]).itemsize)


def host_view(frame: Any) -> memoryview:
    """A flat byte view of a host frame, without copying.

    Raises:
        TransportError: the frame is neither a buffer nor contiguous.
    """
    try:
        view = memoryview(frame)
    except TypeError as exc:
        raise TransportError(
            f"a frame must support the buffer protocol or __cuda_array_interface__, "
            f"got {type(frame).__name__}"
        ) from exc
    if view.format == "B" and view.ndim == 1:
        return view
    if view.c_contiguous:
        return view.cast("B")
    if view.f_contiguous:
        # memoryview cannot cast a Fortran-ordered view; NumPy can, still
        # without copying.
        return np.asarray(view).ravel(order="F").view(np.uint8).data
    raise TransportError("frames must be contiguous buffers")


def writable_view(buffer: Any, info: FrameInfo) -> memoryview:
    """Check an allocator's host buffer and return a flat writable view."""
    view = host_view(buffer)
    if view.readonly:
        raise TransportError(f"allocator returned a read-only buffer for frame {info.index}")
    if view.nbytes != info.nbytes:
        raise TransportError(
            f"allocator returned {view.nbytes} bytes for frame {info.index} of {info.nbytes}"
        )
    return view


#: The largest first frame kept from a refused message (``LimitExceededError.head``).
HEAD_MAX = 64 * 1024


def refused_head(sizes: Sequence[int], limits: Limits) -> int | None:
    """The size of a refused message's first frame if it is to be kept."""
    if sizes and sizes[0] <= HEAD_MAX and sizes[0] <= limits.max_frame_bytes:
        return sizes[0]
    return None


def check_frame_count(nframes: int, limits: Limits) -> None:
    """Refuse a message announced with more frames than ``limits`` allow.

    Raises:
        LimitExceededError: too many frames.
    """
    if nframes > limits.max_frames:
        raise LimitExceededError(
            f"message of {nframes} frames exceeds the limit of {limits.max_frames}"
        )


def check_limits(sizes: Sequence[int], limits: Limits) -> None:
    """Refuse an announced message that exceeds ``limits``, before allocating.

    Raises:
        LimitExceededError: too many frames, a frame or the message too large.
    """
    check_frame_count(len(sizes), limits)
    total = 0
    for size in sizes:
        if size > limits.max_frame_bytes:
            raise LimitExceededError(
                f"frame of {size} bytes exceeds the limit of {limits.max_frame_bytes}"
            )
        total += size
    if total > limits.max_message_bytes:
        raise LimitExceededError(
            f"message of {total} bytes exceeds the limit of {limits.max_message_bytes}"
        )


def call_consumer(callback: Callable[[Any], None], arg: Any, what: str,
                  peer: str) -> TransportError | None:
    """Call a consumer's ``callback`` (a message receiver, a refusal
    handler) with ``arg``. What it raises is logged and returned as the
    error that ends the connection (``what`` names the callback)."""
    try:
        callback(arg)
    except Exception as exc:
        return consumer_failed(exc, what, peer)
    return None


def consumer_failed(exc: Exception, what: str, peer: str) -> TransportError:
    """Log what a consumer's callback raised; the error that ends the
    connection (see ``call_consumer``, for callers that inline its call)."""
    logger.exception("%s of %s failed", what, peer, exc_info=exc)
    error = TransportError(f"{what} failed: {exc!r}")
    error.__cause__ = exc
    return error


def start_eagerly(coro: Coroutine[Any, None, None]) -> asyncio.Future[None] | None:
    """Run ``coro`` now up to its first suspension; None if it finished.

    Otherwise a task takes it from there, and its future is returned (what
    Python 3.12's eager tasks do). Cancelling that future reaches ``coro``
    wherever it waits, even before the task's first step. Only for the
    transports' own coroutines: until the task exists,
    ``asyncio.current_task()`` inside ``coro`` is the caller's task. An
    exception raised before the first suspension is raised here.
    """
    try:
        yielded = coro.send(None)
    except StopIteration:
        return None
    return asyncio.get_running_loop().create_task(_Resumed(coro, yielded))


_STARTED: Any = object()


class _Resumed(Coroutine[Any, Any, None]):
    """A coroutine that goes on with ``coro``, which already yielded ``first``.

    A task drives it as it drives any coroutine. Its first ``send`` hands the
    task what ``coro`` yielded; a ``throw`` (a cancel) always goes into
    ``coro``, also when it comes before that first step: a wrapping
    coroutine that had not started would end there and leave ``coro``
    suspended forever, waiting in a lock's queue, for instance.
    """

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, None, None], first: Any) -> None:
        self._coro = coro
        self._first = first

    def send(self, value: Any) -> Any:
        first = self._first
        if first is not _STARTED:
            self._first = _STARTED
            return first
        return self._coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        self._first = _STARTED
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, Any, None]:
        sent: Any = None
        error: BaseException | None = None
        while True:
            try:
                yielded = self.send(sent) if error is None else self.throw(error)
            except StopIteration:
                return
            sent, error = None, None
            try:
                sent = yield yielded
            except BaseException as exc:  # thrown in by whoever awaits: a cancel
                error = exc


class RecvQueue:
    """The messages a connection received and the ``recv()`` calls waiting.

    A transport allocates the next message with the first waiter's allocator
    (``bind`` that waiter), so the message goes to that waiter; one whose
    waiter gave up, or that needed no allocation, goes to the next waiter or
    waits in ``ready``.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.waiters: deque[tuple[asyncio.Future[list[Any]], Allocator | None]] = deque()
        self.ready: deque[list[Any]] = deque()
        self._bound: asyncio.Future[list[Any]] | None = None

    async def wait(self, allocator: Allocator | None, kick: Callable[[], None]) -> list[Any]:
        """Wait for the next message; ``kick`` tells the transport someone waits."""
        waiter: asyncio.Future[list[Any]] = self._loop.create_future()
        entry = (waiter, allocator)
        self.waiters.append(entry)
        kick()
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                # The message was ours already when the cancel landed: keep it
                # for the next recv() instead of dropping it.
                self.ready.appendleft(waiter.result())
            raise
        finally:
            if not waiter.done() or waiter.cancelled():
                with contextlib.suppress(ValueError):
                    self.waiters.remove(entry)

    def bind(self, waiter: asyncio.Future[list[Any]]) -> None:
        """The message now being received was allocated for ``waiter``."""
        self._bound = waiter

    def deliver(self, message: list[Any]) -> None:
        bound, self._bound = self._bound, None
        if bound is not None and not bound.done():
            for entry in self.waiters:
                if entry[0] is bound:
                    self.waiters.remove(entry)
                    break
            bound.set_result(message)
            return
        while self.waiters:
            waiter, _ = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(message)
                return
        self.ready.append(message)

    def fail(self, error: BaseException) -> None:
        """Fail every waiting ``recv()`` with ``error``."""
        bound, self._bound = self._bound, None
        while self.waiters:
            waiter, _ = self.waiters.popleft()
            if not waiter.done():
                waiter.set_exception(error)
        if bound is not None and not bound.done():
            bound.set_exception(error)


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


class Admission:
    """A listener's count of open and not yet handshaken connections,
    against ``TransportConfig.max_connections`` and
    ``max_pending_connections``. A refusal is logged as a warning that names
    the cap, at most once a second (a flood of refusals is one line a
    second, with their count)."""

    def __init__(self, config: TransportConfig, address: str) -> None:
        self._max_open = config.max_connections
        self._max_pending = config.max_pending_connections
        self._address = address
        self.open = 0
        self.pending = 0
        self._refused = 0
        self._logged_at = -math.inf

    def admit(self, peer: str) -> bool:
        """Count a new connection in; False: refuse it (close it at once)."""
        if self.open >= self._max_open:
            reason = (f"{self.open} connections are open "
                      f"(TransportConfig.max_connections={self._max_open})")
        elif self.pending >= self._max_pending:
            reason = (f"{self.pending} connections have not finished their handshake "
                      f"(TransportConfig.max_pending_connections={self._max_pending})")
        else:
            self.open += 1
            self.pending += 1
            return True
        self._refused += 1
        now = time.monotonic()
        if now - self._logged_at >= 1.0:
            logger.warning("refusing a connection from %s on %s: %s (%d refused since the "
                           "last such line)", peer, self._address, reason, self._refused)
            self._logged_at, self._refused = now, 0
        return False

    def handshaken(self) -> None:
        """An admitted connection finished (or failed) its handshake."""
        self.pending -= 1

    def closed(self) -> None:
        """An admitted connection ended."""
        self.open -= 1


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
