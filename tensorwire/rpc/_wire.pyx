# cython: language_level=3
"""The RPC messages with a fixed binary header, compiled: REQUEST, RESPONSE
and ITEM (docs/protocol.md, "RPC messages"), parsed from frames and encoded
into them, and their message classes. They run once per call or stream
item; every other kind is rare and stays msgpack, in ``protocol``, which
keeps its message classes (dataclasses) and exports these.

The header fields are read and written byte by byte, little endian, which a
C compiler turns into single loads and stores on a little-endian machine and
which stays right on any other.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyObject_GetBuffer, PyBuffer_Release
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.math cimport isfinite, signbit
from libc.stdint cimport int32_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy

from ..serde._decoder cimport Decoder
from ..serde._encoder cimport Encoder

from ..errors import ProtocolError
from ._kinds import Kind

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object text, Py_ssize_t* size) except NULL

# The layout of docs/protocol.md: REQUEST is kind, flags, method length,
# stream_arg, call_id, timeout (24 bytes), then the method name and the serde
# header; RESPONSE and ITEM are kind, 7 reserved zero bytes, call_id (16
# bytes), then the serde header.
cdef enum:
    REQUEST_SIZE = 24
    REPLY_SIZE = 16
    KIND_REQUEST = 10
    KIND_RESPONSE = 11
    KIND_ITEM = 14
    HAS_TIMEOUT = 1
    COPY_MAX = 4096

REQUEST = KIND_REQUEST
RESPONSE = KIND_RESPONSE
ITEM = KIND_ITEM
#: A bytes or bytearray frame up to this size gives its value header as a
#: bytes copy (copying a small header costs less than a memoryview, or a
#: bytearray slice, and the decoder reads bytes without a buffer request);
#: larger frames, and frames of any other type, as a zero-copy memoryview.
SLICE_MAX = COPY_MAX
#: A REQUEST's timeout is below this many seconds (about 31 years).
MAX_TIMEOUT = 10.0 ** 9
cdef double _MAX_TIMEOUT = MAX_TIMEOUT
cdef uint64_t _CALL_ID_END = 1ULL << 63


# --- frames held in plain bytes ------------------------------------------------

cdef inline bint _plain(object raw, const uint8_t** data, Py_ssize_t* size) noexcept:
    """Point ``data`` and ``size`` at the bytes of ``raw`` if it is a
    ``bytes`` or ``bytearray`` (what the transports deliver a small frame
    as, and what the encoders make: no buffer request for it); False for
    any other type."""
    if type(raw) is bytearray:
        data[0] = <const uint8_t*>PyByteArray_AS_STRING(raw)
        size[0] = PyByteArray_GET_SIZE(raw)
        return True
    if type(raw) is bytes:
        data[0] = <const uint8_t*>PyBytes_AS_STRING(raw)
        size[0] = PyBytes_GET_SIZE(raw)
        return True
    return False


# --- the messages -------------------------------------------------------------

cdef class ValueMessage:
    """A message that carries a value: its call id and the value's frames
    (its serde header, then its buffers). Compiled classes, not dataclasses
    as the other kinds (``protocol``): their fields are C fields, which the
    RPC core reads and fills in without a Python attribute lookup; they are
    registered as ``protocol.Message`` subclasses.

    A parsed message decodes its value from the frames it came in, its
    serde header read where it lies (``decode_value``): the header is
    copied out, and the list of the value's frames made, only when
    ``value`` is asked for."""

    # Its fields are declared in _wire.pxd: call_id, _value, _received,
    # _start.

    #: The names of its fields, in the order of its constructor's arguments.
    _names = ("call_id", "value")

    def __init__(self, call_id, value):
        self.call_id = call_id
        self.value = value

    @property
    def value(self):
        """The value's frames: its serde header, then its buffers."""
        if self._value is None and self._received is not None:
            raw = self._received[0]
            self._value = _value(self._received, _tail(raw, self._start))
        return self._value

    @value.setter
    def value(self, value):
        self._value = value
        self._received = None

    @property
    def payload(self):
        return self.value

    cdef object decode_value(self, Decoder decoder):
        """The value, decoded by ``decoder`` (its ``decode_frames``).

        Raises:
            DecodeError: as ``Decoder.decode_frames``.
        """
        cdef list received = self._received
        if received is None or len(received) != 1:
            return decoder.decode_frames(self.value)
        cdef const uint8_t* data
        cdef Py_ssize_t size
        # A one-frame message, as the transports deliver a small one: its
        # header is decoded in place.
        if _plain(received[0], &data, &size):
            return decoder._decode(data + self._start, size - self._start, ())
        return decoder.decode_frames(self.value)

    cdef tuple _fields(self):
        return (self.call_id, self.value)

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return self._fields() == (<ValueMessage>other)._fields()

    def __repr__(self):
        shown = ", ".join(f"{name}={field!r}" for name, field in zip(self._names, self._fields()))
        return f"{type(self).__name__}({shown})"


