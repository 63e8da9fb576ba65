"""The per-message work of a byte-stream connection, compiled (issue 22):
reading a socket as it becomes readable, handing the frame reader's
messages to their consumer within the fairness budget, and writing a
batch at once when nothing else is being sent.

:class:`StreamCore` is the first base of ``StreamConnection``, as
``Receiving`` is of ``UCXConnection``: it holds the connection's
per-message state in typed fields and runs the per-message methods; the
Python part (``_stream_connection.py``, ``_stream_sending.py``,
``tcp.py``) sets it up and does what happens once per connection or
rarely: the handshake, recv(), pausing, refusals, the slow path of
sending, failing and closing (``_fail``, ``_on_eof``, ``_pause_reading``,
``_refused``, ``_send_locked``, ``_finish``, ``_write_failed``,
``_closed_error``, and the socket driver's ``_recv_failed`` and
``_bytes_refused``, called from here as ordinary methods).

Before this module the same work was a dozen Python frames per read and
per write on each side of every call.
"""

from cpython.buffer cimport PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.errno cimport EAGAIN, EINTR, errno

from ._spin_gate cimport SpinGate

import os

from .._eager import start_eagerly
from ..errors import ConnectionClosedError, TensorwireError, TransportError
from ._delivery import READ_BUDGET_BYTES, READ_BUDGET_MESSAGES, consumer_failed
from ._frames import default_allocator
from ._stream_framing import Refused
from ._stream_writes import outgoing_many, write_some

__all__ = ("LIVENESS_QUANTUM", "READ_AHEAD_MESSAGES", "StreamCore")

#: Mid-message bytes show the peer alive (``last_activity``) only this many
#: at a time: any useful transfer rate passes a quantum every fraction of a
#: second, a peer trickling bytes to hold the connection open never does.
LIVENESS_QUANTUM = 64 * 1024

#: Small messages that arrived whole are handed to the queue of received
#: messages even before a recv() asks for them, up to this many: a burst of
#: small messages from one read then costs the consumer no wake-up and the
#: socket no pause and resume per message. The bound keeps a consumer that
#: does not call recv() pushing back on its sender.
READ_AHEAD_MESSAGES = 64

cdef Py_ssize_t _LIVENESS_QUANTUM = LIVENESS_QUANTUM
cdef Py_ssize_t _READ_AHEAD_MESSAGES = READ_AHEAD_MESSAGES
cdef Py_ssize_t _READ_BUDGET_MESSAGES = READ_BUDGET_MESSAGES
cdef Py_ssize_t _READ_BUDGET_BYTES = READ_BUDGET_BYTES


cdef extern from "<sys/socket.h>":
    ssize_t recv(int fd, void* buf, size_t n, int flags) nogil


