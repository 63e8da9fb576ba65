# The layout of Slots, for Cython modules that cimport it (the client takes
# and gives back a slot on every call: C calls then). Described in _slots.pyx.

cdef class Slots:
    cdef public Py_ssize_t free
    cdef object _loop
    cdef readonly object waiters

    cpdef bint locked(self)
    cpdef bint try_acquire(self)
    cpdef void release(self) except *
