import asyncio
import socket
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import TensorwireError
from ._delivery import RecvQueue
from ._frames import Allocator
from ._spin_gate import SpinGate
from ._stream_framing import FrameReader

__all__ = ("LIVENESS_QUANTUM", "READ_AHEAD_MESSAGES", "StreamCore")

LIVENESS_QUANTUM: int
READ_AHEAD_MESSAGES: int

class StreamCore:
    """The per-message part of a stream connection."""

    _loop: asyncio.AbstractEventLoop
    _peer_address: str
    _reader: FrameReader
    _queue: RecvQueue
    _allocator: Allocator
    _handshake: asyncio.Future[None]
    _receiver: Callable[[list[Any]], None] | None
    _error: TensorwireError | None
    _closing: bool
    _last_activity: float | None
    _unseen_bytes: int
    _read_ahead: bool
    _budget: int
    _yielded: bool
    _send_lock: asyncio.Lock
    _tail: asyncio.Task[None] | None
    _sock: socket.socket | None
    _fd: int
    _spin_gate: SpinGate | None
    _spinning: bool
    _spin_wanted: bool
    spin_polls: int
    messages_sent: int
    messages_received: int
    bytes_sent: int
    bytes_received: int
    device_bytes_staged: int
    @property
    def closed(self) -> bool: ...
    def _on_readable(self) -> None: ...
    def _poll(self) -> None: ...
    def _after_read(self) -> bool: ...
    def _note_progress(self, nbytes: int) -> None: ...
    def _go_on(self) -> None: ...
    def _pump(self) -> bool: ...
    def send_nowait(self, messages: Sequence[Sequence[Any]]) -> asyncio.Future[None] | None: ...
    def _count_out(self, messages: int, nbytes: int) -> None: ...
    def _may_write_now(self) -> bool: ...
    def _write_at_once(self, buffers: list[Any]) -> asyncio.Task[None] | None: ...
