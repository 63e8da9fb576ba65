# The layout of DriverCore, for Cython modules that cimport it (the server's
# dispatch posts every answer: a C call then, not a Python method call), and
# of MessageHandler, which the sessions' message handlers derive from (each
# message reaches them by a C call). Described in _driver_core.pyx.

from ..transports._receiver cimport MessageReceiver
from ._flush_gate cimport FlushGate


cdef class MessageHandler:
    cdef void take(self, object message, Py_ssize_t nbytes) except *


cdef class DriverCore(MessageReceiver):
    cdef public object conn
    cdef public object loop
    cdef public object error
    cdef public bint reading_paused
    cdef public double _last_seen
    # Note each delivered message's time in _last_seen: the transport does
    # not (not conn.stamps_messages; its last_activity covers them else).
    cdef public bint _stamp_messages
    # The session's handler of each message: a MessageHandler, or any
    # callable of (message, nbytes).
    cdef public object _on_message
    # Messages not yet handed to the transport, and the future of their
    # senders (made when someone waits for them).
    cdef public list _outbox
    cdef public object _flushed
    # Set while the transport writes a batch it could not take at once,
    # with the future of that batch's senders.
    cdef public object _writing
    cdef public object _writing_flushed
    cdef public object _turn
    # Messages posted in this turn (from the post that opened it to _end_turn).
    cdef public Py_ssize_t _turn_posts
    # Write a turn's first message at once (see post_frames()).
    cdef public bint _eager
    # Whether a long turn's batches go as they fill (see post_frames()).
    cdef public FlushGate flush_gate
    # Backpressure (see _sent): bytes posted and not yet written, those of
    # them in the outbox, and the bound with its low-water mark.
    cdef public Py_ssize_t _unsent
    cdef public Py_ssize_t _outbox_bytes
    cdef public Py_ssize_t _high_water
    cdef public Py_ssize_t _low_water
    # Set when reading resumes: senders that wait for the output to drain.
    cdef public object _drained

    cpdef Py_ssize_t post_frames(self, list frames) except -1
    cdef void _pause_reading(self) except *
    cpdef void _sent(self, Py_ssize_t nbytes) except *
    cpdef void _flush(self) except *
