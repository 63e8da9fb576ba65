"""A ucx:// connection: sending and receiving messages over its UCX
endpoint, following its tcp:// control channel, and ending.

The per-message work is compiled: posting sends in ``_ucx_sending``,
receiving in ``_ucx_receiving`` (``Receiving``, this class's first base,
holds the receive state).

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
)
from ._base import Connection
from ._delivery import RecvQueue, call_consumer
from ._frame_table import PRELUDE_SIZE, table_size
from ._frames import Allocator, default_allocator
from ._ucx_messages import INLINE_BYTES
from ._ucx_receiving import Receiving
from ._ucx_runtime import Runtime, translate
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


class UCXConnection(Receiving, RefusedSkipping, Connection):
    """A ucx:// connection: UCX endpoint for data, tcp:// for control."""

    scheme = "ucx"
    # Each message's header moves last_activity as it arrives
    # (Receiving._header_arrived).
    stamps_messages = True

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
        self._rt = runtime
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
            self._ep = api.UCXEndpoint.create_from_worker_address(
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
        self._header_array = runtime.Array(self._header_buf)
        self._queue = RecvQueue(self._loop)
        # The rest of the receive state is Receiving's (its defaults: no
        # receiver, not held, nothing received).
        self._frames = []
        self._frames_bytes = 0
        # The message being skipped, its head (see _ucx_skipping).
        self._skipping: LimitExceededError | None = None
        self._skip_head: bytearray | None = None
        self._sent = 0
        self._closing = False
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

    def refuse_oversized(self, on_refused: Callable[[LimitExceededError], None]) -> bool:
        self._on_refused = on_refused
        return True

    def _refuse(self, exc: TensorwireError) -> None:
        logger.warning("dropping connection from %s: %s", self._peer_address, exc)
        self._fail(exc)

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
