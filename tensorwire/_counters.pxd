# The layout of MethodMetrics and record_call, for Cython modules that
# cimport them (the RPC client and server record every call: a C call then,
# not a Python one with its arguments boxed), and now(), the clock they
# time calls with. Described in _counters.pyx.

cdef enum:
    # Latency buckets: 9 decades of 16, and one below the first edge.
    N_BUCKETS = 9 * 16 + 1

cdef class MethodMetrics:
    cdef public Py_ssize_t errors
    cdef public Py_ssize_t bytes_in
    cdef public Py_ssize_t bytes_out
    cdef public double seconds
    cdef Py_ssize_t _counts[N_BUCKETS]

    cpdef void observe(self, double seconds, bint error) except *


cpdef double now() noexcept

cpdef void record_call(MethodMetrics metrics, object timeline, str name, str category,
                       double started, bint error, dict args=*) except *
