# The layout of CallTable, for Cython modules that cimport it (the client's
# and the server's calls in flight: every message looks its call up by a C
# call). Described in _call_table.pyx.

cimport cython
from libc.stdint cimport uint64_t


@cython.final
cdef class CallTable:
    cdef readonly Py_ssize_t size
    cdef Py_ssize_t _capacity
    cdef int _shift
    cdef uint64_t _salt
    cdef uint64_t *_keys
    cdef list _values

    cdef void _allocate(self, Py_ssize_t capacity) except *
    cdef Py_ssize_t _home(self, uint64_t call_id) noexcept
    cdef Py_ssize_t _probe(self, uint64_t call_id) noexcept
    cdef Py_ssize_t _slot(self, uint64_t call_id) noexcept
    cdef object find(self, uint64_t call_id)
    cdef bint has(self, uint64_t call_id) noexcept
    cdef void put(self, uint64_t call_id, object waiter) except *
    cdef object remove(self, uint64_t call_id)
    cdef void _free(self, Py_ssize_t at) except *
    cdef void _rehash(self, Py_ssize_t capacity) except *
