import struct
from collections.abc import Sequence
from typing import Any

from ._frames import FrameInfo
from .config import Limits

INLINE_BYTES: int
ONE_INLINE: struct.Struct

class Outgoing:
    """One message prepared for sending: the header, the separate frames,
    and whether any frame is in device memory."""

    @property
    def header(self) -> bytes: ...
    @property
    def frames(self) -> list[Any]: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def device(self) -> bool: ...
    def __init__(self, frames: Sequence[Any]) -> None: ...

def one_inline_frame(header: bytearray, fast_max: int, as_bytearray: bool) -> Any: ...

class Announced:
    """A received header: the frames to allocate and the inline bytes."""

    @property
    def infos(self) -> list[FrameInfo]: ...
    @property
    def inline(self) -> dict[int, memoryview]: ...
    @property
    def nbytes(self) -> int: ...
    def __init__(self, header: memoryview, limits: Limits, *, check: bool = True) -> None: ...
