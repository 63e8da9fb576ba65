# The layout of SpinGate, for Cython modules that cimport it (ucx://'s
# progress loop and tcp://'s reader ask it on every poll: a C call then).
# Described in _spin_gate.pyx.

# The next skip run after a failed window (rpc's FlushGate's after a
# switched-out turn too).
cdef int longer_skip(int skipping) noexcept


cdef class SpinGate:
    cdef readonly double window
    cdef readonly object clock
    # How many windows closed without an answer (for tests and benches).
    cdef readonly Py_ssize_t failed
    cdef double _opened
    cdef bint _open
    cdef bint _by_post  # the open window was opened by awaiting()
    cdef int _skip  # completions to let pass before the next window
    cdef int _skipping  # the length of the current skip run
    cdef int _post_skip  # the same for awaiting(), counted in posts
    cdef int _post_skipping

    cpdef completed(self)
    cpdef awaiting(self)
    cpdef bint spinning(self)
