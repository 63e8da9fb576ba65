# The encoding of a REQUEST, for Cython modules that cimport it (the client
# encodes one on every call: a C call then). Described in _wire.pyx.

from libc.stdint cimport uint64_t


cpdef list encode_request(uint64_t call_id, str method, object timeout, int stream_arg,
                          list value)
