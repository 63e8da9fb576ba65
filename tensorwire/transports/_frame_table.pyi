import struct
from typing import Any

from ._frames import Device

__all__ = (
    "DEVICE_CODES",
    "DEVICE_MASK",
    "INLINE_FLAG",
    "KIND_DATA",
    "KIND_GOODBYE",
    "ONE_DATA_PRELUDE",
    "ONE_FRAME",
    "ONE_FRAME_SIZE",
    "ONE_FRAME_WORDS",
    "OFFSET_MASK",
    "OFFSET_SHIFT",
    "PRELUDE",
    "PRELUDE_SIZE",
    "decode_table",
    "device_name",
    "encode_table",
    "table_size",
)

KIND_DATA: int
KIND_GOODBYE: int
PRELUDE: struct.Struct
PRELUDE_SIZE: int
ONE_FRAME: struct.Struct
ONE_FRAME_SIZE: int
ONE_FRAME_WORDS: struct.Struct
ONE_DATA_PRELUDE: int
DEVICE_CODES: dict[str, int]
INLINE_FLAG: int
DEVICE_MASK: int
OFFSET_SHIFT: int
OFFSET_MASK: int

def table_size(nframes: int) -> int: ...
def encode_table(sizes: Any, codes: bytes | bytearray | None = None) -> bytes: ...
def decode_sizes(table: Any, nframes: int, offset: int) -> tuple[tuple[int, ...], bytes]: ...
def decode_table(table: Any, nframes: int, offset: int = 0) -> tuple[tuple[int, ...], bytes]: ...
def device_name(code: int, index: int) -> Device: ...
