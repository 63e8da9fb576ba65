# The layout of SessionCore and ClientCore (the client's per-call state, C
# fields). Described in _client_core.pyx.

from .._counters cimport MethodMetrics
from ..serde._decoder cimport Decoder
from ..serde._encoder cimport Encoder
from ._calls_in_flight cimport CallsInFlight, UnaryCall
from ._driver_core cimport DriverCore
from ._slots cimport Slots


cdef class SessionCore:
    cdef object _loop
    cdef object _loop_time
    # Its ConnectionDriver (None until connected): read by C calls.
    cdef public DriverCore driver
    cdef public Slots slots
    cdef public CallsInFlight calls
    cdef public object error

    cdef double time(self) except? -1.0
    cdef bint connected(self)
    cpdef bint take_slot(self)
    cdef UnaryCall start(self, str method, double deadline, double now, tuple args,
                         dict kwargs, MethodMetrics metrics)
    cdef void end(self, UnaryCall call, str method) except *


cdef class ClientCore:
    # The ClientConfig (the ``config`` property), and what every call reads
    # of it, as C fields: its timeout and its timeline.
    cdef object _config
    cdef double _default_timeout
    cdef object _timeline
    cdef public SessionCore _session
    # The client's own codec (it runs on one event loop's thread): a call
    # each way less than serde's per-thread functions.
    cdef public Encoder _encoder
    cdef public Decoder _decoder
    cdef public object _metrics

    cpdef double _deadline(self, object timeout) except? -1.0
    cdef double _now(self) except? -1.0
    cdef double _timeout(self, object timeout) except? -1.0
    cdef SessionCore _connected(self)
    cpdef list _encode(self, object value)
    cpdef object _result(self, object message, Py_ssize_t nbytes, MethodMetrics metrics,
                         str method)
