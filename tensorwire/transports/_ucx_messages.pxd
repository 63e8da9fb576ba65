cdef class Outgoing:
    cdef readonly bytes header
    cdef readonly list frames
    cdef readonly Py_ssize_t nbytes
    cdef readonly bint device

    cdef _build(self, frames)


cdef class Announced:
    cdef readonly list infos
    cdef readonly dict inline
    cdef readonly object nbytes
