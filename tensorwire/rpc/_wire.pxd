# The parsing of REQUEST, RESPONSE and ITEM and the encoding of a REQUEST and
# a RESPONSE, for Cython modules that cimport them (every received message is
# parsed, the client encodes a REQUEST, the server a RESPONSE, on every call:
# a C call then). Described in _wire.pyx.

from libc.stdint cimport uint64_t


cdef class ValueMessage:
    cdef public object call_id
    cdef public object value

    cdef tuple _fields(self)


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
