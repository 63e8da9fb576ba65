# cython: language_level=3
"""Encoder: Python values -> (header, buffers).

The encoder walks the value once and writes its msgpack body straight into
a growing C buffer, with exactly the bytes msgpack-python's
``Packer(use_bin_type=True)`` writes for the same values (each int, str, bin,
array, map and ext in its smallest form). Arrays, tuples, complex numbers,
big ints, bytes-likes and registered types are msgpack ext values
(``_format.EXT_*``); large data stays out of band as zero-copy buffers.

A C-contiguous NumPy array of a whitelisted dtype is described here; every
other array, scalar and tensor kind is described by its codec module
(``_numpy``, ``_torch``, ``_cupy``), which returns an ``ExtType`` that is
copied in as it is.
"""

from __future__ import annotations

import sys
from typing import Final

import numpy as np

from cpython.buffer cimport PyBuffer_IsContiguous
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.memoryview cimport PyMemoryView_GET_BUFFER
from cpython.object cimport PyObject
from libc.stdint cimport int64_t, uint8_t, uint64_t
from libc.string cimport memcpy, memmove

from ..errors import ConfigError, EncodeError
from . import _dtypes, _numpy
from ._format import (
    EXT_ARRAY,
    EXT_BIGINT,
    EXT_BYTEARRAY,
    EXT_BYTES,
    EXT_COMPLEX,
    EXT_MEMORYVIEW,
    EXT_REGISTERED,
    EXT_TUPLE,
    KIND_NDARRAY,
    PREFIX,
    PREFIX_SIZE,
    UnsupportedValueError,
)
from ._limits import Limits
from ._registry import default_registry

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object text, Py_ssize_t* size) except NULL
    long long PyLong_AsLongLongAndOverflow(object value, int* overflow) except? -1
    unsigned long long PyLong_AsUnsignedLongLong(object value) except? -1
    object PyMemoryView_FromObject(object obj)

#: Default size (bytes) below which array data and bytes are copied into the
#: header instead of going out of band. Measured in bench/results/serde.md: an
#: out-of-band buffer costs a frame (and a syscall iovec) on the transport,
#: while copying < 1 KiB into the header costs about 0.1 us.
DEFAULT_INLINE_THRESHOLD: Final = 1024

cdef enum:
    # Bytes reserved for an ext header whose payload length is not known yet
    # (ext 32: marker, u32 length, type); the unused part is closed up.
    EXT_RESERVE = 6
    # EXT_ARRAY descriptor: kind, dtype, flags, ndim, u16 device, u32 buffer.
    ARRAY_HEAD_SIZE = 10
    FLAG_INLINE = 0x02
    # How types met for the first time are encoded (Encoder._resolved).
    BY_NPSCALAR = 1
    BY_TORCH = 2
    BY_CUPY = 3
    BY_REGISTERED = 4
    # A fresh encoder's buffer; one grown beyond SHRINK_ABOVE is given back.
    INITIAL_CAPACITY = 1024
    SHRINK_ABOVE = 1 << 20

# The header's prefix as a C constant (the format's PREFIX_SIZE).
cdef Py_ssize_t _PREFIX_SIZE = PREFIX_SIZE
cdef object _ndarray = np.ndarray
cdef object _memmap = np.memmap
cdef dict _DTYPE_TO_CODE = _dtypes.DTYPE_TO_CODE
cdef int _FIRST_ML_CODE = min(_dtypes.ML_DTYPES_CODES)
cdef object _U64_END = 1 << 64
cdef tuple _NATIVE_KEYS = (str, int, float, bool, type(None), bytes)
cdef object _encode_ndarray = _numpy.encode_ndarray
cdef object _encode_scalar = _numpy.encode_scalar


def _render_path(path: list[str]) -> str:
    return "value" + "".join(reversed(path))


cdef inline uint64_t _float_bits(double value) noexcept:
    cdef uint64_t bits
    memcpy(&bits, &value, 8)
    return bits


cdef inline int _ext_header_size(Py_ssize_t n) noexcept:
    if n == 1 or n == 2 or n == 4 or n == 8 or n == 16:
        return 2
    if n < 0x100:
        return 3
    if n < 0x10000:
        return 4
    return 6


