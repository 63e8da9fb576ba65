"""A ucx:// connection: sending and receiving messages over its UCX
endpoint, following its tcp:// control channel, and ending.

How the connection is made, tagged, framed and ended is told in ucx.py's
docstring; the listener and the handshake are there too.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import (
    ConnectionClosedError,
    LimitExceededError,
    ProtocolError,
    TensorwireError,
    TransportError,
)
from ._base import Connection
from ._delivery import READ_BUDGET_MESSAGES, RecvQueue, call_consumer, consumer_failed
from ._frame_table import PRELUDE_SIZE, table_size
from ._frames import (
    Allocator,
    FrameInfo,
    default_allocator,
    device_nbytes,
    writable_view,
)
from ._ucx_messages import INLINE_BYTES, Announced, one_inline_frame
from ._ucx_runtime import Runtime, translate, ucx_error_name
from ._ucx_sending import post_messages
from ._ucx_skipping import RefusedSkipping
from .config import TransportConfig

__all__ = ("UCXConnection", "to_ucx_url")

logger = logging.getLogger(__name__)

BYE = b"bye"
_COUNT = struct.Struct("<Q")
TAG_HEADER = 0
TAG_FRAME = 1


def to_ucx_url(url: str) -> str:
    """The ucx:// URL of a control channel's tcp:// address."""
    return "ucx://" + url.partition("://")[2]


def _retrieve(future: asyncio.Future[None]) -> None:
    """Mark a send's outcome as seen when nobody waits for it any more."""
    if not future.cancelled():
        future.exception()


async def _await_posted(sending: asyncio.Future[None]) -> None:
    """Wait for posted sends; a cancelled wait leaves them to complete."""
    try:
        await asyncio.shield(sending)
    except asyncio.CancelledError:
        sending.add_done_callback(_retrieve)
        raise


def _check_device_buffer(rt: Runtime, buffer: Any, info: FrameInfo) -> None:
    if not hasattr(buffer, "__cuda_array_interface__"):
        raise TransportError(f"allocator returned no CUDA buffer for frame {info.index}")
    nbytes = device_nbytes(buffer)
    if nbytes != info.nbytes:
        raise TransportError(
            f"allocator returned {nbytes} bytes for frame {info.index} of {info.nbytes}"
        )
    if not rt.cuda_support:
        raise TransportError("a CUDA frame arrived but this UCX has no CUDA support")


