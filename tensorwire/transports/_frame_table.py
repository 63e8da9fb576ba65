"""The frame table, sans-IO: the prelude and the table of frame sizes and
device codes that precede every message, on tcp:// and ucx:// alike.

One codec for both transports (docs/protocol.md, "Message" and "ucx://"):

    prelude   8 bytes    u8 kind | u8 reserved = 0 | u16 reserved = 0 | u32 nframes
    table     8*n bytes  u64 frame size, one per frame
              n bytes    u8 code per frame: the device (0 host, 1 CUDA); on
                         ucx:// bit 7 marks a frame inline in the header
              pad        zero bytes up to a multiple of 8

A byte stream then carries the frames' bytes (``_stream_framing.FrameReader``
reads them); ucx:// carries the inline frames after the table in the same
UCX message and every other frame as a UCX message of its own.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from typing import Any

from ..errors import ProtocolError
from ._frames import Device

__all__ = (
    "DEVICE_CODES",
    "INLINE_FLAG",
    "KIND_DATA",
    "KIND_GOODBYE",
    "ONE_DATA_PRELUDE",
    "ONE_FRAME",
    "ONE_FRAME_SIZE",
    "ONE_FRAME_WORDS",
    "PRELUDE",
    "PRELUDE_SIZE",
    "decode_table",
    "device_name",
    "encode_table",
    "sizes_struct",
    "table_size",
)

KIND_DATA = 0
KIND_GOODBYE = 1
#: kind, two reserved fields that must be zero, frame count.
PRELUDE = struct.Struct("<BBHI")
PRELUDE_SIZE = PRELUDE.size
#: A one-frame message's prelude and frame table in one: kind, the
#: reserved fields, frame count, frame size, code byte with its padding.
ONE_FRAME = struct.Struct("<BBHIQQ")
ONE_FRAME_SIZE = ONE_FRAME.size
#: The same as three words: a one-frame data message's prelude is the first
#: word's one value, so a single comparison checks all four fields, and
#: packing takes three values (the stream driver packs a batch with it
#: directly).
ONE_FRAME_WORDS = struct.Struct("<QQQ")
ONE_DATA_PRELUDE = KIND_DATA | 1 << 32
assert ONE_FRAME_WORDS.size == ONE_FRAME_SIZE

DEVICE_CODES = {"cpu": 0, "cuda": 1}
_DEVICE_NAMES: tuple[Device, ...] = ("cpu", "cuda")
#: ucx:// only: bit 7 of a code byte marks a host frame whose bytes follow
#: the table inside the header message.
INLINE_FLAG = 0x80


def table_size(nframes: int) -> int:
    """Bytes of the table of ``nframes`` frames: sizes, codes, padding."""
    return 8 * nframes + (nframes + 7) // 8 * 8


@functools.lru_cache(maxsize=256)
def sizes_struct(nframes: int) -> struct.Struct:
    """The layout of ``nframes`` frame sizes (cached: one per frame count)."""
    return struct.Struct(f"<{nframes}Q")


def encode_table(sizes: Sequence[int], codes: bytes | bytearray | None = None) -> bytes:
    """The prelude and frame table of a data message (``codes`` None: all
    frames in host memory)."""
    n = len(sizes)
    tail = bytes(n + -n % 8) if codes is None else bytes(codes) + bytes(-n % 8)
    return PRELUDE.pack(KIND_DATA, 0, 0, n) + sizes_struct(n).pack(*sizes) + tail


def decode_table(table: Any, nframes: int, offset: int = 0) -> tuple[tuple[int, ...], bytes]:
    """The frame sizes and the ``nframes`` code bytes of the table at ``offset``.

    Raises:
        ProtocolError: a nonzero padding byte.
    """
    n = nframes
    sizes = sizes_struct(n).unpack_from(table, offset)
    codes = bytes(table[offset + 8 * n : offset + table_size(n)])
    if codes.count(0) != len(codes) and any(codes[n:]):
        raise ProtocolError("nonzero padding in frame table")
    return sizes, codes[:n]


def device_name(code: int, index: int) -> Device:
    """The device of frame ``index`` from its code (without ``INLINE_FLAG``).

    Raises:
        ProtocolError: an unknown device code.
    """
    if code >= len(_DEVICE_NAMES):
        raise ProtocolError(f"unknown device code {code} for frame {index}")
    return _DEVICE_NAMES[code]
