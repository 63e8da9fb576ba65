# cython: language_level=3
"""Decoder: (header, buffers) -> Python values.

The decoder reads the msgpack body itself, with a pointer that walks the
header: every length is checked against the bytes that are left before
anything is read or allocated, so nothing in a header can make it read past
the end or allocate more than the header's own size, and nesting is counted
as it is read. Ext values are rebuilt as they are met, each size checked
against the buffers given. It reads what msgpack-python's ``unpackb(raw=False,
strict_map_key=False)`` reads, except that every ext code this format does
not define (msgpack's timestamp, -1, among them) is refused.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import numpy as np

from cpython.buffer cimport PyBUF_FORMAT, PyBUF_ND, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.long cimport PyLong_FromLongLong, PyLong_FromUnsignedLongLong
from cpython.object cimport PyObject
from cpython.pyport cimport PY_SSIZE_T_MAX
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy

from ..errors import DecodeError
from . import _buffers, _dtypes, _numpy
from ._format import (
    ARRAY_HEAD,
    ARRAY_HEAD_SIZE,
    BUFFER_REF,
    BYTES_INLINE,
    BYTES_OUT_OF_BAND,
    COMPLEX,
    DIMS,
    EXT_ARRAY,
    EXT_BIGINT,
    EXT_BYTEARRAY,
    EXT_BYTES,
    EXT_COMPLEX,
    EXT_MEMORYVIEW,
    EXT_REGISTERED,
    EXT_TUPLE,
    FLAG_BROADCAST,
    FLAG_FORTRAN,
    FLAG_INLINE,
    FLAGS_KNOWN,
    KIND_CUPY,
    KIND_NDARRAY,
    KIND_NPSCALAR,
    KIND_TORCH,
    MAX_NDIM,
    PREFIX,
    PREFIX_SIZE,
    U64,
    as_memoryview,
)
from ._limits import Limits
from ._registry import default_registry

cdef object _ndarray = np.ndarray
cdef object _frombuffer = np.frombuffer
cdef object _U8 = np.dtype(np.uint8)
cdef list _CODE_TO_DTYPE = _dtypes.CODE_TO_DTYPE
cdef bytes _PREFIX = PREFIX
cdef int _MAX_NDIM = MAX_NDIM
# The wire constants of _format, as C ints for the per-value code below.
cdef Py_ssize_t _PREFIX_SIZE = PREFIX_SIZE
cdef Py_ssize_t _ARRAY_HEAD_SIZE = ARRAY_HEAD_SIZE
cdef int _EXT_ARRAY = EXT_ARRAY
cdef int _EXT_TUPLE = EXT_TUPLE
cdef int _EXT_REGISTERED = EXT_REGISTERED
cdef int _KIND_NDARRAY = KIND_NDARRAY
cdef int _FLAG_INLINE = FLAG_INLINE


cdef inline uint64_t _be(const uint8_t* p, int width) noexcept:
    """A ``width``-byte big-endian unsigned int (msgpack's lengths and numbers)."""
    cdef uint64_t value = 0
    cdef int i
    for i in range(width):
        value = (value << 8) | p[i]
    return value


cdef inline uint64_t _le(const uint8_t* p, int width) noexcept:
    """A ``width``-byte little-endian unsigned int (the ARRAY descriptor's fields)."""
    cdef uint64_t value = 0
    cdef int i
    for i in range(width - 1, -1, -1):
        value = (value << 8) | p[i]
    return value


cdef inline const uint8_t* _take_bytes(_Reading* r, uint64_t n) except NULL:
    """The next ``n`` bytes of the header, checked to be there."""
    cdef const uint8_t* at = r.pos
    if n > <uint64_t>(r.end - at):
        raise DecodeError(f"malformed header: truncated ({n} bytes announced, "
                          f"{r.end - at} left)")
    r.pos = at + n
    return at


cdef class Decoder:
    """Reusable decoder: ``decode(header, buffers) -> obj``.

    Arrays are views of the given buffers, never copies: writable when the
    buffer is writable, read-only when it is not (``bytes``). A decoded view
    keeps its receive buffer alive for as long as it lives; copy the array to
    let the buffer go. Two documented copies: data inlined in the header
    (small by construction) is copied so that it is writable, and a buffer
    misaligned for its dtype is copied into an aligned allocation (buffers
    from the transports are always aligned). ``bytes`` and ``bytearray``
    values are copies; ``memoryview`` values are views.

    A Decoder is not thread-safe; use one per thread. The module-level
    :func:`decode` keeps one per thread for you.

    Args:
        registry: user types; default: the registry :func:`register` fills.
        limits: bounds on depth, header size, buffers and array size;
            broadcast (zero-stride) arrays are refused unless
            ``limits.broadcast``.
    """

    # Its fields are declared in _decoder.pxd.

    def __init__(self, *, registry=None, limits=None) -> None:
        self._registry = default_registry if registry is None else registry
        self._limits = Limits() if limits is None else limits
        self._max_depth = self._limits.max_depth
        self._max_header = self._limits.max_header_bytes
        self._max_buffers = self._limits.max_buffers
        self._max_elements = min(self._limits.max_array_elements, (1 << 63) - 1)

    @property
    def limits(self) -> Limits:
        """The limits this decoder enforces."""
        return self._limits

    def decode(self, header, buffers=()):
        """Decode a header and its buffers back into a value.

        Args:
            header: bytes, bytearray, memoryview or a 1-D uint8 NumPy array.
            buffers: the out-of-band buffers, in order: objects with the buffer
                protocol (uint8 arrays, bytes, bytearray, memoryview) or device
                buffers exposing ``__cuda_array_interface__``.

        Raises:
            DecodeError: anything wrong with the input, with what was wrong: bad
                magic or version, truncated or garbage msgpack, unknown ext
                code, dtype or registered name, a buffer index out of range or
                used twice, unused buffers, a shape whose byte size does not
                match its data, too many dims, depth or sizes beyond the
                limits, invalid UTF-8, unhashable dict keys.
        """
        return self._decode_header(header, buffers)

    cpdef object decode_frames(self, list frames):
        """``decode(frames[0], frames[1:])``: a message's frames as a
        transport delivers them. The RPC core decodes every call's
        arguments and result so, by a C call.

        Raises:
            DecodeError: as ``decode``, and for an empty list.
        """
        if not frames:
            raise DecodeError("no header: a message of no frames")
        # Without a list of no buffers: most messages are one frame.
        return self._decode_header(frames[0], frames[1:] if len(frames) > 1 else ())

    cdef object _decode_header(self, object header, object buffers):
        if type(header) is bytes:
            return self._decode(<const uint8_t*>PyBytes_AS_STRING(header),
                                PyBytes_GET_SIZE(header), buffers)
        cdef Py_buffer view
        try:
            # Held until the end: a bytearray cannot be resized meanwhile.
            PyObject_GetBuffer(header, &view, PyBUF_ND | PyBUF_FORMAT)
        except TypeError:
            raise DecodeError(
                f"header must support the buffer protocol, got {type(header).__qualname__}"
            ) from None
        except BufferError:
            raise DecodeError("header must be a contiguous 1-D buffer of bytes") from None
        try:
            if view.ndim != 1 or view.itemsize != 1:
                raise DecodeError("header must be a 1-D buffer of bytes")
            return self._decode(<const uint8_t*>view.buf, view.len, buffers)
        finally:
            PyBuffer_Release(&view)

    cdef object _decode(self, const uint8_t* data, Py_ssize_t size, object buffers):
        if size < _PREFIX_SIZE:
            raise DecodeError(
                f"header of {size} bytes is shorter than its {_PREFIX_SIZE}-byte prefix")
        if size > self._max_header:
            raise DecodeError(
                f"header of {size} bytes exceeds limits.max_header_bytes={self._max_header}")
        if memcmp(data, PyBytes_AS_STRING(_PREFIX), 4):
            if memcmp(data, PyBytes_AS_STRING(_PREFIX), 3):
                raise DecodeError(
                    f"not a tensorwire header (magic {PyBytes_FromStringAndSize(<char*>data, 3)!r})")
            raise DecodeError(
                f"unsupported header version {data[3]} (this decoder reads {_PREFIX[3]})")
        cdef Py_ssize_t nbufs = <Py_ssize_t>_le(data + 4, 4)
        cdef Py_ssize_t given = len(buffers)
        if nbufs != given:
            raise DecodeError(f"header announces {nbufs} buffers, {given} were given")
        if nbufs > self._max_buffers:
            raise DecodeError(f"{nbufs} buffers exceed limits.max_buffers={self._max_buffers}")
        cdef _Reading r
        r.pos = data + _PREFIX_SIZE
        r.end = data + size
        r.bufs = <PyObject*>buffers
        r.nbufs = nbufs
        r.taken = 0
        r.used = NULL
        cdef bytearray used
        if nbufs:
            used = bytearray(nbufs)
            r.used = <uint8_t*>PyByteArray_AS_STRING(used)
        try:
            value = self._read(&r, 0)
        except Exception as exc:  # NumPy and the C API raise assorted types; trust nothing
            raise _as_decode_error(exc) from None
        if r.pos != r.end:
            raise DecodeError("trailing bytes after the value in the header")
        if r.taken != nbufs:
            unused = [i for i in range(nbufs) if not r.used[i]]
            raise DecodeError(f"buffers {unused} are not referenced by the header")
        return value

    # -- msgpack ----------------------------------------------------------------

    cdef object _read(self, _Reading* r, Py_ssize_t depth):
        """One msgpack object; ``depth``: how many containers hold it."""
        cdef uint8_t m = _take_bytes(r, 1)[0]
        cdef const uint8_t* p
        cdef uint64_t n
        cdef uint32_t n32
        cdef double d
        cdef float f
        if m < 0x80:
            return <long>m
        if m >= 0xE0:
            return <long><int8_t>m
        if m < 0x90:
            return self._read_map(r, m & 0x0F, depth)
        if m < 0xA0:
            return self._read_array(r, m & 0x0F, depth, False)
        if m < 0xC0:
            return _read_str(r, m & 0x1F)
        if m == 0xC0:
            return None
        if m == 0xC2:
            return False
        if m == 0xC3:
            return True
        if 0xC4 <= m <= 0xC6:  # bin 8, 16, 32
            n = _be(_take_bytes(r, 1 << (m - 0xC4)), 1 << (m - 0xC4))
            p = _take_bytes(r, n)
            return PyBytes_FromStringAndSize(<const char*>p, n)
        if 0xC7 <= m <= 0xC9:  # ext 8, 16, 32
            n = _be(_take_bytes(r, 1 << (m - 0xC7)), 1 << (m - 0xC7))
            return self._read_ext(r, n, depth)
        if m == 0xCA:
            n32 = <uint32_t>_be(_take_bytes(r, 4), 4)
            memcpy(&f, &n32, 4)
            return <double>f
        if m == 0xCB:
            n = _be(_take_bytes(r, 8), 8)
            memcpy(&d, &n, 8)
            return d
        if 0xCC <= m <= 0xCF:  # uint 8, 16, 32, 64
            return PyLong_FromUnsignedLongLong(_be(_take_bytes(r, 1 << (m - 0xCC)),
                                                   1 << (m - 0xCC)))
        if m == 0xD0:
            return <long><int8_t>_take_bytes(r, 1)[0]
        if m == 0xD1:
            return <long><int16_t>_be(_take_bytes(r, 2), 2)
        if m == 0xD2:
            return <long><int32_t>_be(_take_bytes(r, 4), 4)
        if m == 0xD3:
            return PyLong_FromLongLong(<int64_t>_be(_take_bytes(r, 8), 8))
        if 0xD4 <= m <= 0xD8:  # fixext 1, 2, 4, 8, 16
            return self._read_ext(r, 1 << (m - 0xD4), depth)
        if 0xD9 <= m <= 0xDB:  # str 8, 16, 32
            return _read_str(r, _be(_take_bytes(r, 1 << (m - 0xD9)), 1 << (m - 0xD9)))
        if m == 0xDC or m == 0xDD:
            n = _be(_take_bytes(r, 2 if m == 0xDC else 4), 2 if m == 0xDC else 4)
            return self._read_array(r, n, depth, False)
        if m == 0xDE or m == 0xDF:
            n = _be(_take_bytes(r, 2 if m == 0xDE else 4), 2 if m == 0xDE else 4)
            return self._read_map(r, n, depth)
        raise DecodeError("malformed header: byte 0xc1 is not msgpack")

    cdef int _enter(self, Py_ssize_t depth) except -1:
        if depth > self._max_depth:
            raise DecodeError(f"value nests deeper than limits.max_depth={self._max_depth}")
        return 0

    cdef object _read_array(self, _Reading* r, uint64_t n, Py_ssize_t depth, bint as_tuple):
        """A list (or the items of a TUPLE) of ``n`` items."""
        self._enter(depth)
        if n > <uint64_t>(r.end - r.pos):  # every item is at least one byte
            raise DecodeError(f"malformed header: truncated (an array of {n} items, "
                              f"{r.end - r.pos} bytes left)")
        cdef Py_ssize_t i
        cdef object items = PyTuple_New(n) if as_tuple else PyList_New(n)
        for i in range(<Py_ssize_t>n):
            item = self._read(r, depth + 1)
            Py_INCREF(item)
            if as_tuple:
                PyTuple_SET_ITEM(items, i, item)
            else:
                PyList_SET_ITEM(items, i, item)
        return items

    cdef dict _read_map(self, _Reading* r, uint64_t n, Py_ssize_t depth):
        self._enter(depth)
        if n > <uint64_t>(r.end - r.pos) // 2:  # every entry is at least two bytes
            raise DecodeError(f"malformed header: truncated (a map of {n} entries, "
                              f"{r.end - r.pos} bytes left)")
        cdef dict out = {}
        cdef uint64_t i
        for i in range(n):
            key = self._read(r, depth + 1)
            out[key] = self._read(r, depth + 1)  # TypeError for an unhashable key
        return out

    cdef object _read_ext(self, _Reading* r, uint64_t n, Py_ssize_t depth):
        """An ext of ``n`` payload bytes (its type byte comes first)."""
        cdef int code = <int8_t>_take_bytes(r, 1)[0]
        cdef const uint8_t* payload = _take_bytes(r, n)
        cdef const uint8_t* end = r.end
        if code == _EXT_ARRAY:
            arr = self._array_fast(r, payload, n)
            if arr is not None:
                return arr
            return self._decode_array(r, PyBytes_FromStringAndSize(<const char*>payload, n))
        if code != _EXT_TUPLE and code != _EXT_REGISTERED:
            return self._ext_value(r, code, PyBytes_FromStringAndSize(<const char*>payload, n))
        # TUPLE and REGISTERED hold one msgpack object that fills the payload.
        r.pos = payload
        r.end = payload + n
        if code == _EXT_TUPLE:
            value = self._read_tuple(r, depth)
            what = "tuple"
        else:
            value = self._read_registered(r, depth)
            what = "registered value"
        if r.pos != r.end:
            raise DecodeError(f"malformed {what}: trailing bytes in its payload")
        r.end = end
        return value

    cdef tuple _read_tuple(self, _Reading* r, Py_ssize_t depth):
        cdef uint8_t m = r.pos[0] if r.pos < r.end else 0
        if 0x90 <= m <= 0x9F:
            r.pos += 1
            return self._read_array(r, m & 0x0F, depth, True)
        if m == 0xDC or m == 0xDD:
            r.pos += 1
            return self._read_array(
                r, _be(_take_bytes(r, 2 if m == 0xDC else 4), 2 if m == 0xDC else 4), depth, True)
        raise DecodeError("malformed tuple: payload is not a msgpack array")

    cdef object _read_registered(self, _Reading* r, Py_ssize_t depth):
        self._enter(depth)
        if r.pos >= r.end or r.pos[0] != 0x92:
            raise DecodeError("malformed registered value: expected [name, value]")
        r.pos += 1
        name = self._read(r, depth + 1)
        if type(name) is not str:
            raise DecodeError("malformed registered value: expected [name, value]")
        entry = self._registry.for_name(name)
        if entry is None:
            raise DecodeError(f"unknown registered type name {name!r}")
        inner = self._read(r, depth + 1)
        try:
            return entry.decode(inner)
        except DecodeError:
            raise
        except Exception as exc:
            raise DecodeError(
                f"decode function of registered type {name!r} raised {exc!r}") from exc

    # -- ext values -------------------------------------------------------------

    cdef object _take(self, _Reading* r, uint64_t ref):
        """The buffer ``ref`` names, marked as referenced."""
        if ref >= <uint64_t>r.nbufs:
            raise DecodeError(f"buffer index {ref} out of range: {r.nbufs} buffers given")
        if r.used[ref]:
            raise DecodeError(f"buffer {ref} is referenced twice")
        r.used[ref] = 1
        r.taken += 1
        return (<object>r.bufs)[ref]

    cdef object _ext_value(self, _Reading* r, int code, bytes data):
        if code == EXT_BYTES:
            if len(data) != BUFFER_REF.size:
                raise DecodeError("bytes reference must be a 4-byte buffer index and an "
                                  "8-byte length")
            return self._referenced_bytes(r, data, 0).tobytes()  # immutable: one copy
        if code == EXT_BYTEARRAY or code == EXT_MEMORYVIEW:
            return self._decode_bytes_like(r, code, data)
        if code == EXT_COMPLEX:
            if len(data) != COMPLEX.size:
                raise DecodeError(f"complex must be {COMPLEX.size} bytes, got {len(data)}")
            real, imag = COMPLEX.unpack(data)
            return complex(real, imag)
        if code == EXT_BIGINT:
            if not data:
                raise DecodeError("empty big int")
            return int.from_bytes(data, "little", signed=True)
        raise DecodeError(f"unknown ext type code {code}")

    cdef object _array_fast(self, _Reading* r, const uint8_t* p, Py_ssize_t size):
        """The common array, quickly; None: take _decode_array. Handles the
        C-ordered NumPy array, out of band in a transport's 1-D uint8 buffer
        (or a memoryview), or inline; any failed check leaves the general path,
        which does the same checks, to say why."""
        if size < _ARRAY_HEAD_SIZE:
            return None
        cdef int ndim = p[3]
        cdef int flags = p[2]
        cdef uint64_t ref = _le(p + 6, 4)
        cdef Py_ssize_t offset = _ARRAY_HEAD_SIZE + 8 * ndim
        if p[0] != _KIND_NDARRAY or ndim > _MAX_NDIM or size < offset:
            return None
        if not (flags == 0 and size == offset) and not (flags == _FLAG_INLINE and ref == 0):
            return None
        dtype = _CODE_TO_DTYPE[p[1]]
        if dtype is None:
            return None
        cdef uint64_t count = 1
        cdef uint64_t dim
        cdef int i
        shape = PyTuple_New(ndim)
        for i in range(ndim):
            dim = _le(p + _ARRAY_HEAD_SIZE + 8 * i, 8)
            if dim == 0 or dim > self._max_elements or count > self._max_elements // dim:
                return None
            count *= dim
            item = PyLong_FromUnsignedLongLong(dim)
            Py_INCREF(item)
            PyTuple_SET_ITEM(shape, i, item)
        cdef Py_ssize_t itemsize = dtype.itemsize
        if count > <uint64_t>(PY_SSIZE_T_MAX // itemsize):
            return None
        cdef Py_ssize_t nbytes = <Py_ssize_t>count * itemsize
        if flags == _FLAG_INLINE:
            if size - offset != nbytes:
                return None
            # A copy: the header's bytes are immutable, and the result must
            # be writable like any decoded array.
            arr = _frombuffer(
                PyByteArray_FromStringAndSize(<const char*>p + offset, nbytes), dtype)
            return arr if ndim == 1 else arr.reshape(shape)
        if ref >= <uint64_t>r.nbufs or r.used[ref]:
            return None
        buf = (<object>r.bufs)[ref]
        tb = type(buf)
        arr = None
        if tb is _ndarray and buf.dtype is _U8 and buf.shape == (nbytes,):
            # 1-D uint8 of the right size; view() itself refuses a
            # non-contiguous one (-> general path, which says why).
            try:
                arr = buf.view(dtype)
            except ValueError:
                return None
        elif tb is memoryview and buf.nbytes == nbytes and buf.c_contiguous:
            arr = _frombuffer(buf, dtype=dtype)  # e.g. in-process
        if arr is None:
            return None
        r.used[ref] = 1
        r.taken += 1
        if not arr.flags.aligned:
            arr = arr.copy()  # see the class docstring
        return arr if ndim == 1 else arr.reshape(shape)

    cdef object _decode_bytes_like(self, _Reading* r, int code, bytes data):
        if not data:
            raise DecodeError("empty bytearray/memoryview payload")
        mode = data[0]
        if mode == BYTES_INLINE:
            raw = bytearray(memoryview(data)[1:])
        elif mode == BYTES_OUT_OF_BAND:
            if len(data) != 1 + BUFFER_REF.size:
                raise DecodeError("bytearray/memoryview reference must be a 4-byte buffer "
                                  "index and an 8-byte length")
            host = self._referenced_bytes(r, data, 1)
            if code == EXT_MEMORYVIEW:
                return as_memoryview(host)  # a view of the received buffer
            return bytearray(host)  # bytearray owns its memory: one copy
        else:
            raise DecodeError(f"unknown bytes mode {mode}")
        return raw if code == EXT_BYTEARRAY else memoryview(raw)

    cdef object _referenced_bytes(self, _Reading* r, bytes data, int offset):
        """The buffer a BUFFER_REF at ``offset`` names, checked against its length."""
        ref, declared = BUFFER_REF.unpack_from(data, offset)
        host, _ = _buffers.host_bytes(self._take(r, ref), ref)
        if host.nbytes != declared:
            raise DecodeError(f"buffer {ref} has {host.nbytes} bytes, the header declares "
                              f"{declared}")
        return host

    cdef object _decode_array(self, _Reading* r, bytes data):
        size = len(data)
        if size < ARRAY_HEAD_SIZE:
            raise DecodeError(f"array descriptor of {size} bytes is truncated")
        kind, code, flags, ndim, device, ref = ARRAY_HEAD.unpack_from(data)
        if ndim > MAX_NDIM:
            raise DecodeError(f"array claims {ndim} dims, at most {MAX_NDIM} allowed")
        if flags & ~FLAGS_KNOWN:
            raise DecodeError(f"unknown array flags {flags:#x}")
        offset = ARRAY_HEAD_SIZE + 8 * ndim
        if size < offset:
            raise DecodeError(f"array descriptor of {size} bytes is truncated (ndim {ndim})")
        shape = DIMS[ndim].unpack_from(data, ARRAY_HEAD_SIZE)
        stored_shape = shape
        if flags & FLAG_BROADCAST:
            if not self._limits.broadcast:
                raise DecodeError(
                    f"a broadcast (zero-stride) array of shape {shape} is refused: its few "
                    "bytes claim the whole shape (Limits(broadcast=True) accepts it)")
            if size < offset + 8:
                raise DecodeError("array descriptor is truncated (broadcast mask)")
            mask = U64.unpack_from(data, offset)[0]
            offset += 8
            if not mask or mask >> ndim:
                raise DecodeError(f"broadcast mask {mask:#x} invalid for {ndim} dims")
            stored_shape = tuple(1 if mask >> a & 1 else d for a, d in enumerate(shape))
        # Bound the logical size with Python ints (no overflow) before NumPy
        # sees the shape; zero dims count as one so (0, 2**64-1) is refused too.
        bound = math.prod([d or 1 for d in shape])
        if bound > self._limits.max_array_elements:
            raise DecodeError(
                f"array shape {shape} exceeds limits.max_array_elements="
                f"{self._limits.max_array_elements}"
            )
        count = math.prod(stored_shape)
        inline = bool(flags & FLAG_INLINE)
        if inline:
            if ref:
                raise DecodeError("inline array with a buffer index")
            payload = memoryview(data)[offset:]
        elif size != offset:
            raise DecodeError(f"array descriptor has {size - offset} trailing bytes")
        else:
            payload = self._take(r, ref)
        if kind == KIND_NDARRAY or kind == KIND_NPSCALAR:
            why = _numpy.check_flags(kind, flags)
            if why is not None:
                raise DecodeError(why)
            if kind == KIND_NPSCALAR and ndim:
                raise DecodeError("a NumPy scalar has 0 dims")
            dtype = _dtype_or_error(code)
            nbytes = count * dtype.itemsize
            if inline:
                if len(payload) != nbytes:
                    raise DecodeError(
                        f"inline array data has {len(payload)} bytes, shape {shape} of "
                        f"{dtype.str} needs {nbytes}"
                    )
                if kind == KIND_NPSCALAR:
                    return np.frombuffer(payload, dtype=dtype)[0]
                # Copied so it is writable like out-of-band arrays (<threshold).
                host = np.frombuffer(bytearray(payload), dtype=np.uint8)
            else:
                if _buffers.is_device(payload):
                    raise DecodeError(
                        f"buffer {ref} is a device buffer, the header wants a NumPy array"
                    )
                host, _ = _buffers.host_bytes(payload, ref)
                if host.nbytes != nbytes:
                    raise DecodeError(
                        f"buffer {ref} has {host.nbytes} bytes, shape {shape} of "
                        f"{dtype.str} needs {nbytes}"
                    )
            return _numpy.decode_ndarray(dtype, flags, shape, stored_shape, host)
        if kind == KIND_TORCH:
            if flags & (FLAG_BROADCAST | FLAG_FORTRAN):
                raise DecodeError(f"flags {flags:#x} not valid for a torch tensor")
            _lazy("torch", "a torch tensor")
            from . import _torch

            # torch's own table: bfloat16/float8 must not need ml_dtypes here.
            itemsize = _torch.itemsize(code)
            if itemsize is None:
                raise DecodeError(f"unknown torch dtype code {code}")
            nbytes = count * itemsize
            if inline and len(payload) != nbytes:
                raise DecodeError(f"inline tensor data has {len(payload)} bytes, needs {nbytes}")
            try:
                return _torch.decode_tensor(
                    code, flags, device, shape, nbytes, payload, ref, inline
                )
            except DecodeError:
                raise
            except Exception as exc:
                raise DecodeError(f"cannot build torch tensor: {exc}") from None
        if kind == KIND_CUPY:
            _lazy("cupy", "a CuPy array")
            from . import _cupy

            dtype = _dtype_or_error(code)
            try:
                return _cupy.decode_cupy(
                    dtype, flags, device, shape, count * dtype.itemsize, payload, ref, inline
                )
            except DecodeError:
                raise
            except Exception as exc:
                raise DecodeError(f"cannot build CuPy array: {exc}") from None
        raise DecodeError(f"unknown array kind {kind}")


cdef inline str _read_str(_Reading* r, uint64_t n):
    cdef const uint8_t* p = _take_bytes(r, n)
    return PyUnicode_DecodeUTF8(<const char*>p, n, NULL)  # UnicodeDecodeError if invalid


def _as_decode_error(exc: Exception) -> DecodeError:
    """Translate an exception raised while reading into a DecodeError that says why."""
    if isinstance(exc, DecodeError):
        return exc
    if isinstance(exc, UnicodeDecodeError):
        return DecodeError(f"invalid UTF-8 in a header string: {exc}")
    if isinstance(exc, ValueError | TypeError):  # TypeError: e.g. an unhashable dict key
        return DecodeError(f"malformed header: {exc}")
    return DecodeError(f"malformed header: {type(exc).__qualname__}: {exc}")


def _dtype_or_error(code: int) -> np.dtype[Any]:
    dtype = _dtypes.dtype_for(code)
    if dtype is None:
        if code in _dtypes.ML_DTYPES_CODES:
            raise DecodeError(
                f"dtype code {code} ({_dtypes.ML_DTYPES_CODES[code]}) needs ml_dtypes, "
                "which is not installed"
            )
        raise DecodeError(f"unknown dtype code {code}")
    return dtype


def _lazy(module: str, what: str) -> ModuleType:
    try:
        return __import__(module)
    except ImportError:
        raise DecodeError(f"header holds {what}, but {module} is not installed") from None