cdef class Request(ValueMessage):
    """REQUEST: a call of ``method``, its arguments' frames as ``value``."""

    # Its fields are declared in _wire.pxd: method, timeout, stream_arg.

    kind = Kind.REQUEST
    fields = ("method", "timeout", "stream_arg")
    _names = ("call_id", "method", "timeout", "stream_arg", "value")

    def __init__(self, call_id, str method, timeout, int stream_arg, value):
        self.call_id = call_id
        self.method = method
        self.timeout = timeout
        self.stream_arg = stream_arg
        self.value = value

    cdef tuple _fields(self):
        return (self.call_id, self.method, self.timeout, self.stream_arg, self.value)


cdef class Response(ValueMessage):
    """RESPONSE: a unary call's result, its frames as ``value``."""

    kind = Kind.RESPONSE
    fields = ()


cdef class Item(ValueMessage):
    """ITEM: one item of a stream, its frames as ``value``."""

    kind = Kind.ITEM
    fields = ()


# --- little-endian fields ------------------------------------------------------

cdef inline uint16_t _u16(const uint8_t* p) noexcept:
    return <uint16_t>p[0] | (<uint16_t>p[1] << 8)


cdef inline uint32_t _u32(const uint8_t* p) noexcept:
    return <uint32_t>_u16(p) | (<uint32_t>_u16(p + 2) << 16)


cdef inline uint64_t _u64(const uint8_t* p) noexcept:
    return <uint64_t>_u32(p) | (<uint64_t>_u32(p + 4) << 32)


cdef inline void _put_u16(uint8_t* p, uint16_t value) noexcept:
    p[0] = value & 0xFF
    p[1] = value >> 8


# The low half of a value by a C cast, not a mask: a literal as wide as
# 0xFFFFFFFF is a Python int to Cython, and the masking then boxes the value.
cdef inline void _put_u32(uint8_t* p, uint32_t value) noexcept:
    _put_u16(p, <uint16_t>value)
    _put_u16(p + 2, <uint16_t>(value >> 16))


cdef inline void _put_u64(uint8_t* p, uint64_t value) noexcept:
    _put_u32(p, <uint32_t>value)
    _put_u32(p + 4, <uint32_t>(value >> 32))


cdef inline double _f64(const uint8_t* p) noexcept:
    cdef uint64_t bits = _u64(p)
    cdef double value
    memcpy(&value, &bits, 8)
    return value


cdef inline void _put_f64(uint8_t* p, double value) noexcept:
    cdef uint64_t bits
    memcpy(&bits, &value, 8)
    _put_u64(p, bits)


# --- parsing -------------------------------------------------------------------

cdef inline object _kind_name(int kind):
    return {KIND_REQUEST: "REQUEST", KIND_RESPONSE: "RESPONSE", KIND_ITEM: "ITEM"}[kind]


cdef object _tail(object raw, Py_ssize_t start):
    """The frame ``raw`` from ``start`` on: the value's serde header."""
    cdef const uint8_t* data
    cdef Py_ssize_t size
    if _plain(raw, &data, &size) and size <= COPY_MAX:
        return PyBytes_FromStringAndSize(<const char*>data + start, size - start)
    view = memoryview(raw)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view[start:]


cdef list _value(object frames, object head):
    """The value's frames: its serde header, then frames 1 and up."""
    cdef list value = [head]
    if len(frames) > 1:
        value.extend(frames[1:])
    return value


cdef inline void _keep_received(ValueMessage message, object frames, Py_ssize_t start) except *:
    """``message`` takes its value from ``frames`` (see ``ValueMessage``),
    its serde header from ``start`` in the first."""
    message._received = frames if type(frames) is list else list(frames)
    message._start = start


cdef object _parse_reply(int kind, const uint8_t* data, Py_ssize_t size, object frames):
    if size <= REPLY_SIZE:
        raise ProtocolError(f"{_kind_name(kind)} without its value")
    if _u64(data) != <uint64_t>kind:
        raise ProtocolError(f"nonzero reserved bytes in a {_kind_name(kind)} header")
    cdef uint64_t call_id = _u64(data + 8)
    if call_id >= _CALL_ID_END:
        raise ProtocolError(f"bad call id {call_id}")
    # Made by the types' allocators, without their __init__ (no arguments
    # to parse).
    cdef ValueMessage message = (Response.__new__(Response) if kind == KIND_RESPONSE
                                 else Item.__new__(Item))
    message.call_id = call_id
    _keep_received(message, frames, REPLY_SIZE)
    return message


