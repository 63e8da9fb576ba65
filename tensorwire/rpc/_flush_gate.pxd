# The layout of FlushGate, for Cython modules that cimport it (the
# connection driver asks it for each message past a batch: a C call then).
# Described in _flush_gate.pyx.

cdef class FlushGate:
    # What counts the thread's involuntary switches (None: getrusage, in C).
    cdef object _switches
    # Long turns switched out after their early batch, those whose early
    # batch the peer answered together with the rest, and long turns sent
    # whole while the gate was shut (for tests and benches).
    cdef readonly Py_ssize_t switched
    cdef readonly Py_ssize_t unsplit
    cdef readonly Py_ssize_t held
    # This turn sent a batch early, or held one back.
    cdef bint _sent_early
    cdef bint _held
    # The switches counted when this turn's first batch went (-1: not
    # counted here).
    cdef long _mark
    # The messages of the last turn whose early batch waits to be judged
    # by the next turn that posts (0: none waits).
    cdef Py_ssize_t _judged
    # The messages this turn had posted when its first early batch went.
    cdef Py_ssize_t _early_posts
    cdef int _skip  # long turns to send whole before the next early batch
    cdef int _skipping  # the length of the current skip run

    cdef long _count(self) except? -2
    cpdef bint early(self, Py_ssize_t posted) except -1
    cpdef void turn_ended(self, Py_ssize_t posted) except *
    cdef void _shut(self) noexcept
