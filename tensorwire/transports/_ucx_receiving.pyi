import asyncio
from collections.abc import Callable
from typing import Any

from ..errors import LimitExceededError, TensorwireError
from ._delivery import RecvQueue
from ._frames import Allocator
from ._ucx_messages import Announced
from ._ucx_runtime import Runtime
from .config import TransportConfig

class Receiving:
    """The receive side of a ucx:// connection."""

    _loop: asyncio.AbstractEventLoop
    _rt: Runtime | None
    _ep: Any
    _config: TransportConfig
    _allocator: Allocator
    _queue: RecvQueue
    _tag_header_in: Any
    _tag_frame_in: Any
    _peer_address: str
    _header_buf: bytearray
    _header_view: memoryview
    _header_array: Any
    _receiver: Callable[[list[Any]], None] | None
    _on_refused: Callable[[LimitExceededError], None] | None
    _fast_max: int
    _small_as_bytearray: bool
    _held: bool
    _pumping: bool
    _busy: bool
    _announced: Announced | None
    _frames: list[Any]
    _frames_bytes: int
    _frames_left: int
    _received: int
    _peer_sent: int | None
    _error: TensorwireError | None
    _last_activity: float | None

    def _pump(self) -> None: ...
    def _post_recv(self, rt: Runtime, array: Any, tag: Any) -> Any: ...
    def _on_header(self, request: Any) -> None: ...
    def _on_frame(self, request: Any) -> None: ...