#: The method name of the last REQUEST parsed: the next one that names the
#: same method gets this str again instead of a fresh one, so that looking
#: the method up (the server's table of methods) finds its hash computed and
#: the key itself, without comparing the text.
cdef str _last_method = ""


cdef str _method_of(const char* name, Py_ssize_t size):
    """The method name of a REQUEST: the UTF-8 ``name`` of ``size`` bytes.

    Raises:
        ProtocolError: it is not UTF-8.
    """
    global _last_method
    cdef Py_ssize_t last_size
    cdef const char* last = PyUnicode_AsUTF8AndSize(_last_method, &last_size)
    if last_size == size and memcmp(last, name, size) == 0:
        return _last_method
    try:
        method = PyUnicode_DecodeUTF8(name, size, NULL)
    except UnicodeDecodeError:
        raise ProtocolError("REQUEST method name is not UTF-8") from None
    _last_method = method
    return method


cdef object _parse_request(const uint8_t* data, Py_ssize_t size, object frames):
    if size < REQUEST_SIZE:
        raise ProtocolError(f"REQUEST header of {size} bytes is cut short")
    cdef uint8_t flags = data[1]
    cdef Py_ssize_t start = REQUEST_SIZE + _u16(data + 2)
    cdef int32_t stream_arg = <int32_t>_u32(data + 4)
    cdef uint64_t call_id = _u64(data + 8)
    cdef double timeout = _f64(data + 16)
    if flags & ~HAS_TIMEOUT:
        raise ProtocolError(f"unknown REQUEST flags {flags:#x}")
    if stream_arg < -1:
        raise ProtocolError(f"bad REQUEST stream_arg {stream_arg}")
    if flags:
        # NaN would corrupt the server's timer heap; negative or infinite
        # deadlines have no meaning.
        if not (isfinite(timeout) and 0 <= timeout < _MAX_TIMEOUT):
            raise ProtocolError(f"REQUEST timeout must be finite and >= 0, got {timeout!r}")
    elif timeout != 0 or signbit(timeout):
        raise ProtocolError("REQUEST without a timeout must carry 0.0 there")
    if size <= start:
        raise ProtocolError("REQUEST without its value")
    method = _method_of(<const char*>data + REQUEST_SIZE, start - REQUEST_SIZE)
    if call_id == 0 or call_id >= _CALL_ID_END:
        # 0 is the connection's own (HELLO, PING, ...), never a call's.
        raise ProtocolError(f"bad call id {call_id} for a REQUEST (0 is reserved)")
    cdef Request message = Request.__new__(Request)
    message.call_id = call_id
    message.method = method
    message.timeout = timeout if flags else None
    message.stream_arg = stream_arg
    _keep_received(message, frames, start)
    return message


cpdef object parse_binary(object frames):
    """REQUEST, RESPONSE or ITEM from ``frames`` (a non-empty sequence), or
    ``None`` when frame 0 starts with any other byte (a msgpack header).

    Raises:
        ProtocolError: a binary header cut short, with nonzero reserved
            bits, bad fields, or no value.
    """
    raw = frames[0]
    cdef Py_buffer buffer
    cdef const uint8_t* data
    cdef Py_ssize_t size
    cdef bint release = False
    cdef int kind
    if not _plain(raw, &data, &size):
        PyObject_GetBuffer(raw, &buffer, PyBUF_SIMPLE)
        data = <const uint8_t*>buffer.buf
        size = buffer.len
        release = True
    try:
        if size == 0:
            return None
        kind = data[0]
        if kind == KIND_RESPONSE or kind == KIND_ITEM:
            return _parse_reply(kind, data, size, frames)
        if kind == KIND_REQUEST:
            return _parse_request(data, size, frames)
        return None
    finally:
        if release:
            PyBuffer_Release(&buffer)


# --- encoding ------------------------------------------------------------------

cdef inline object _frame0(uint8_t* prefix, Py_ssize_t prefix_size, const char* name,
                           Py_ssize_t name_size, object header):
    """One bytes object: the fixed header, the method name, the serde header."""
    cdef const char* head_data
    cdef Py_ssize_t head_size
    if type(header) is not bytes:
        header = bytes(header)
    head_data = PyBytes_AS_STRING(header)
    head_size = PyBytes_GET_SIZE(header)
    out = PyBytes_FromStringAndSize(NULL, prefix_size + name_size + head_size)
    cdef char* p = PyBytes_AS_STRING(out)
    memcpy(p, prefix, prefix_size)
    if name_size:
        memcpy(p + prefix_size, name, name_size)
    memcpy(p + prefix_size + name_size, head_data, head_size)
    return out


