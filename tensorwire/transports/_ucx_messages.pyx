"""The ucx:// message header, sans-IO and compiled: the frame table
(``_frame_table``) with small host frames inline after it.

A code byte's ``INLINE_FLAG`` marks a host frame whose bytes follow the
table inside the header message (at most ``INLINE_BYTES`` in all); every
other non-empty frame travels as a UCX message of its own (see ucx.py,
"Framing", and docs/protocol.md).

Every message sent builds an :class:`Outgoing` and every message received
is parsed here (:func:`one_inline_frame` for the RPC's one small frame,
else :class:`Announced`), which is why this module is compiled (issue 22).
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_CheckBuffer, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize, PyByteArray_GET_SIZE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.memoryview cimport PyMemoryView_GET_BUFFER
from libc.stdint cimport uint8_t, uint64_t, uintptr_t
from libc.string cimport memcpy, memset

from ..errors import ProtocolError
from ._frame_table import (
    DEVICE_CODES,
    DEVICE_MASK,
    INLINE_FLAG,
    KIND_DATA,
    OFFSET_MASK,
    OFFSET_SHIFT,
    ONE_DATA_PRELUDE,
    ONE_FRAME,
    PRELUDE,
    PRELUDE_SIZE,
    decode_table,
    device_name,
    encode_table,
    table_size,
)
from ._frames import ALIGNMENT, FrameInfo, host_empty, host_view, interface_nbytes
from ._limit_checks import check_frame_count, check_limits

__all__ = ("INLINE_BYTES", "ONE_INLINE", "Announced", "Outgoing", "one_inline_frame")

#: Host frames up to this many bytes in all travel inside the header message:
#: one UCX message instead of several costs less than the copy.
INLINE_BYTES = 4096
#: The header of a message of one inline host frame, up to its bytes: the
#: prelude (kind, reserved zeros, frame count), the size, the code byte
#: (INLINE_FLAG) with its zero padding.
ONE_INLINE = ONE_FRAME

# The same layout for C: 8 bytes of prelude, the u64 size, the code byte
# and 7 bytes of padding.
DEF _ONE_SIZE = 24
cdef Py_ssize_t _INLINE_BYTES = INLINE_BYTES
cdef int _CPU = DEVICE_CODES["cpu"]
cdef int _CUDA = DEVICE_CODES["cuda"]
cdef int _INLINE = INLINE_FLAG
cdef int _DEVICE_MASK = DEVICE_MASK
cdef int _OFFSET_SHIFT = OFFSET_SHIFT
cdef int _OFFSET_MASK = OFFSET_MASK
cdef uintptr_t _ALIGNMENT = ALIGNMENT
assert (OFFSET_MASK >> OFFSET_SHIFT) + 1 == ALIGNMENT // 2
cdef int _KIND_DATA = KIND_DATA
cdef uint64_t _ONE_DATA_PRELUDE = ONE_DATA_PRELUDE
assert ONE_FRAME.size == _ONE_SIZE


cdef inline uint64_t _load_u64(const uint8_t* p) noexcept:
    """A little-endian u64 (the wire order) on any host."""
    cdef uint64_t value = 0
    cdef int i
    for i in range(7, -1, -1):
        value = value << 8 | p[i]
    return value


cdef inline void _store_u64(uint8_t* p, uint64_t value) noexcept:
    cdef int i
    for i in range(8):
        p[i] = value & 0xFF
        value >>= 8


cdef object _cuda_interface(object frame):
    """``frame.__cuda_array_interface__`` if it is a device frame, else None.

    Read once per frame: the size comes from it, and with CuPy each read
    of the property costs (a CUDA call on some setups)."""
    if PyObject_CheckBuffer(frame):
        return None
    return getattr(frame, "__cuda_array_interface__", None)


cdef class Outgoing:
    """One message prepared for sending: the header, the separate frames,
    and whether any frame is in device memory (the sender then
    synchronizes the caller's streams once, before posting)."""

    def __init__(self, frames):
        cdef Py_ssize_t n
        cdef uint8_t* p
        if len(frames) == 1 and type(frames[0]) is bytes:
            frame = <bytes>frames[0]
            n = PyBytes_GET_SIZE(frame)
            if 0 < n <= _INLINE_BYTES:
                # The RPC hot path: one small host frame, inline.
                self.header = PyBytes_FromStringAndSize(NULL, _ONE_SIZE + n)
                p = <uint8_t*>PyBytes_AS_STRING(self.header)
                memset(p, 0, _ONE_SIZE)
                p[0] = _KIND_DATA
                p[4] = 1  # one frame (u32 little-endian)
                _store_u64(p + 8, n)
                p[16] = _INLINE
                memcpy(p + _ONE_SIZE, PyBytes_AS_STRING(frame), n)
                self.frames = []
                self.nbytes = n
                self.device = False
                return
        self._build(frames)

    cdef _build(self, frames):
        cdef list sizes = []
        cdef bytearray codes = bytearray()
        cdef list inline = []
        cdef list separate = []
        cdef Py_ssize_t inline_total = 0, total = 0, nbytes
        cdef bint device = False
        for frame in frames:
            cai = _cuda_interface(frame)
            if cai is not None:
                nbytes = interface_nbytes(cai)
                sizes.append(nbytes)
                codes.append(_CUDA)
                device = True
                if nbytes:
                    separate.append(frame)
                total += nbytes
                continue
            view = host_view(frame)
            nbytes = view.nbytes
            sizes.append(nbytes)
            total += nbytes
            if nbytes and inline_total + nbytes <= _INLINE_BYTES:
                codes.append(_CPU | _INLINE)
                inline.append(view)
                inline_total += nbytes
            elif nbytes:
                # Where the frame starts past a 64-byte boundary, for the
                # receiver to match (FrameInfo.offset).
                codes.append(_CPU | _offset_code(view))
                separate.append(view)
            else:
                codes.append(_CPU)
        self.header = b"".join([encode_table(sizes, codes), *inline])
        self.frames = separate
        self.nbytes = total
        self.device = device


cdef inline int _offset_code(object view):
    """The code bits that give the address of ``view`` (a memoryview)
    modulo ALIGNMENT, halved."""
    cdef uintptr_t address = <uintptr_t>PyMemoryView_GET_BUFFER(view).buf
    return <int>((address % _ALIGNMENT) >> 1 << _OFFSET_SHIFT)


def one_inline_frame(bytearray header, Py_ssize_t fast_max, bint as_bytearray):
    """The frame of a received header that carries exactly one inline host
    frame of at most ``fast_max`` bytes (the RPC's common message), copied
    out of ``header``; None for any other message (``Announced`` parses
    it, and reports what is wrong with it).

    The frame is a bytearray when ``as_bytearray``, else an aligned NumPy
    array (``host_empty``)."""
    cdef const uint8_t* p = <const uint8_t*>PyByteArray_AS_STRING(header)
    cdef uint64_t size
    cdef Py_buffer target
    if PyByteArray_GET_SIZE(header) < _ONE_SIZE:
        return None
    # The prelude of one data frame, and the code byte INLINE_FLAG with
    # zero padding.
    if _load_u64(p) != _ONE_DATA_PRELUDE or _load_u64(p + 16) != <uint64_t>_INLINE:
        return None
    size = _load_u64(p + 8)
    if size > <uint64_t>fast_max or <Py_ssize_t>size > PyByteArray_GET_SIZE(header) - _ONE_SIZE:
        return None
    if as_bytearray:
        return PyByteArray_FromStringAndSize(<const char*>p + _ONE_SIZE, <Py_ssize_t>size)
    frame = host_empty(<Py_ssize_t>size)
    PyObject_GetBuffer(frame, &target, PyBUF_SIMPLE)
    try:
        memcpy(target.buf, p + _ONE_SIZE, <size_t>size)
    finally:
        PyBuffer_Release(&target)
    return frame


cdef class Announced:
    """A received header: the frames to allocate and the inline bytes."""

    # nbytes is an object: a peer's u64 sizes, unchecked when skipping.

    def __init__(self, header, limits, *, bint check=True):
        cdef Py_ssize_t n, table_end, index
        cdef int code, host_offset
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
        cdef list infos = []
        cdef dict inline = {}
        offset = table_end
        total = 0
        for index in range(n):
            size = sizes[index]
            code = codes[index]
            device = device_name(code & _DEVICE_MASK, index)
            host_offset = (code & _OFFSET_MASK) >> _OFFSET_SHIFT << 1
            if host_offset and (device != "cpu" or code & _INLINE):
                raise ProtocolError(f"bad frame {index}: an offset for a frame sent inline "
                                    f"or in device memory")
            if code & _INLINE:
                if device != "cpu" or offset + size > len(header):
                    raise ProtocolError(f"bad inline frame {index}")
                inline[index] = header[offset : offset + size]
                offset += size
            infos.append(FrameInfo(index, size, device, host_offset))
            total += size
        self.infos = infos
        self.inline = inline
        self.nbytes = total
