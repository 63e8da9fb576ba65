# The layout of Decoder, for Cython modules that cimport it (the RPC core
# decodes a request's arguments and a call's result on every call: a C call
# then, ``decode_frames``). Described in _decoder.pyx.

from cpython.object cimport PyObject
from libc.stdint cimport uint8_t, uint64_t


cdef struct _Reading:
    # The state of one decode() call, on its C stack: a registered type's
    # decode function may call the same Decoder again.
    const uint8_t* pos  # the next byte of the header to read
    const uint8_t* end  # the end of the header, or of the ext payload being read
    PyObject* bufs  # the buffers given (borrowed: decode() holds them)
    uint8_t* used  # one flag per buffer: referenced yet? (NULL: no buffers)
    Py_ssize_t nbufs
    Py_ssize_t taken  # how many buffers are referenced


cdef class Decoder:
    cdef object _registry
    cdef object _limits
    cdef Py_ssize_t _max_depth
    cdef Py_ssize_t _max_header
    cdef Py_ssize_t _max_buffers
    cdef uint64_t _max_elements

    cpdef object decode_frames(self, list frames)
    cdef object _decode_header(self, object header, object buffers)
    cdef object _decode(self, const uint8_t* data, Py_ssize_t size, object buffers)
    cdef object _read(self, _Reading* r, Py_ssize_t depth)
    cdef int _enter(self, Py_ssize_t depth) except -1
    cdef object _read_array(self, _Reading* r, uint64_t n, Py_ssize_t depth, bint as_tuple)
    cdef dict _read_map(self, _Reading* r, uint64_t n, Py_ssize_t depth)
    cdef object _read_ext(self, _Reading* r, uint64_t n, Py_ssize_t depth)
    cdef tuple _read_tuple(self, _Reading* r, Py_ssize_t depth)
    cdef object _read_registered(self, _Reading* r, Py_ssize_t depth)
    cdef object _take(self, _Reading* r, uint64_t ref)
    cdef object _ext_value(self, _Reading* r, int code, bytes data)
    cdef object _array_fast(self, _Reading* r, const uint8_t* p, Py_ssize_t size)
    cdef object _decode_bytes_like(self, _Reading* r, int code, bytes data)
    cdef object _referenced_bytes(self, _Reading* r, bytes data, int offset)
    cdef object _decode_array(self, _Reading* r, bytes data)
