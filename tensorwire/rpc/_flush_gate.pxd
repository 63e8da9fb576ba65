# The layout of FlushGate, for Cython modules that cimport it (the
# connection driver asks it for each message past a batch: a C call then).
# Described in _flush_gate.pyx.

cdef class FlushGate:
    # What counts the thread's involuntary switches (None: getrusage, in C).
    cdef object _switches
    # Long turns switched out after their early batch, and long turns sent
    # whole while the gate was shut (for tests and benches).
    cdef readonly Py_ssize_t switched
    cdef readonly Py_ssize_t held
    # This turn sent a batch early, or held one back.
    cdef bint _sent_early
    cdef bint _held
    # The switches counted when this turn's first batch went (-1: not
    # counted here).
    cdef long _mark
    cdef int _skip  # long turns to send whole before the next early batch
    cdef int _skipping  # the length of the current skip run

    cdef long _count(self) except? -2
    cpdef bint early(self) except -1
    cpdef void turn_ended(self) except *
