# The layout of CallState, for Cython modules that cimport it (one call's
# transitions then cost a C call, not a Python method call). The rules and
# the API are described in _calls.pyx.

cdef class CallState:
    cdef readonly int role
    cdef readonly bint arg_streams
    cdef readonly bint result_streams
    cdef readonly long long window
    cdef readonly int outcome
    cdef readonly bint ended_by_peer
    cdef readonly bint requested
    cdef readonly long long send_credit
    cdef readonly long long recv_credit
    cdef readonly long long unconsumed
    cdef readonly long long unreturned
    # The stream this side sends (client: the argument; server: the result)
    # and the one it receives, and whether each has had its END.
    cdef bint _out_streams
    cdef bint _in_streams
    cdef readonly bint out_ended
    cdef readonly bint in_ended
    cdef bint _window_open
    cdef bint _last_sent

    cdef void _setup(self, int role, bint arg_streams, bint result_streams,
                     long long window) noexcept
    cpdef send(self, int kind, long long count=*)
    cpdef bint receive(self, int kind, long long count=*) except -1
    cpdef bint expire(self)
    cpdef long long open_window(self) except -1
    cpdef long long consume(self) except -1
    cdef bint ended(self) noexcept
    cdef int _end(self, int outcome, bint by_peer) except -1
    cdef int _send_after_end(self, int kind) except -1
