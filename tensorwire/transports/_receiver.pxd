# The C-level entry of a message receiver (issue 22), for the Cython
# modules that hand messages over (the stream reader, UCX's receiving side)
# and those that take them (the RPC connection driver). Described in
# _receiver.pyx.

cdef class MessageReceiver:
    cdef void receive(self, list frames) except *