class UCXConnection(RefusedSkipping, Connection):
    """A ucx:// connection: UCX endpoint for data, tcp:// for control."""

    scheme = "ucx"

    def __init__(
        self,
        runtime: Runtime,
        control: Connection,
        config: TransportConfig,
        allocator: Allocator | None,
        recv_id: int,
        send_id: int,
        peer_worker: bytes,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._rt: Runtime | None = runtime
        self._control = control
        self._config = config
        self._allocator = allocator or default_allocator
        self._local_address = to_ucx_url(control.local_address)
        self._peer_address = to_ucx_url(control.peer_address)
        self._recv_id = recv_id
        api = runtime.api
        self._tag_header_out = runtime.Tag(send_id << 32 | TAG_HEADER)
        self._tag_frame_out = runtime.Tag(send_id << 32 | TAG_FRAME)
        self._tag_header_in = runtime.Tag(recv_id << 32 | TAG_HEADER)
        self._tag_frame_in = runtime.Tag(recv_id << 32 | TAG_FRAME)
        try:
            address = api.UCXAddress.create_from_buffer(peer_worker)
            self._ep: Any = api.UCXEndpoint.create_from_worker_address(
                runtime.worker, address, False
            )
        except Exception as exc:
            raise translate(
                runtime, exc, f"cannot reach UCX worker of {self._peer_address}"
            ) from exc
        runtime.kick()
        capacity = PRELUDE_SIZE + table_size(config.limits.max_frames) + INLINE_BYTES
        self._header_buf = bytearray(capacity)
        self._header_view = memoryview(self._header_buf)
        # One wrapper for every header receive (UCX writes into the buffer).
        self._header_array = runtime.Array(self._header_buf)
        self._queue = RecvQueue(self._loop)
        # Set by deliver_to(): messages go there instead of to recv().
        self._receiver: Callable[[list[Any]], None] | None = None
        self._pumping = False
        # Set by pause_reading(): no receive is posted.
        self._held = False
        self._frames_bytes = 0
        # Under deliver_to with the default allocator: the largest one-frame
        # inline message taken by the fast path (0: none).
        self._fast_max = 0
        self._small_as_bytearray = False
        # Set by refuse_oversized(); the message being skipped, its head.
        self._on_refused: Callable[[LimitExceededError], None] | None = None
        self._skipping: LimitExceededError | None = None
        self._skip_head: bytearray | None = None
        self._announced: Announced | None = None
        # Receiving: a header or a message's frames are in flight.
        self._busy = False
        self._frames: list[Any] = []
        self._frames_left = 0
        self._received = 0
        self._sent = 0
        # Messages the peer said it sent before its goodbye.
        self._peer_sent: int | None = None
        self._error: TensorwireError | None = None
        self._closing = False
        self._last_activity: float | None = None
        self._watcher = self._loop.create_task(self._watch_control())

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

    async def send(self, frames: Sequence[Any]) -> None:
        if self.closed:
            raise self._closed_error()
        sending = post_messages(self, (frames,))
        if sending is not None:
            await _await_posted(sending)

    async def send_many(self, messages: Sequence[Sequence[Any]]) -> None:
        if self.closed:
            raise self._closed_error()
        sending = post_messages(self, messages)
        if sending is not None:
            await _await_posted(sending)

    def send_nowait(self, messages: Sequence[Sequence[Any]]) -> asyncio.Future[None] | None:
        if self.closed:
            raise self._closed_error()
        return post_messages(self, messages)

    def deliver_to(self, receiver: Callable[[list[Any]], None], *,
                   small_as_bytearray: bool = False) -> bool:
        self._receiver = receiver
        if self._allocator is default_allocator:
            limits = self._config.limits
            self._fast_max = min(limits.max_frame_bytes, limits.max_message_bytes, INLINE_BYTES)
            self._small_as_bytearray = small_as_bytearray
        ready = self._queue.ready
        while ready and self._error is None:
            self._hand_over(receiver, ready.popleft())
        self._pump()
        return True

    def pause_reading(self) -> bool:
        self._held = True
        return True

    def resume_reading(self) -> None:
        if self._held:
            self._held = False
            self._pump()

    async def recv(self, *, allocator: Allocator | None = None) -> list[Any]:
        queue = self._queue
        if queue.ready:
            return queue.ready.popleft()
        if self._error is not None:
            raise self._closed_error()
        return await queue.wait(allocator, self._pump)

    async def close(self) -> None:
        if self.closed:
            self.abort()
            return
        self._closing = True
        try:
            async with asyncio.timeout(self._config.close_timeout):
                # Every message sent so far is posted to UCX already.
                if self._error is None:
                    await self._control.send([BYE, _COUNT.pack(self._sent)])
                # Keep our endpoint (and what UCX still has to deliver) until
                # the peer has taken every message and hangs up.
                await asyncio.shield(self._watcher)
        except (TimeoutError, TensorwireError, OSError) as exc:
            logger.debug("polite close of %s cut short: %s", self, exc)
        finally:
            self._fail(ConnectionClosedError(f"connection to {self._peer_address} was closed"))

    def abort(self) -> None:
        self._fail(ConnectionClosedError(f"connection to {self._peer_address} was aborted"))

    # -- sending ---------------------------------------------------------------

    # -- receiving -------------------------------------------------------------

    def _pump(self) -> None:
        """Post the next UCX receives while someone takes messages.

        A receive that UCX completes at once (the message was already
        there, the common case under load) is handled here in the loop,
        without a round through the runtime's progress.
        """
        if self._pumping:
            return  # re-entered from a delivery: the loop below goes on
        self._pumping = True
        budget = READ_BUDGET_MESSAGES
        try:
            while self._error is None and not self._busy:
                rt = self._rt
                if rt is None:
                    return
                wanted = (self._receiver is not None or self._queue.waiters) and not self._held
                if self._announced is not None:
                    if not wanted:
                        return
                    self._allocate(rt, self._announced)
                    continue
                if not wanted:
                    return
                if self._peer_sent is not None and self._received >= self._peer_sent:
                    self._peer_done()
                    return
                request = self._post_recv(rt, self._header_array, self._tag_header_in)
                if request is None:
                    return
                if request.completed:
                    self._header_arrived(request)
                    budget -= 1
                    if budget == 0:
                        # Fairness: a peer whose messages are always there
                        # already must not keep the loop from everyone else
                        # (a consumer's inline work counts, it runs here).
                        self._loop.call_soon(self._pump)
                        return
                else:
                    self._busy = True
                    rt.watch(request, self._header_array, self._on_header)
        finally:
            self._pumping = False

    def _post_recv(self, rt: Runtime, array: Any, tag: Any) -> Any:
        try:
            return self._ep.tag_recv(array, tag, rt.TagMaskFull)
        except Exception as exc:
            self._fail(translate(rt, exc, f"receive from {self._peer_address} failed"))
            return None

    def _on_header(self, request: Any) -> None:
        self._busy = False
        if self._error is not None or request is None:
            return
        self._header_arrived(request)
        self._pump()

    def _header_arrived(self, request: Any) -> None:
        self._last_activity = self._loop.time()
        try:
            request.check_error()
        except Exception as exc:
            if ucx_error_name(exc) == "UCXMessageTruncatedError":
                limits = self._config.limits
                self._refuse(
                    LimitExceededError(
                        f"message header from {self._peer_address} exceeds "
                        f"{len(self._header_buf)} bytes (limit of {limits.max_frames} frames)"
                    )
                )
            else:
                self._fail(translate(self._rt, exc, f"receive from {self._peer_address} failed"))
            return
        if self._fast_max:
            # The RPC hot path (deliver_to with the default allocator): one
            # small inline host frame, checked and copied out here.
            frame = one_inline_frame(self._header_buf, self._fast_max, self._small_as_bytearray)
            if frame is not None:
                self._frames = [frame]
                self._frames_bytes = len(frame)
                self._finish_message()
                return
        try:
            self._announced = Announced(self._header_view, self._config.limits)
        except LimitExceededError as exc:
            if self._on_refused is None or not self._skip(exc):
                self._refuse(exc)
        except TensorwireError as exc:
            self._refuse(exc)

    def refuse_oversized(self, on_refused: Callable[[LimitExceededError], None]) -> bool:
        self._on_refused = on_refused
        return True

    def _refuse(self, exc: TensorwireError) -> None:
        logger.warning("dropping connection from %s: %s", self._peer_address, exc)
        self._fail(exc)

    def _allocate(self, rt: Runtime, announced: Announced) -> None:
        if self._receiver is not None:
            waiter: asyncio.Future[list[Any]] | None = None
            alloc = self._allocator
        else:
            waiter, allocator = self._queue.waiters[0]
            alloc = allocator or self._allocator
        frames: list[Any] = []
        targets: list[Any] = []
        try:
            for info in announced.infos:
                buffer = alloc(info)
                frames.append(buffer)
                if info.device == "cpu":
                    view = writable_view(buffer, info)
                    inline = announced.inline.get(info.index)
                    if inline is not None:
                        view[:] = inline
                    elif info.nbytes:
                        targets.append(view)
                else:
                    _check_device_buffer(rt, buffer, info)
                    if info.nbytes:
                        targets.append(buffer)
        except TensorwireError as exc:
            self._fail(exc)
            return
        except Exception as exc:
            error = TransportError(f"receive allocator failed: {exc!r}")
            error.__cause__ = exc
            self._fail(error)
            return
        self._announced = None
        self._frames = frames
        self._frames_bytes = announced.nbytes
        if waiter is not None:
            self._queue.bind(waiter)
        left = 0
        Array = rt.Array
        for target in targets:
            array = Array(target)
            request = self._post_recv(rt, array, self._tag_frame_in)
            if request is None:
                return
            if request.completed:
                try:
                    request.check_error()
                except Exception as exc:
                    self._fail(
                        translate(rt, exc, f"receive from {self._peer_address} failed")
                    )
                    return
            else:
                left += 1
                rt.watch(request, array, self._on_frame)
        if left:
            self._busy = True
            self._frames_left = left
        else:
            if targets:
                self._last_activity = self._loop.time()
            self._finish_message()

    def _on_frame(self, request: Any) -> None:
        if self._error is not None or request is None:
            return
        try:
            request.check_error()
        except Exception as exc:
            self._fail(translate(self._rt, exc, f"receive from {self._peer_address} failed"))
            return
        self._last_activity = self._loop.time()
        self._frames_left -= 1
        if self._frames_left == 0:
            self._busy = False
            self._finish_message()
            self._pump()

    def _finish_message(self) -> None:
        message, self._frames = self._frames, []
        self._received += 1
        self.messages_received += 1
        self.bytes_received += self._frames_bytes
        receiver = self._receiver
        if receiver is None:
            self._queue.deliver(message)
        else:
            try:  # call_consumer, inlined: this runs for every message
                receiver(message)
            except Exception as exc:
                self._fail(consumer_failed(exc, "message receiver", self._peer_address))
        if self._peer_sent is not None and self._received >= self._peer_sent:
            self._peer_done()

    def _hand_over(self, receiver: Callable[[list[Any]], None], message: list[Any]) -> None:
        error = call_consumer(receiver, message, "message receiver", self._peer_address)
        if error is not None:
            self._fail(error)

    # -- control channel and ending -------------------------------------------

    async def _watch_control(self) -> None:
        """Follow the control channel: a goodbye, or the peer's end."""
        try:
            while True:
                message = await self._control.recv()
                if len(message) == 2 and bytes(message[0]) == BYE:
                    (count,) = _COUNT.unpack(bytes(message[1]))
                    self._peer_sent = count
                    if self._received >= count:
                        self._peer_done()
                    else:
                        # What UCX still has to deliver goes to recv() first.
                        self._pump()
                else:
                    self._refuse(ProtocolError("unexpected message on the UCX control channel"))
                    return
        except ConnectionClosedError:
            pass
        except Exception as exc:
            logger.debug("control channel of %s failed: %s", self, exc)
        if self._peer_sent is None or self._received < self._peer_sent:
            self._fail(
                ConnectionClosedError(f"connection closed by the peer {self._peer_address}")
                if self._peer_sent is None
                else ConnectionClosedError(
                    f"connection to {self._peer_address} broke before its last messages"
                )
            )

    def _peer_done(self) -> None:
        self._fail(ConnectionClosedError(f"connection closed by the peer {self._peer_address}"))

    def _fail(self, error: TensorwireError) -> None:
        """Tear down UCX and control, fail everything waiting; the first error sticks."""
        if self._error is not None:
            return
        self._error = error
        self._control.abort()
        rt, self._rt = self._rt, None
        if rt is not None:
            # Closing the endpoint cancels its posted receives; their buffers
            # stay referenced by the runtime until UCX lets go of them.
            try:
                self._ep.close_blocking(period=0, max_attempts=1)
            except Exception as exc:
                logger.debug("closing UCX endpoint of %s: %s", self, exc)
            self._ep = None
            rt.free_id(self._recv_id)
            rt.kick()
            rt.release()
        self._queue.fail(error)

    def _closed_error(self) -> TensorwireError:
        error = self._error
        if error is None:
            return ConnectionClosedError(f"connection to {self._peer_address} is closing")
        if isinstance(error, ConnectionClosedError):
            return error
        closed = ConnectionClosedError(f"connection to {self._peer_address} failed: {error}")
        closed.__cause__ = error
        return closed
