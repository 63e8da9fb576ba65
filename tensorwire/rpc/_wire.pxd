# The parsing of REQUEST, RESPONSE and ITEM and the encoding of a REQUEST and
# a RESPONSE or ITEM, for Cython modules that cimport them (every received
# message is parsed, the client encodes a REQUEST, the server a RESPONSE, on
# every call: a C call then). Described in _wire.pyx.

from libc.stdint cimport uint64_t

from ..serde._decoder cimport Decoder
from ..serde._encoder cimport Encoder


cdef class ValueMessage:
    # A C field: every message of a call is looked up by it.
    cdef public uint64_t call_id
    # The value's frames (``value``), made on first use for a parsed
    # message, which keeps the frames it came in (_received) and where
    # its value's serde header starts in the first (_start) instead.
    cdef object _value
    cdef list _received
    cdef Py_ssize_t _start

    cdef tuple _fields(self)
    cdef object decode_value(self, Decoder decoder)


cdef class Request(ValueMessage):
    cdef public str method
    cdef public object timeout
    cdef public int stream_arg


cdef class Response(ValueMessage):
    pass


cdef class Item(ValueMessage):
    pass


cpdef object parse_binary(object frames)
cpdef list encode_request(uint64_t call_id, str method, object timeout, int stream_arg,
                          list value)
cpdef list encode_response(uint64_t call_id, list value)
cdef list encode_request_value(uint64_t call_id, str method, object timeout, int stream_arg,
                               tuple args, dict kwargs, Encoder encoder)
cdef list encode_reply_value(int kind, uint64_t call_id, object value, Encoder encoder)
