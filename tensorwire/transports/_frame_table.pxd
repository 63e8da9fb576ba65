# The frame table's C-level interface, for the stream reader and writer
# (issue 22).
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport uint64_t

cdef enum:
    # The prelude and frame table of a one-frame message (``ONE_FRAME_SIZE``).
    ONE_FRAME_HEADER_SIZE = 24

cdef extern from *:
    """
    /* The first word of a one-frame data message (ONE_DATA_PRELUDE): kind 0,
       the reserved zeros, one frame. */
    static const unsigned long long TW_ONE_DATA_PRELUDE = 1ULL << 32;
    """
    const unsigned long long ONE_DATA_PRELUDE_WORD "TW_ONE_DATA_PRELUDE"


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


cdef inline void write_one_frame_header(unsigned char* p, uint64_t nbytes) noexcept nogil:
    """Write the prelude and frame table of a data message of one host
    frame of ``nbytes`` at ``p``: three little-endian words
    (``ONE_FRAME_WORDS``, ONE_FRAME_HEADER_SIZE bytes)."""
    store_u64le(p, ONE_DATA_PRELUDE_WORD)
    store_u64le(p + 8, nbytes)
    store_u64le(p + 16, 0)


cdef inline bytes one_frame_header(uint64_t nbytes):
    """``write_one_frame_header`` into a bytes object of its own."""
    cdef bytes header = PyBytes_FromStringAndSize(NULL, ONE_FRAME_HEADER_SIZE)
    write_one_frame_header(<unsigned char*>PyBytes_AS_STRING(header), nbytes)
    return header


cpdef Py_ssize_t table_size(Py_ssize_t nframes)
cpdef tuple decode_sizes(const unsigned char[::1] table, Py_ssize_t nframes, Py_ssize_t offset)
cpdef str device_name(int code, Py_ssize_t index)
