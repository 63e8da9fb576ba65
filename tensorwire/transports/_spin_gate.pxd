# The layout of SpinGate, for Cython modules that cimport it (ucx://'s
# progress loop and tcp://'s reader ask it on every poll: a C call then).
# Described in _spin_gate.pyx.

cdef class SpinGate:
    cdef readonly double window
    cdef readonly object clock
    # How many windows closed without an answer (for tests and benches).
    cdef readonly Py_ssize_t failed
    cdef double _opened
    cdef bint _open
    cdef int _skip  # completions to let pass before the next window
    cdef int _skipping  # the length of the current skip run

    cpdef completed(self)
    cpdef bint spinning(self)
