# The frame table's C-level interface, for the stream reader (issue 22).
from libc.stdint cimport uint64_t


cdef inline uint64_t load_u64le(const unsigned char* p) noexcept nogil:
    """The little-endian u64 at ``p`` (the wire's byte order, whatever the
    host's; any alignment)."""
    cdef uint64_t value = 0
    cdef int i
    for i in range(7, -1, -1):
        value = value << 8 | p[i]
    return value


cdef inline void store_u64le(unsigned char* p, uint64_t value) noexcept nogil:
    """Write ``value`` at ``p`` as a little-endian u64."""
    cdef int i
    for i in range(8):
        p[i] = value & 0xFF
        value >>= 8


cpdef Py_ssize_t table_size(Py_ssize_t nframes)
cpdef tuple decode_sizes(const unsigned char[::1] table, Py_ssize_t nframes, Py_ssize_t offset)
cpdef str device_name(int code, Py_ssize_t index)
