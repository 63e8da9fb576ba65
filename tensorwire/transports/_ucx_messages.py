"""The ucx:// message header, sans-IO: the frame table (``_frame_table``)
with small host frames inline after it.

A code byte's ``INLINE_FLAG`` marks a host frame whose bytes follow the
table inside the header message (at most ``INLINE_BYTES`` in all); every
other non-empty frame travels as a UCX message of its own (see ucx.py,
"Framing", and docs/protocol.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import ProtocolError
from ._frame_table import (
    DEVICE_CODES,
    INLINE_FLAG,
    KIND_DATA,
    ONE_FRAME,
    PRELUDE,
    PRELUDE_SIZE,
    decode_table,
    device_name,
    encode_table,
    table_size,
)
from ._frames import FrameInfo, device_nbytes, host_view, is_device_frame
from ._limit_checks import check_frame_count, check_limits
from .config import Limits

__all__ = ("INLINE_BYTES", "ONE_INLINE", "Announced", "Outgoing")

#: Host frames up to this many bytes in all travel inside the header message:
#: one UCX message instead of several costs less than the copy.
INLINE_BYTES = 4096
#: The header of a message of one inline host frame, up to its bytes: the
#: prelude (kind, reserved zeros, frame count), the size, the code byte
#: (INLINE_FLAG) with its zero padding.
ONE_INLINE = ONE_FRAME


class Outgoing:
    """One message prepared for sending: the header and the separate frames."""

    __slots__ = ("frames", "header", "nbytes")

    def __init__(self, frames: Sequence[Any]) -> None:
        if len(frames) == 1 and type(frames[0]) is bytes and 0 < len(frames[0]) <= INLINE_BYTES:
            # The RPC hot path: one small host frame, inline.
            frame = frames[0]
            self.header = ONE_INLINE.pack(KIND_DATA, 0, 0, 1, len(frame), INLINE_FLAG) + frame
            self.frames = []
            self.nbytes = len(frame)
            return
        sizes: list[int] = []
        codes = bytearray()
        inline: list[memoryview] = []
        separate: list[Any] = []
        inline_total = 0
        device = False
        for frame in frames:
            if is_device_frame(frame):
                nbytes = device_nbytes(frame)
                sizes.append(nbytes)
                codes.append(DEVICE_CODES["cuda"])
                device = True
                if nbytes:
                    separate.append(frame)
                continue
            view = host_view(frame)
            nbytes = view.nbytes
            sizes.append(nbytes)
            if nbytes and inline_total + nbytes <= INLINE_BYTES:
                codes.append(DEVICE_CODES["cpu"] | INLINE_FLAG)
                inline.append(view)
                inline_total += nbytes
            else:
                codes.append(DEVICE_CODES["cpu"])
                if nbytes:
                    separate.append(view)
        self.header = b"".join([encode_table(sizes, codes), *inline])
        self.frames = separate
        self.nbytes = sum(sizes)
        if device:
            from ._device import sync_current_streams

            sync_current_streams()


class Announced:
    """A received header: the frames to allocate and the inline bytes."""

    __slots__ = ("infos", "inline", "nbytes")

    def __init__(self, header: memoryview, limits: Limits, *, check: bool = True) -> None:
        if len(header) < PRELUDE_SIZE:
            raise ProtocolError("UCX message header too short")
        kind, reserved1, reserved2, n = PRELUDE.unpack_from(header)
        if kind != KIND_DATA or reserved1 or reserved2:
            raise ProtocolError(f"bad UCX message header (kind {kind})")
        check_frame_count(n, limits)
        table_end = PRELUDE_SIZE + table_size(n)
        if len(header) < table_end:
            raise ProtocolError("UCX message header shorter than its frame table")
        sizes, codes = decode_table(header, n, PRELUDE_SIZE)
        if check:
            check_limits(sizes, limits)
        infos: list[FrameInfo] = []
        inline: dict[int, memoryview] = {}
        offset = table_end
        for index, (size, code) in enumerate(zip(sizes, codes, strict=True)):
            device = device_name(code & ~INLINE_FLAG, index)
            if code & INLINE_FLAG:
                if device != "cpu" or offset + size > len(header):
                    raise ProtocolError(f"bad inline frame {index}")
                inline[index] = header[offset : offset + size]
                offset += size
            infos.append(FrameInfo(index, size, device))
        self.infos = infos
        self.inline = inline
        self.nbytes = sum(sizes)
