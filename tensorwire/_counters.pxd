# The layout of MethodMetrics and record_call, for Cython modules that
# cimport them (the RPC client and server record every call: a C call then,
# not a Python one with its arguments boxed). Described in _counters.pyx.

cdef class MethodMetrics:
    cdef public Py_ssize_t errors
    cdef public Py_ssize_t bytes_in
    cdef public Py_ssize_t bytes_out
    cdef public double seconds
    cdef public list buckets

    cpdef void observe(self, double seconds, bint error) except *


cpdef void record_call(MethodMetrics metrics, object timeline, str name, str category,
                       double started, bint error, dict args=*) except *
