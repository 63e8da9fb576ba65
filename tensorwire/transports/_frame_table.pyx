"""The frame table, sans-IO: the prelude and the table of frame sizes and
device codes that precede every message, on tcp:// and ucx:// alike.

One codec for both transports (docs/protocol.md, "Message" and "ucx://"):

    prelude   8 bytes    u8 kind | u8 reserved = 0 | u16 reserved = 0 | u32 nframes
    table     8*n bytes  u64 frame size, one per frame
              n bytes    u8 code per frame: the device (0 host, 1 CUDA); on
                         ucx:// the device is bits 0-1, bits 2-6 give a
                         separate host frame's address at the sender
                         modulo 64, halved (``OFFSET_SHIFT``), and bit 7
                         marks a frame inline in the header
              pad        zero bytes up to a multiple of 8

A byte stream then carries the frames' bytes (``_stream_framing.FrameReader``
reads them); ucx:// carries the inline frames after the table in the same
UCX message and every other frame as a UCX message of its own.

Compiled (issue 22): the stream reader parses a table per message it
receives, through the C-level functions that ``_frame_table.pxd`` declares.
"""

import struct

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.string cimport memcpy, memset

from ..errors import ProtocolError

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
#: word's one value, so a single comparison checks all four fields.
ONE_FRAME_WORDS = struct.Struct("<QQQ")
ONE_DATA_PRELUDE = KIND_DATA | 1 << 32
assert ONE_FRAME_WORDS.size == ONE_FRAME_SIZE == ONE_FRAME_HEADER_SIZE
assert ONE_DATA_PRELUDE == ONE_DATA_PRELUDE_WORD

DEVICE_CODES = {"cpu": 0, "cuda": 1}
_DEVICE_NAMES = ("cpu", "cuda")
#: ucx:// only: bit 7 of a code byte marks a host frame whose bytes follow
#: the table inside the header message.
INLINE_FLAG = 0x80
#: ucx:// only: the device is the code byte's bits 0-1, and bits 2-6 hold a
#: separate host frame's address at the sender modulo 64, divided by two
#: (``(code & OFFSET_MASK) >> OFFSET_SHIFT << 1``): the receiver puts the
#: frame at the same offset (``FrameInfo.offset``).
DEVICE_MASK = 0x03
OFFSET_SHIFT = 2
OFFSET_MASK = 0x7C


cpdef Py_ssize_t table_size(Py_ssize_t nframes):
    """Bytes of the table of ``nframes`` frames: sizes, codes, padding."""
    return 8 * nframes + (nframes + 7) // 8 * 8


def encode_table(sizes, codes=None):
    """The prelude and frame table of a data message (``codes`` None: all
    frames in host memory)."""
    cdef Py_ssize_t n = len(sizes), i
    cdef Py_ssize_t size = 8 + table_size(n)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, size)
    cdef unsigned char* p = <unsigned char*>PyBytes_AS_STRING(out)
    cdef const unsigned char[::1] code_bytes
    memset(p, 0, size)
    p[0] = KIND_DATA
    p[4] = n & 0xFF
    p[5] = (n >> 8) & 0xFF
    p[6] = (n >> 16) & 0xFF
    p[7] = (n >> 24) & 0xFF
    for i in range(n):
        store_u64le(p + 8 + 8 * i, sizes[i])
    if codes is not None and n:
        code_bytes = bytes(codes)
        if code_bytes.shape[0] != n:
            raise ValueError(f"{code_bytes.shape[0]} device codes for {n} frames")
        memcpy(p + 8 + 8 * n, &code_bytes[0], n)
    return out


cdef inline tuple _sizes(const unsigned char* p, Py_ssize_t n):
    return tuple([load_u64le(p + 8 * i) for i in range(n)])


cpdef tuple decode_sizes(const unsigned char[::1] table, Py_ssize_t nframes,
                         Py_ssize_t offset):
    """``decode_table`` on a buffer the caller has typed already."""
    cdef Py_ssize_t n = nframes, i
    cdef Py_ssize_t end = offset + table_size(n)
    if offset < 0 or table.shape[0] < end:
        raise ProtocolError(f"frame table of {n} frames cut short")
    cdef const unsigned char* p = &table[offset] if end > offset else NULL
    cdef tuple sizes = _sizes(p, n)
    cdef bytes codes = PyBytes_FromStringAndSize(<const char*>p + 8 * n, n) if n else b""
    cdef bint nonzero = False
    for i in range(8 * n + n, end - offset):
        nonzero = nonzero or p[i] != 0
    if nonzero:
        raise ProtocolError("nonzero padding in frame table")
    return sizes, codes


def decode_table(table, nframes, offset=0):
    """The frame sizes and the ``nframes`` code bytes of the table at ``offset``.

    Raises:
        ProtocolError: a nonzero padding byte, or a table cut short.
    """
    return decode_sizes(memoryview(table).cast("B"), nframes, offset)


cpdef str device_name(int code, Py_ssize_t index):
    """The device of frame ``index`` from its code (without ``INLINE_FLAG``).

    Raises:
        ProtocolError: an unknown device code.
    """
    if code < 0 or code >= len(_DEVICE_NAMES):
        raise ProtocolError(f"unknown device code {code} for frame {index}")
    return _DEVICE_NAMES[code]