cdef class StreamCore:
    """The per-message part of a stream connection (see the module docstring)."""

    # Set up by the connection.
    cdef public object _loop
    cdef public object _peer_address
    cdef public object _reader  # FrameReader
    cdef public object _queue  # RecvQueue
    cdef public object _allocator
    cdef public object _handshake
    # Set by deliver_to(): messages go there instead of to recv().
    cdef public object _receiver
    # The error that ended the connection; set once close() began.
    cdef public object _error
    cdef public bint _closing
    cdef public object _last_activity
    # Bytes received since _last_activity moved (see LIVENESS_QUANTUM).
    cdef public Py_ssize_t _unseen_bytes
    # Whether the last recv() took the connection's allocator: only then
    # are small messages allocated ahead of the next recv().
    cdef public bint _read_ahead
    # Messages this read callback may still hand out (READ_BUDGET_MESSAGES),
    # and whether a later turn was asked to go on (see _pump).
    cdef public Py_ssize_t _budget
    cdef public bint _yielded
    cdef public object _send_lock
    # The rest of a message whose sender was cancelled mid-write, or that
    # the socket did not take at once.
    cdef public object _tail
    # The non-blocking socket that plain tcp:// reads and writes here, and
    # its descriptor; None for a driver that does its own I/O (TLS), and
    # once the connection closed.
    cdef public object _sock
    cdef public int _fd
    # Plain tcp:// with TransportConfig.tcp_spin (else None): after data
    # arrives, the loop keeps polling the socket for more while the gate's
    # window is open, instead of sleeping (see _keep_polling); and whether
    # a poll is scheduled.
    cdef public SpinGate _spin_gate
    cdef public bint _spinning
    # Whether the last read looked like a ping-pong (see _on_readable).
    cdef public bint _spin_wanted
    # How many polls the spin windows took (for tests and benches).
    cdef public Py_ssize_t spin_polls
    # The counters of Connection.stats().
    cdef public Py_ssize_t messages_sent
    cdef public Py_ssize_t messages_received
    cdef public Py_ssize_t bytes_sent
    cdef public Py_ssize_t bytes_received
    cdef public Py_ssize_t device_bytes_staged

    def __cinit__(self, *args, **kwargs):
        self._budget = _READ_BUDGET_MESSAGES
        self._fd = -1

    @property
    def closed(self):
        return self._error is not None or self._closing

    # -- receiving -------------------------------------------------------------

    def _on_readable(self):
        """The socket is readable (the ``add_reader`` callback of plain
        tcp://): read it, and then poll it for more while a spin window is
        open (see ``_keep_polling``)."""
        if self._spin_gate is None:
            self._read_socket()
            return
        cdef Py_ssize_t before = self.messages_received
        try:
            self._read_socket()
        finally:
            self._spin_gate.completed()
            # Exactly one message a read: a ping-pong, which a wake-up
            # would slow down. A batch: the loop has its work. Part of a
            # message: a large one on its way, whose next bytes come when
            # the socket's window lets them, not sooner for polling.
            self._spin_wanted = self.messages_received - before == 1
            if self._spin_wanted:
                self._keep_polling()

    cdef void _read_socket(self) except *:
        """Read the socket (``recv`` straight into the reader's buffer),
        parse, and hand out what is complete, until the socket is drained,
        this turn's share is done, or the consumer stops us."""
        cdef Py_ssize_t left = _READ_BUDGET_BYTES, size
        cdef ssize_t n
        cdef int error
        cdef Py_buffer view
        reader = self._reader
        self._budget = _READ_BUDGET_MESSAGES
        # Fairness (READ_BUDGET_BYTES): reading goes on while each read fills
        # its buffer, but only so far; the rest waits for the next turn (the
        # socket stays registered: it is readable then still).
        while self._sock is not None:
            if not self._after_read():
                self._pause_reading()
                return
            try:
                buffer = reader.get_buffer()
            except TensorwireError as exc:  # the receive allocator failed
                self._fail(exc)
                return
            PyObject_GetBuffer(buffer, &view, PyBUF_WRITABLE)
            size = view.len
            with nogil:
                n = recv(self._fd, view.buf, size, 0)
                error = errno
            PyBuffer_Release(&view)
            if n < 0:
                if error == EAGAIN or error == EINTR:  # EWOULDBLOCK on Linux
                    return
                self._recv_failed(OSError(error, os.strerror(error)))
                return
            if n == 0:
                self._on_eof()
                return
            try:
                reader.buffer_updated(n)
            except TensorwireError as exc:
                self._bytes_refused(exc)
                return
            self._note_progress(n)
            left -= n
            if n < size or left <= 0:
                # The socket is most likely drained (skip the recv() that
                # would only say EAGAIN), or this turn's share is read.
                if not self._after_read() and not (n < size and self._awaits_recv()):
                    self._pause_reading()
                return

    cdef bint _awaits_recv(self) except -1:
        """Reading stopped only because the next message waits for a recv() to
        allocate it (a given allocator: no read-ahead). Once the socket is
        drained the reader may stay registered: it fires again only when
        more bytes come, and then pauses (the check at the top of
        ``_read_socket``). A consumer that posts its recv() just after the
        message came, as a collective's exchange does, so costs no pause and
        resume of the socket (the loop's watcher stopped and started, with
        their system calls: a small 2-rank allreduce, 8 B to 36 KB, made
        about four fewer per operation and rank)."""
        reader = self._reader
        return (self._error is None and self._receiver is None and not reader.paused
                and not reader.events and reader.frames_announced is not None
                and not self._queue.waiters)

    cdef void _keep_polling(self) except *:
        """Data arrived: poll for the next while the spin gate's window is
        open (one poll scheduled at a time). In a ping-pong the answer
        usually comes within it, and on this side of a wake-up it costs a
        turn of the loop instead of the kernel's (and a virtual machine
        host's) wake-up of a sleeping process."""
        if not self._spinning:
            self._spinning = True
            self._loop.call_soon(self._poll)

    def _poll(self):
        """One poll: the loop goes round once more without sleeping (a
        callback is ready), and its readiness check calls _on_readable if
        the socket is readable; another poll while the window is open."""
        self._spinning = False
        self.spin_polls += 1
        if (self._spin_wanted and self._sock is not None and not self._reader.paused
                and self._spin_gate.spinning()):
            self._keep_polling()

    cpdef bint _after_read(self) except -1:
        """Hand out what the reader produced; False: stop reading for now."""
        if not self._handshake.done() and not self._reader.awaiting_handshake:
            self._handshake.set_result(None)
        return self._pump()

    cpdef void _note_progress(self, Py_ssize_t nbytes) except *:
        """``nbytes`` more arrived (and were parsed): update ``last_activity``."""
        self.bytes_received += nbytes
        self._unseen_bytes += nbytes
        if self._reader.events or self._unseen_bytes >= _LIVENESS_QUANTUM:
            self._unseen_bytes = 0
            self._last_activity = self._loop.time()

    def _go_on(self):
        """A later turn's share of the work a read callback left (see _pump)."""
        self._yielded = False
        self._budget = _READ_BUDGET_MESSAGES
        if self._error is None:
            self._kick()

    cpdef bint _pump(self) except -1:
        """Hand out what the reader has, within this turn's budget, and
        allocate the next message for its consumer; False: stop reading
        for now (paused, out of budget, waiting for a recv(), or ended)."""
        reader = self._reader
        events = reader.events
        while not reader.paused:
            if events:
                if self._budget <= 0:
                    # Fairness: give the loop back; a later turn goes on
                    # (meanwhile the driver does not read).
                    if not self._yielded:
                        self._yielded = True
                        self._loop.call_soon(self._go_on)
                    return False
                if not self._hand_out():
                    return False
                continue
            if reader.frames_announced is None:
                return self._error is None
            if self._receiver is not None:
                if not self._allocate(self._allocator):
                    return False
                continue
            queue = self._queue
            if not queue.waiters:
                if (
                    self._read_ahead
                    and reader.message_buffered
                    and len(queue.ready) < _READ_AHEAD_MESSAGES
                ):
                    # Already received whole: take it out of the read-ahead
                    # buffer now (see READ_AHEAD_MESSAGES).
                    reader.allocate(default_allocator)
                    continue
                return False
            waiter, allocator = queue.waiters[0]
            if not self._allocate(allocator or self._allocator):
                return False
            queue.bind(waiter)
        return False

    cdef bint _hand_out(self) except -1:
        """Pass the messages at the front of the reader's events on (the
        compiled loop, ``FrameReader.hand_out``), or act on the goodbye or
        refusal there; False: the connection ended."""
        cdef Py_ssize_t handed
        reader = self._reader
        receiver = self._receiver
        try:
            handed = reader.hand_out(receiver or self._queue.deliver, self._budget)
        except Exception as exc:
            # The connection ends here, and its counts with it.
            self._fail(consumer_failed(exc, "message receiver", self._peer_address))
            return False
        if handed:
            # Whole messages are progress (last_activity), once per batch:
            # the RPC driver takes their time from here (stamps_messages).
            self._last_activity = self._loop.time()
            self._budget -= handed
            self.messages_received += handed
            return self._error is None
        # None handed out, within budget and not paused: a goodbye or a
        # refusal is at the front.
        event = reader.events.popleft()
        self._budget -= 1
        if isinstance(event, Refused):
            self.messages_received += 1
            self._refused(event.error)
            return self._error is None
        self._fail(ConnectionClosedError(f"connection closed by the peer {self._peer_address}"))
        return False

    cdef bint _allocate(self, allocator) except -1:
        """Allocate the announced message; False: that failed the connection."""
        try:
            self._reader.allocate(allocator)
        except TensorwireError as exc:
            self._fail(exc)
            return False
        except Exception as exc:
            error = TransportError(f"receive allocator failed: {exc!r}")
            error.__cause__ = exc
            self._fail(error)
            return False
        return True

    # -- sending ---------------------------------------------------------------

    def send_nowait(self, messages):
        if self._error is not None or self._closing:
            raise self._closed_error()
        buffers, nbytes = outgoing_many(messages, self)
        self._count_out(len(messages), nbytes)
        if not self._may_write_now():
            # Started now, not from a task's first step: it takes its place
            # in the send lock's queue before this returns, so a send()
            # called afterwards cannot overtake it.
            return start_eagerly(self._send_locked(buffers))
        return self._write_at_once(buffers)

    cpdef void _count_out(self, Py_ssize_t messages, Py_ssize_t nbytes) except *:
        """Count ``messages`` of ``nbytes`` in all going out."""
        self.messages_sent += messages
        self.bytes_sent += nbytes

    cpdef bint _may_write_now(self) except -1:
        """True when the socket is ours to write (plain tcp://) and nothing
        else is being sent: a message may go out at once, without the send
        lock."""
        return self._sock is not None and self._tail is None and not self._send_lock.locked()

    cpdef object _write_at_once(self, list buffers):
        """Write what the socket takes now of ``buffers`` (see
        ``_may_write_now``); the task that writes the rest, if any.

        Raises:
            ConnectionClosedError: the write failed (the connection ends).
        """
        try:
            if self._sock is None:
                raise self._closed_error()
            write_some(self._fd, buffers)
        except OSError as exc:
            raise self._write_failed(exc) from exc
        if not buffers:
            return None
        # The socket is full part-way: the rest follows from a task, and the
        # next send waits for it, as after a cancelled send.
        tail = self._tail = self._loop.create_task(self._finish(buffers, report=True))
        return tail
