from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import LimitExceededError
from ._frames import FrameInfo
from .config import Limits

__all__ = (
    "GOODBYE",
    "HANDSHAKE",
    "PROTOCOL_VERSION",
    "FrameReader",
    "Goodbye",
    "check_handshake",
    "pack_header",
)

PROTOCOL_VERSION: int
MAGIC: bytes
HANDSHAKE: bytes
GOODBYE: bytes
STAGING_SIZE: int
DIRECT_MIN: int
SLAB_MAX: int

def check_handshake(data: bytes | bytearray | memoryview) -> None: ...
def pack_header(sizes: Sequence[int], devices: Sequence[str] | None = None) -> bytes: ...
def pack_one_frame(nbytes: int) -> bytes: ...

class Goodbye: ...

class Refused:
    error: LimitExceededError
    def __init__(self, error: LimitExceededError) -> None: ...

class FrameReader:
    limits: Limits
    events: deque[list[Any] | Goodbye | Refused]
    skip_oversized: bool
    auto_allocate: bool
    small_as_bytearray: bool
    staged_bytes: int
    paused: bool
    def __init__(self, limits: Limits, *, handshake: bool = True) -> None: ...
    @property
    def frames_announced(self) -> list[FrameInfo] | None: ...
    @property
    def message_buffered(self) -> bool: ...
    @property
    def awaiting_handshake(self) -> bool: ...
    @property
    def mid_message(self) -> bool: ...
    def release(self) -> None: ...
    def hand_out(self, receiver: Callable[[list[Any]], object], budget: int) -> int: ...
    def get_buffer(self) -> memoryview: ...
    def buffer_updated(self, nbytes: int) -> None: ...
    def allocate(self, allocator: Any) -> None: ...