cdef inline list _frames(object first, list value):
    cdef list frames = [first]
    if len(value) > 1:
        frames.extend(value[1:])
    return frames


cdef inline void _request_header(uint8_t* prefix, uint64_t call_id, Py_ssize_t name_size,
                                 object timeout, int stream_arg) except *:
    """Write a REQUEST's fixed header (REQUEST_SIZE bytes) at ``prefix``."""
    prefix[0] = KIND_REQUEST
    prefix[1] = 0 if timeout is None else HAS_TIMEOUT
    _put_u16(prefix + 2, <uint16_t>name_size)
    _put_u32(prefix + 4, <uint32_t>stream_arg)
    _put_u64(prefix + 8, call_id)
    _put_f64(prefix + 16, 0.0 if timeout is None else <double>timeout)


cdef inline const char* _method_name(str method, Py_ssize_t* size) except NULL:
    """The UTF-8 of a REQUEST's method name, its length at ``size``.

    Raises:
        ProtocolError: a method name longer than 65535 bytes.
    """
    cdef const char* name = PyUnicode_AsUTF8AndSize(method, size)
    if size[0] > 0xFFFF:
        raise ProtocolError(f"method name of {size[0]} bytes exceeds 65535")
    return name


cdef list encode_request_value(uint64_t call_id, str method, object timeout, int stream_arg,
                               tuple args, dict kwargs, Encoder encoder):
    """The frames of a REQUEST of the arguments ``args`` and ``kwargs``
    (its value ``[list(args), kwargs]``, not yet encoded: ``encoder`` writes
    its serde header straight after the request's, in one bytes object; the
    client's hot path).

    Raises:
        ProtocolError: a method name longer than 65535 bytes.
        EncodeError: the arguments cannot be encoded.
    """
    cdef Py_ssize_t length
    cdef const char* name = _method_name(method, &length)
    cdef uint8_t small[256]
    cdef uint8_t* head = small
    if REQUEST_SIZE + length > 256:
        head = <uint8_t*>PyMem_Malloc(REQUEST_SIZE + length)
        if head == NULL:
            raise MemoryError()
    try:
        _request_header(head, call_id, length, timeout, stream_arg)
        memcpy(head + REQUEST_SIZE, name, length)
        return encoder.encode_arguments_after(head, REQUEST_SIZE + length, args, kwargs)
    finally:
        if head != small:
            PyMem_Free(head)


cdef list encode_reply_value(int kind, uint64_t call_id, object value, Encoder encoder):
    """The frames of a RESPONSE or ITEM (``kind``) of ``value`` (not yet
    encoded: see ``encode_request_value``; the server's hot path).

    Raises:
        EncodeError: ``value`` cannot be encoded.
    """
    cdef uint8_t prefix[REPLY_SIZE]
    _put_u64(prefix, <uint64_t>kind)
    _put_u64(prefix + 8, call_id)
    return encoder.encode_frames_after(prefix, REPLY_SIZE, value)


cpdef list encode_request(uint64_t call_id, str method, object timeout, int stream_arg,
                          list value):
    """The frames of ``Request(call_id, method, timeout, stream_arg, value)``,
    without making the message (the client's hot path).

    Raises:
        ProtocolError: a method name longer than 65535 bytes.
    """
    cdef Py_ssize_t length
    cdef const char* name = _method_name(method, &length)
    cdef uint8_t prefix[REQUEST_SIZE]
    _request_header(prefix, call_id, length, timeout, stream_arg)
    return _frames(_frame0(prefix, REQUEST_SIZE, name, length, value[0]), value)


cpdef list encode_reply(int kind, uint64_t call_id, list value):
    """The frames of a RESPONSE or ITEM (``kind``) without making the message."""
    cdef uint8_t prefix[REPLY_SIZE]
    _put_u64(prefix, <uint64_t>kind)
    _put_u64(prefix + 8, call_id)
    return _frames(_frame0(prefix, REPLY_SIZE, NULL, 0, value[0]), value)


cpdef list encode_response(uint64_t call_id, list value):
    """The frames of ``Response(call_id, value)``, without making the
    message (the server's hot path)."""
    return encode_reply(KIND_RESPONSE, call_id, value)
