# The layout of Encoder, for Cython modules that cimport it (the RPC core
# encodes a request's arguments and a handler's result on every call: a C
# call then, ``encode_frames``). Described in _encoder.pyx.

from libc.stdint cimport uint8_t, uint64_t


cdef class Encoder:
    cdef object _registry
    cdef object _limits
    cdef Py_ssize_t _threshold
    cdef Py_ssize_t _max_depth
    cdef Py_ssize_t _max_header
    cdef Py_ssize_t _max_buffers
    cdef bint _broadcast
    cdef bint _busy
    # type -> BY_* for the types met so far that are not built in; the
    # registered ones also in _entries (type -> RegisteredType).
    cdef dict _resolved
    cdef dict _entries
    # The call in progress: its buffers and the header written so far.
    cdef list _bufs
    cdef uint8_t* _out
    cdef Py_ssize_t _len
    cdef Py_ssize_t _cap
    # The bytes before the header in the call in progress (encode_frames_after).
    cdef Py_ssize_t _head

    cpdef list encode_frames(self, object obj)
    cdef list encode_frames_after(self, const uint8_t* head, Py_ssize_t head_size, object obj)
    cdef list encode_arguments_after(self, const uint8_t* head, Py_ssize_t head_size,
                                     tuple args, dict kwargs)
    cdef list _frames(self, object obj, dict kwargs, const uint8_t* head, Py_ssize_t head_size)
    cdef bytes _encode(self, object obj, list bufs, const uint8_t* head=*, Py_ssize_t head_size=*,
                       dict kwargs=*)
    cdef bytes _finish(self)
    cdef int _resize(self, Py_ssize_t capacity) except -1
    cdef uint8_t* _room(self, Py_ssize_t n) except NULL
    cdef int _put_sized(self, uint8_t marker, uint64_t value, int width) except -1
    cdef int _put_bytes(self, const void* data, Py_ssize_t n) except -1
    cdef int _put_le(self, uint64_t value, int width) except -1
    cdef int _put_length(self, Py_ssize_t n, uint8_t fix, int fix_max, uint8_t m8,
                         uint8_t m16, uint8_t m32) except -1
    cdef int _put_ext_header(self, uint8_t* at, Py_ssize_t n, int code) noexcept
    cdef int _ext(self, Py_ssize_t n, int code) except -1
    cdef Py_ssize_t _ext_open(self) except -1
    cdef int _ext_close(self, Py_ssize_t start, int code) except -1
    cdef int _put_ext_value(self, object ext) except -1
    cdef int _put_int(self, object value) except -1
    cdef int _put_float(self, double value) except -1
    cdef int _put_str(self, object text) except -1
    cdef int _put_bin(self, bytes data) except -1
    cdef int _put_buffer_ref(self, Py_ssize_t nbytes) except -1
    cdef int _pack(self, object obj, Py_ssize_t depth) except -1
    cdef int _check_depth(self, Py_ssize_t depth) except -1
    cdef int _pack_items(self, object items, Py_ssize_t depth) except -1
    cdef int _pack_arguments(self, tuple args, dict kwargs) except -1
    cdef int _pack_tuple(self, tuple tup, Py_ssize_t depth) except -1
    cdef int _pack_dict(self, dict d, Py_ssize_t depth) except -1
    cdef int _pack_bytes(self, bytes b) except -1
    cdef int _pack_bytes_like(self, int code, object mv) except -1
    cdef int _pack_ndarray(self, object arr) except -1
    cdef int _pack_other(self, object obj, type t, Py_ssize_t depth) except -1
    cdef int _pack_registered(self, object obj, object entry, Py_ssize_t depth) except -1
    cdef int _resolve(self, type t, object obj) except -1