cdef class Encoder:
    """Reusable encoder: ``encode(obj) -> (header, buffers)``.

    Buffers are zero-copy views of the caller's memory (a 1-D unsigned-byte
    ``memoryview`` for host data, an object with ``__cuda_array_interface__``
    for device data), ready for ``socket.sendmsg``; the caller must not modify
    the value until the buffers are sent. Exactly one copy is made of a
    non-contiguous array or tensor (to compact it; a broadcast array in full,
    unless ``limits.broadcast``); C- and F-contiguous arrays are never copied
    unless smaller than ``inline_threshold``.

    An Encoder is not thread-safe (it reuses one output buffer); use one per
    thread. The module-level :func:`encode` keeps one per thread for you. A
    registered type's encode function may call the same encoder again.

    Args:
        registry: user types; default: the registry :func:`register` fills.
        inline_threshold: data smaller than this many bytes is copied into the
            header; 0 sends every array and bytes-like out of band.
        limits: bounds on depth, header size and buffer count.

    Raises:
        ConfigError: ``inline_threshold`` is negative or not an int.
    """

    # Its fields are declared in _encoder.pxd.

    def __cinit__(self) -> None:
        self._out = <uint8_t*>PyMem_Malloc(INITIAL_CAPACITY)
        if self._out is NULL:
            raise MemoryError()
        self._cap = INITIAL_CAPACITY

    def __dealloc__(self) -> None:
        PyMem_Free(self._out)

    def __init__(self, *, registry=None, inline_threshold=DEFAULT_INLINE_THRESHOLD,
                 limits=None) -> None:
        if type(inline_threshold) is not int or inline_threshold < 0:
            raise ConfigError(f"inline_threshold must be an int >= 0, got {inline_threshold!r}")
        self._registry = default_registry if registry is None else registry
        self._threshold = inline_threshold
        self._limits = Limits() if limits is None else limits
        self._max_depth = self._limits.max_depth
        self._max_header = self._limits.max_header_bytes
        self._max_buffers = self._limits.max_buffers
        self._broadcast = self._limits.broadcast
        self._resolved = dict.fromkeys(set(np.sctypeDict.values()), BY_NPSCALAR)
        self._entries = {}

    @property
    def inline_threshold(self) -> int:
        """Data smaller than this many bytes is inlined into the header."""
        return self._threshold

    @property
    def limits(self) -> Limits:
        """The limits this encoder enforces."""
        return self._limits

    def encode(self, obj) -> tuple[bytes, list]:
        """Encode ``obj`` into a header and a list of out-of-band buffers.

        Raises:
            EncodeError: a value of an unsupported type (unregistered class,
                object or structured dtype, subclass of a builtin, ...), with
                the type and its path (``value['params'][3]``); nesting deeper
                than ``limits.max_depth``; a header or buffer count beyond
                the limits; a str that is not valid Unicode.
        """
        cdef list bufs = []
        return self._encode(obj, bufs), bufs

    def encode_nested(self, obj: list) -> tuple[bytes, list]:
        """``encode(obj)`` for a list of a few containers (lists, tuples,
        dicts), as the RPC's ``[args, kwargs]``: the same result and errors
        (kept for its callers; encoding has one path).
        """
        return self.encode(obj)

    cpdef list encode_frames(self, object obj):
        """``encode(obj)`` as one list, as a transport sends it: the header,
        then the out-of-band buffers. The RPC core encodes every call's
        arguments and result so, by a C call.

        Raises:
            EncodeError: as ``encode``.
        """
        return self.encode_frames_after(NULL, 0, obj)

    def encode_arguments(self, tuple args not None, dict kwargs not None) -> list:
        """``encode_frames([list(args), kwargs])``, a call's arguments as the
        RPC sends them, without making the two lists (the RPC core writes
        them after its request header: ``encode_arguments_after``).

        Raises:
            EncodeError: as ``encode``.
        """
        return self._frames(args, kwargs, NULL, 0)

    cdef list encode_frames_after(self, const uint8_t* head, Py_ssize_t head_size, object obj):
        """``encode_frames(obj)`` with the ``head_size`` bytes at ``head``
        before the header, in the same bytes object: an RPC message's own
        header and its value's as one frame, written once (the limits
        apply to the value's header alone).

        Raises:
            EncodeError: as ``encode``.
        """
        return self._frames(obj, None, head, head_size)

    cdef list encode_arguments_after(self, const uint8_t* head, Py_ssize_t head_size,
                                     tuple args, dict kwargs):
        """``encode_frames_after`` of the value ``[list(args), kwargs]``
        (a call's arguments, as the RPC sends them), without making the two
        lists: the same bytes and errors.

        Raises:
            EncodeError: as ``encode``.
        """
        return self._frames(args, kwargs, head, head_size)

    cdef list _frames(self, object obj, dict kwargs, const uint8_t* head,
                      Py_ssize_t head_size):
        """The frames of ``obj`` (of ``[list(obj), kwargs]`` with
        ``kwargs``) after ``head``."""
        cdef list bufs = []
        header = self._encode(obj, bufs, head, head_size, kwargs)
        if not bufs:
            return [header]  # most values: no out-of-band buffers
        cdef list frames = [header]
        frames.extend(bufs)
        return frames

    cdef bytes _encode(self, object obj, list bufs, const uint8_t* head=NULL,
                       Py_ssize_t head_size=0, dict kwargs=None):
        """``obj``'s header, after ``head`` (see ``encode_frames_after``);
        its out-of-band buffers are appended to ``bufs`` (empty). With
        ``kwargs``, the value is ``[list(obj), kwargs]`` (see
        ``encode_arguments_after``)."""
        if self._busy:
            # Called again from a registered type's encode function: a fresh
            # encoder, since this one's buffer holds the outer header.
            return Encoder(registry=self._registry, inline_threshold=self._threshold,
                           limits=self._limits)._encode(obj, bufs, head, head_size, kwargs)
        self._busy = True
        self._bufs = bufs
        self._head = head_size
        if head_size + _PREFIX_SIZE > self._cap:
            self._resize(head_size + _PREFIX_SIZE + INITIAL_CAPACITY)
        if head_size:
            memcpy(self._out, head, head_size)
        self._len = head_size + _PREFIX_SIZE
        try:
            if kwargs is None:
                self._pack(obj, 0)
            else:
                self._pack_arguments(obj, kwargs)
            return self._finish()
        except EncodeError:
            raise
        except UnsupportedValueError as exc:
            raise EncodeError(f"{exc.message} at {_render_path(exc.path)}") from exc
        except (ValueError, TypeError, OverflowError) as exc:
            raise EncodeError(f"cannot encode value: {exc}") from exc
        finally:
            self._bufs = None
            self._busy = False
            self._head = 0
            if self._cap > SHRINK_ABOVE:
                self._resize(INITIAL_CAPACITY)

    cdef bytes _finish(self):
        """The header written so far, with its prefix (after the head)."""
        cdef Py_ssize_t size = self._len - self._head
        cdef Py_ssize_t nbufs = len(self._bufs)
        if size > self._max_header:
            raise EncodeError(
                f"header of {size} bytes exceeds limits.max_header_bytes={self._max_header}")
        if nbufs > self._max_buffers:
            raise EncodeError(f"{nbufs} buffers exceed limits.max_buffers={self._max_buffers}")
        cdef uint8_t* out = self._out + self._head
        memcpy(out, PyBytes_AS_STRING(PREFIX), 4)
        out[4] = <uint8_t>nbufs
        out[5] = <uint8_t>(nbufs >> 8)
        out[6] = <uint8_t>(nbufs >> 16)
        out[7] = <uint8_t>(nbufs >> 24)
        return PyBytes_FromStringAndSize(<char*>self._out, self._len)

    # -- the output buffer -----------------------------------------------------

    cdef int _resize(self, Py_ssize_t capacity) except -1:
        cdef uint8_t* grown = <uint8_t*>PyMem_Realloc(self._out, capacity)
        if grown is NULL:
            raise MemoryError()
        self._out = grown
        self._cap = capacity
        return 0

    cdef inline uint8_t* _room(self, Py_ssize_t n) except NULL:
        """Make room for ``n`` more bytes; return where they go (and count them)."""
        cdef Py_ssize_t need = self._len + n
        cdef Py_ssize_t capacity
        if need > self._cap:
            if need - self._head > self._max_header + EXT_RESERVE:
                # Stop early: the header can no longer fit (_finish says the
                # same for what ends just over the limit).
                raise EncodeError(f"header of more than {self._max_header} bytes exceeds "
                                  f"limits.max_header_bytes={self._max_header}")
            capacity = self._cap * 2
            while capacity < need:
                capacity *= 2
            self._resize(capacity)
        cdef uint8_t* at = self._out + self._len
        self._len = need
        return at

    cdef inline int _put_sized(self, uint8_t marker, uint64_t value, int width) except -1:
        """``marker`` then ``value`` as a ``width``-byte big-endian int (msgpack's order)."""
        cdef uint8_t* at = self._room(1 + width)
        cdef int i
        at[0] = marker
        for i in range(width):
            at[width - i] = <uint8_t>(value >> (8 * i))
        return 0

    cdef int _put_bytes(self, const void* data, Py_ssize_t n) except -1:
        if n:
            memcpy(self._room(n), data, n)
        return 0

    cdef int _put_le(self, uint64_t value, int width) except -1:
        cdef uint8_t* at = self._room(width)
        cdef int i
        for i in range(width):
            at[i] = <uint8_t>(value >> (8 * i))
        return 0

    # -- msgpack ----------------------------------------------------------------

    cdef int _put_length(self, Py_ssize_t n, uint8_t fix, int fix_max, uint8_t m8,
                         uint8_t m16, uint8_t m32) except -1:
        """A str, bin, array or map header: its smallest form (m8 0: none)."""
        if n < fix_max:
            self._room(1)[0] = fix | <uint8_t>n
        elif m8 and n < 0x100:
            self._put_sized(m8, n, 1)
        elif n < 0x10000:
            self._put_sized(m16, n, 2)
        elif n <= 0xFFFFFFFF:
            self._put_sized(m32, n, 4)
        else:
            raise ValueError(f"{n} items or bytes do not fit in msgpack")
        return 0

    cdef int _put_ext_header(self, uint8_t* at, Py_ssize_t n, int code) noexcept:
        """Write the header of an ext of ``n`` payload bytes at ``at``."""
        if n == 1 or n == 2 or n == 4 or n == 8 or n == 16:
            at[0] = 0xD4 + (0 if n == 1 else 1 if n == 2 else 2 if n == 4 else 3 if n == 8 else 4)
            at[1] = <uint8_t>code
        elif n < 0x100:
            at[0] = 0xC7
            at[1] = <uint8_t>n
            at[2] = <uint8_t>code
        elif n < 0x10000:
            at[0] = 0xC8
            at[1] = <uint8_t>(n >> 8)
            at[2] = <uint8_t>n
            at[3] = <uint8_t>code
        else:
            at[0] = 0xC9
            at[1] = <uint8_t>(n >> 24)
            at[2] = <uint8_t>(n >> 16)
            at[3] = <uint8_t>(n >> 8)
            at[4] = <uint8_t>n
            at[5] = <uint8_t>code
        return 0

    cdef int _ext(self, Py_ssize_t n, int code) except -1:
        """The header of an ext whose ``n`` payload bytes follow."""
        if n > 0xFFFFFFFF:
            raise ValueError(f"an ext payload of {n} bytes does not fit in msgpack")
        self._put_ext_header(self._room(_ext_header_size(n)), n, code)
        return 0

    cdef Py_ssize_t _ext_open(self) except -1:
        """Open an ext whose payload is written next; returns its start for _ext_close."""
        cdef Py_ssize_t start = self._len
        self._room(EXT_RESERVE)
        return start

    cdef int _ext_close(self, Py_ssize_t start, int code) except -1:
        cdef Py_ssize_t n = self._len - start - EXT_RESERVE
        if n > 0xFFFFFFFF:
            raise ValueError(f"an ext payload of {n} bytes does not fit in msgpack")
        cdef int h = _ext_header_size(n)
        cdef uint8_t* at = self._out + start
        if h != EXT_RESERVE:
            memmove(at + h, at + EXT_RESERVE, n)
            self._len -= EXT_RESERVE - h
        self._put_ext_header(at, n, code)
        return 0

    cdef int _put_ext_value(self, object ext) except -1:
        """Copy an ``ExtType`` (from a codec module) in as it is."""
        cdef bytes data = ext[1]
        cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
        self._ext(n, ext[0])
        self._put_bytes(PyBytes_AS_STRING(data), n)
        return 0

    cdef int _put_int(self, object value) except -1:
        cdef int overflow = 0
        cdef long long v = PyLong_AsLongLongAndOverflow(value, &overflow)
        if overflow == 0:
            if v >= 0:
                if v < 0x80:
                    self._room(1)[0] = <uint8_t>v
                elif v < 0x100:
                    self._put_sized(0xCC, v, 1)
                elif v < 0x10000:
                    self._put_sized(0xCD, v, 2)
                elif v < 0x100000000:
                    self._put_sized(0xCE, v, 4)
                else:
                    self._put_sized(0xCF, v, 8)
            elif v >= -32:
                self._room(1)[0] = <uint8_t>v
            elif v >= -0x80:
                self._put_sized(0xD0, <uint64_t>v, 1)
            elif v >= -0x8000:
                self._put_sized(0xD1, <uint64_t>v, 2)
            elif v >= -0x80000000:
                self._put_sized(0xD2, <uint64_t>v, 4)
            else:
                self._put_sized(0xD3, <uint64_t>v, 8)
        elif overflow > 0 and value < _U64_END:
            self._put_sized(0xCF, PyLong_AsUnsignedLongLong(value), 8)
        else:
            # Beyond 64 bits: two's complement, little endian (+1 bit for the sign).
            data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            self._ext(len(data), EXT_BIGINT)
            self._put_bytes(PyBytes_AS_STRING(data), len(data))
        return 0

    cdef int _put_float(self, double value) except -1:
        self._put_sized(0xCB, _float_bits(value), 8)
        return 0

    cdef int _put_str(self, object text) except -1:
        cdef Py_ssize_t n
        cdef const char* data = PyUnicode_AsUTF8AndSize(text, &n)
        self._put_length(n, 0xA0, 32, 0xD9, 0xDA, 0xDB)
        self._put_bytes(data, n)
        return 0

    cdef int _put_bin(self, bytes data) except -1:
        cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
        self._put_length(n, 0, 0, 0xC4, 0xC5, 0xC6)
        self._put_bytes(PyBytes_AS_STRING(data), n)
        return 0

    cdef int _put_buffer_ref(self, Py_ssize_t nbytes) except -1:
        """An out-of-band buffer's index (u32) and length (u64): the buffer is
        the one appended next."""
        self._put_le(len(self._bufs), 4)
        self._put_le(nbytes, 8)
        return 0

    # -- the walk --------------------------------------------------------------

    cdef int _pack(self, object obj, Py_ssize_t depth) except -1:
        cdef type t = type(obj)
        if t is str:
            self._put_str(obj)
        elif t is int:
            self._put_int(obj)
        elif obj is None:
            self._room(1)[0] = 0xC0
        elif t is bool:
            self._room(1)[0] = 0xC3 if obj is True else 0xC2
        elif t is float:
            self._put_float(obj)
        elif t is dict:
            self._pack_dict(obj, depth)
        elif t is list:
            self._pack_items(obj, depth)
        elif t is tuple:
            self._pack_tuple(obj, depth)
        elif t is _ndarray or t is _memmap:
            self._pack_ndarray(obj)
        elif t is bytes:
            self._pack_bytes(obj)
        elif t is bytearray:
            self._pack_bytes_like(EXT_BYTEARRAY, memoryview(obj))
        elif t is memoryview:
            self._pack_bytes_like(EXT_MEMORYVIEW, obj)
        elif t is complex:
            self._ext(16, EXT_COMPLEX)
            self._put_le(_float_bits(obj.real), 8)
            self._put_le(_float_bits(obj.imag), 8)
        else:
            self._pack_other(obj, t, depth)
        return 0

    cdef int _check_depth(self, Py_ssize_t depth) except -1:
        if depth >= self._max_depth:
            raise UnsupportedValueError(f"nesting deeper than limits.max_depth={self._max_depth}")
        return 0

    cdef int _pack_items(self, object items, Py_ssize_t depth) except -1:
        """A list's or tuple's items as a msgpack array."""
        self._check_depth(depth)
        self._put_length(len(items), 0x90, 16, 0, 0xDC, 0xDD)
        cdef Py_ssize_t i = 0
        try:
            for item in items:
                self._pack(item, depth + 1)
                i += 1
        except UnsupportedValueError as exc:
            exc.path.append(f"[{i}]")
            raise
        return 0

    cdef int _pack_arguments(self, tuple args, dict kwargs) except -1:
        """``[list(args), kwargs]``, as ``_pack`` writes it: an array of
        two, the positional arguments as an array, the keywords as a map."""
        self._check_depth(0)
        self._room(1)[0] = 0x92
        cdef Py_ssize_t i = 0
        try:
            self._pack_items(args, 1)
            i = 1
            self._pack_dict(kwargs, 1)
        except UnsupportedValueError as exc:
            exc.path.append(f"[{i}]")
            raise
        return 0

    cdef int _pack_tuple(self, tuple tup, Py_ssize_t depth) except -1:
        cdef Py_ssize_t start = self._ext_open()
        self._pack_items(tup, depth)
        self._ext_close(start, EXT_TUPLE)
        return 0

    cdef int _pack_dict(self, dict d, Py_ssize_t depth) except -1:
        self._check_depth(depth)
        self._put_length(len(d), 0x80, 16, 0, 0xDE, 0xDF)
        if not d:
            return 0  # every call's kwargs, mostly: no items to walk
        for k, v in d.items():
            tk = type(k)
            try:
                if tk is tuple:
                    self._pack_tuple(k, depth + 1)
                elif tk is bytes:
                    self._put_bin(k)  # keys are always inline
                elif tk in _NATIVE_KEYS:
                    self._pack(k, depth + 1)
                else:
                    raise UnsupportedValueError(
                        f"unsupported dict key type {tk.__module__}.{tk.__qualname__}")
            except UnsupportedValueError as exc:
                exc.path.append(f".keys()[{k!r}]")
                raise
            try:
                self._pack(v, depth + 1)
            except UnsupportedValueError as exc:
                exc.path.append(f"[{k!r}]")
                raise
        return 0

    cdef int _pack_bytes(self, bytes b) except -1:
        cdef Py_ssize_t n = PyBytes_GET_SIZE(b)
        if n < self._threshold:
            return self._put_bin(b)
        self._ext(12, EXT_BYTES)
        self._put_buffer_ref(n)
        self._bufs.append(memoryview(b))
        return 0

    cdef int _pack_bytes_like(self, int code, object mv) except -1:
        if not mv.c_contiguous:
            mv = memoryview(mv.tobytes())  # the one copy of a strided memoryview
        elif mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        cdef Py_ssize_t n = mv.nbytes
        if n < self._threshold:
            data = mv.tobytes()
            self._ext(1 + n, code)
            self._room(1)[0] = 0  # BYTES_INLINE
            self._put_bytes(PyBytes_AS_STRING(data), n)
        else:
            self._ext(13, code)
            self._room(1)[0] = 1  # BYTES_OUT_OF_BAND
            self._put_buffer_ref(n)
            self._bufs.append(mv)
        return 0

    cdef int _pack_ndarray(self, object arr) except -1:
        """The common array here: whitelisted dtype, C-contiguous, native to
        NumPy; every other one through ``_numpy.encode_ndarray``."""
        code = _DTYPE_TO_CODE.get(arr.dtype)
        if code is None or <int>code >= _FIRST_ML_CODE:
            return self._put_ext_value(
                _encode_ndarray(arr, self._bufs, self._threshold, self._broadcast))
        view_obj = PyMemoryView_FromObject(arr)
        cdef Py_buffer* view = PyMemoryView_GET_BUFFER(view_obj)
        if not PyBuffer_IsContiguous(view, c'C'):
            return self._put_ext_value(
                _encode_ndarray(arr, self._bufs, self._threshold, self._broadcast))
        cdef Py_ssize_t nbytes = view.len
        cdef int ndim = view.ndim
        cdef bint inline = nbytes == 0 or nbytes < self._threshold
        cdef Py_ssize_t size = ARRAY_HEAD_SIZE + 8 * ndim + (nbytes if inline else 0)
        self._ext(size, EXT_ARRAY)
        cdef uint8_t* at = self._room(ARRAY_HEAD_SIZE)
        cdef int i
        at[0] = KIND_NDARRAY
        at[1] = <uint8_t>code
        at[2] = FLAG_INLINE if inline else 0
        at[3] = <uint8_t>ndim
        at[4] = at[5] = 0  # device
        cdef uint64_t ref = 0 if inline else len(self._bufs)
        for i in range(4):
            at[6 + i] = <uint8_t>(ref >> (8 * i))
        for i in range(ndim):
            self._put_le(<uint64_t>view.shape[i], 8)
        if inline:
            self._put_bytes(view.buf, nbytes)
        elif view.ndim == 1 and view.format != NULL and view.format[0] == c'B' \
                and view.format[1] == 0:
            self._bufs.append(view_obj)  # already a 1-D unsigned-byte view
        else:
            self._bufs.append(view_obj.cast("B"))  # zero-copy byte view
        return 0

    cdef int _pack_other(self, object obj, type t, Py_ssize_t depth) except -1:
        """Types that are not built in: NumPy scalars, tensors, registered types."""
        cdef int how
        found = self._resolved.get(t)
        how = self._resolve(t, obj) if found is None else found
        if how == BY_NPSCALAR:
            return self._put_ext_value(_encode_scalar(obj, self._bufs, self._threshold))
        if how == BY_REGISTERED:
            return self._pack_registered(obj, self._entries[t], depth)
        if how == BY_TORCH:
            from . import _torch

            return self._put_ext_value(_torch.encode_tensor(obj, self._bufs, self._threshold))
        from . import _cupy

        return self._put_ext_value(_cupy.encode_cupy(obj, self._bufs, self._threshold))

    cdef int _pack_registered(self, object obj, object entry, Py_ssize_t depth) except -1:
        self._check_depth(depth)
        name = entry.name
        try:
            inner = entry.encode(obj)
        except Exception as exc:
            raise UnsupportedValueError(
                f"encode function of registered type {name!r} raised {exc!r}") from exc
        cdef Py_ssize_t start = self._ext_open()
        self._room(1)[0] = 0x92  # [name, value]
        self._put_str(name)
        self._pack(inner, depth + 1)
        self._ext_close(start, EXT_REGISTERED)
        return 0

    cdef int _resolve(self, type t, object obj) except -1:
        """How to encode a type met for the first time (cached: registrations
        are immutable)."""
        entry = self._registry.for_type(t)
        if entry is not None:
            self._entries[t] = entry
            self._resolved[t] = BY_REGISTERED
            return BY_REGISTERED
        module = t.__module__ or ""
        # Lazy libraries: looked at only when such an object is met, so that
        # encoding NumPy values never imports torch or cupy.
        if module.startswith("torch") and "torch" in sys.modules:
            from . import _torch

            if _torch.is_tensor(obj):
                self._resolved[t] = BY_TORCH
                return BY_TORCH
        if module.startswith("cupy") and "cupy" in sys.modules:
            from . import _cupy

            if _cupy.is_cupy_array(obj):
                self._resolved[t] = BY_CUPY
                return BY_CUPY
        if isinstance(obj, np.generic):  # e.g. ml_dtypes.bfloat16 scalars
            self._resolved[t] = BY_NPSCALAR
            return BY_NPSCALAR
        name = f"{module}.{t.__qualname__}"
        if isinstance(obj, np.ndarray):
            why = "ndarray subclasses are not supported; pass np.asarray(x)"
        elif isinstance(obj, (dict, list, tuple, str, int, float, bytes)):
            why = "subclasses of builtins would decode as another type; register it or convert"
        else:
            why = "register it with tensorwire.serde.register()"
        raise UnsupportedValueError(f"unsupported type {name}: {why}")
