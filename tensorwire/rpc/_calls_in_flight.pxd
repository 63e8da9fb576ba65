# The layout of UnaryCall and CallsInFlight, for Cython modules that cimport
# them (the client's unary call starts and ends through C calls, without a
# coroutine of its own). Described in _calls_in_flight.pyx.

cimport cython

from .._counters cimport MethodMetrics
from ._call_table cimport CallTable
from ..serde._encoder cimport Encoder
from ._calls cimport CallState
from ._driver_core cimport MessageHandler


@cython.final
cdef class DeadlineQueue:
    cdef readonly Py_ssize_t size
    # The deadline last pushed (not earlier than any queued).
    cdef readonly double last
    cdef Py_ssize_t _head
    cdef Py_ssize_t _capacity
    cdef double *_when
    cdef unsigned long long *_ids

    cdef void _allocate(self, Py_ssize_t capacity) except *
    cdef void push(self, double when, unsigned long long call_id) except *
    cdef double front_when(self) noexcept
    cdef unsigned long long front_id(self) noexcept
    cdef void pop(self) noexcept
    cdef void keep(self, CallTable pending) except *
    cdef void clear(self) noexcept


@cython.final
cdef class UnaryCall(CallState):
    cdef readonly object future
    # The call id: its key in CallsInFlight.pending (see add).
    cdef readonly unsigned long long call_id
    # The call's first of its method on the connection: it asked for a
    # stream of one item (see CallsInFlight.start).
    cdef readonly bint probing
    # The message that ended the wait, and its size (set before the future
    # is resolved).
    cdef readonly object answer
    cdef readonly Py_ssize_t answer_bytes

    @staticmethod
    cdef UnaryCall waiting_on(object future, bint probing)
    cdef void deliver(self, object message, Py_ssize_t nbytes) except *
    cdef bint may_cancel(self)


cdef class CallsInFlight(MessageHandler):
    cdef readonly CallTable pending
    cdef Encoder _encoder
    cdef object _loop
    cdef object _create_future  # the loop's create_future
    cdef object _on_other
    cdef unsigned long long _last_id
    cdef readonly list deadlines
    cdef readonly DeadlineQueue in_order
    cdef Py_ssize_t _compact_at
    cdef double _timer_at
    cdef object _timer
    cdef set _unary

    cpdef unsigned long long add(self, object waiter, double expires) except 0
    cdef unsigned long long request(self, object driver, str method, double deadline,
                                    double now, int stream_arg, tuple args, dict kwargs,
                                    object waiter, MethodMetrics metrics, double grace) except 0
    cdef UnaryCall start(self, object driver, str method, double deadline, double now,
                         tuple args, dict kwargs, MethodMetrics metrics, double grace)
    cdef void end(self, object driver, UnaryCall call, str method) except *
    cdef void _cancel_remote(self, object driver, unsigned long long call_id,
                             object waiter) except *
    cpdef bint probes(self, str method)
    cdef void _compact(self) except *
    cdef void _arm(self, double when) except *
