# cython: language_level=3
"""The per-message work of a connection driver, compiled: delivering each
received message to the session, and the outbox that hands everything
posted in one loop iteration to the transport together, bounded by
``max_unsent`` (issue 21). ``ConnectionDriver`` (``_connection_driver.py``)
adds what is not per message: starting, closing, the read loop and the
liveness watchdog.

Messages come in and go on by C calls: the transport hands each one to the
driver (a ``MessageReceiver``, its ``receive``), and the driver to the
session's handler where that is a ``MessageHandler`` (its ``take``: the
server's ``RequestDispatch``, the client's ``CallsInFlight``).
"""

from ..transports._receiver cimport MessageReceiver
from ._flush_gate cimport FlushGate
from ._wire cimport parse_binary

import asyncio
import functools
import logging

import numpy as np

from ..errors import ConnectionClosedError, TensorwireError, TransportError, Unavailable
from . import protocol

logger = logging.getLogger("tensorwire.rpc._connection_driver")

#: Messages posted in one loop turn are written together, this many at a time
#: while the flush gate is open (see ``DriverCore.post_frames``).
BATCH = 32

cdef object _ndarray = np.ndarray
cdef object _parse = protocol.parse
cdef object _encode = protocol.encode


cpdef Py_ssize_t frames_nbytes(list frames) except -1:
    """The bytes of a message's frames."""
    cdef Py_ssize_t total = 0
    for frame in frames:
        kind = type(frame)
        # What serde and the transports hand us, without a memoryview each.
        if kind is bytes or kind is bytearray:
            total += len(frame)
        elif kind is _ndarray or kind is memoryview:
            total += frame.nbytes
        else:
            try:
                total += memoryview(frame).nbytes
            except TypeError:  # a device buffer
                total += int(getattr(frame, "nbytes", 0))
    return total


cdef inline object _parse_message(list frames):
    # The binary kinds straight from _wire (every call), the rest through
    # protocol.parse (msgpack; it refuses an empty message too).
    message = parse_binary(frames) if frames else None
    return _parse(frames) if message is None else message


cpdef object unavailable(object error):
    """``error`` as the ``Unavailable`` its waiters get."""
    if isinstance(error, Unavailable):
        return error
    return Unavailable(f"connection lost: {error}")


cpdef void fail_waiter(object waiting, object error) except *:
    """Fail ``waiting`` (a future or None) with ``unavailable(error)``."""
    if waiting is not None and not waiting.done():
        waiting.set_exception(unavailable(error))
        waiting.exception()  # retrieved: its sender may have stopped waiting


cdef class MessageHandler:
    """A session's handler of its connection's messages, which the driver
    calls by a C call (see the module); a subclass implements ``take``."""

    cdef void take(self, object message, Py_ssize_t nbytes) except *:
        """Take one parsed message of ``nbytes`` on the wire."""
        raise NotImplementedError(f"{type(self).__name__} does not implement take()")

    def __call__(self, message, Py_ssize_t nbytes):
        """``take(message, nbytes)``, for a caller in Python."""
        self.take(message, nbytes)


cdef class DriverCore(MessageReceiver):
    """The outbox and the delivery of one connection (see the module)."""

    # Its fields are declared in _driver_core.pxd.

    def __init__(self, conn, on_message, *, Py_ssize_t max_unsent):
        self.conn = conn
        self._on_message = on_message
        self.loop = asyncio.get_running_loop()
        self._last_seen = self.loop.time()
        self._outbox = []
        self._eager = not conn.coalesces_sends
        self.flush_gate = FlushGate()
        self._stamp_messages = not conn.stamps_messages
        self._high_water = max_unsent
        self._low_water = max_unsent // 4

    @property
    def closed(self) -> bool:
        return self.error is not None

    # -- sending ---------------------------------------------------------------

    def post(self, message):
        """Queue ``message`` for sending without waiting; returns its size.

        Messages of one event-loop turn are handed to the transport
        together, every ``BATCH`` messages and at the end of the turn. Where
        that saves work (``conn.coalesces_sends``: tcp://, one system call
        for many small messages, and on a VM a loopback write costs tens of
        microseconds), the turn's first message waits for the others too;
        elsewhere (ucx://, one post per message whatever the batch) it goes
        at once, so that the peer starts on it while this side works on.
        While the transport cannot take more (a full socket), messages wait
        here, in order. Gathering a whole turn before writing anything made
        the two ends take turns instead of working at the same time on two
        CPUs; on one CPU the early batch switches to the peer in the middle
        of the turn instead, and then ``flush_gate`` (``_flush_gate``) holds
        the batches of the next long turns to their end.

        Raises:
            Unavailable: the connection is gone.
        """
        return self.post_frames(_encode(message))

    cpdef Py_ssize_t post_frames(self, list frames) except -1:
        """``post`` for a message already encoded (``protocol.encode_request``
        and ``encode_response``: the hot paths make no message object)."""
        if self.error is not None:
            raise unavailable(self.error)
        cdef Py_ssize_t nbytes = frames_nbytes(frames)
        self._outbox_bytes += nbytes
        self._unsent += nbytes
        if self._unsent > self._high_water and not self.reading_paused:
            self._pause_reading()
        self._outbox.append(frames)
        self._turn_posts += 1
        if self._writing is None:
            if self._turn is None:
                self._turn_posts = 1  # this post opens the turn
                self._turn = self.loop.call_soon(self._end_turn)
                if self._eager:
                    self._flush()
            elif len(self._outbox) >= BATCH and self.flush_gate.early(self._turn_posts):
                self._flush()
        return nbytes

    cdef void _pause_reading(self) except *:
        """Our output to the peer is over the bound: take no more of its
        messages (each may add a reply) until it is under the low-water
        mark. A peer that never reads so holds at most the bound."""
        self.reading_paused = True
        logger.debug("%s: %d bytes unsent, reading paused", self.conn.peer_address,
                     self._unsent)
        self.conn.pause_reading()

    cpdef void _sent(self, Py_ssize_t nbytes) except *:
        """``nbytes`` of the posted output went out (or were dropped)."""
        self._unsent -= nbytes
        if self.reading_paused and self._unsent <= self._low_water:
            self.reading_paused = False
            self._last_seen = self.loop.time()  # we were not listening
            drained, self._drained = self._drained, None
            if drained is not None and not drained.done():
                drained.set_result(None)
            if self.error is None:
                self.conn.resume_reading()

    def _end_turn(self):
        self._turn = None
        self.flush_gate.turn_ended(self._turn_posts)
        self._turn_posts = 0
        if self._outbox and self._writing is None and self.error is None:
            self._flush()

    cpdef void _flush(self) except *:
        batch, self._outbox = self._outbox, []
        flushed, self._flushed = self._flushed, None
        cdef Py_ssize_t nbytes = self._outbox_bytes
        self._outbox_bytes = 0
        try:
            writing = self.conn.send_nowait(batch)
        except TensorwireError as exc:
            # Closed, or a frame the transport cannot send (a bug: serde
            # makes only contiguous buffers): either way the stream is done.
            fail_waiter(flushed, exc)
            self.close_with(exc)
            return
        if writing is None:
            self._sent(nbytes)
            if flushed is not None:
                flushed.set_result(None)
            return
        self._writing, self._writing_flushed = writing, flushed
        writing.add_done_callback(functools.partial(self._written, nbytes))

    def _written(self, Py_ssize_t nbytes, writing):
        self._sent(nbytes)
        flushed, self._writing, self._writing_flushed = self._writing_flushed, None, None
        error = (ConnectionClosedError("send cancelled") if writing.cancelled()
                 else writing.exception())
        if error is None:
            if flushed is not None:
                flushed.set_result(None)
            if self._outbox and self.error is None:
                self._flush()
            return
        fail_waiter(flushed, error)
        self.close_with(error if isinstance(error, TensorwireError)
                        else TransportError(f"send failed: {error!r}"))

    # -- receiving -------------------------------------------------------------

    def _deliver(self, list frames):
        """Parse one received message and hand it to the session."""
        self.receive(frames)

    cdef void receive(self, list frames) except *:
        """``_deliver``, by a C call from the transport (``MessageReceiver``)."""
        if self.error is not None:
            return
        if self._stamp_messages:
            # Elsewhere the transport's last_activity, read by the
            # watchdog, already moved for this message: no clock read per
            # message.
            self._last_seen = self.loop.time()
        handler = self._on_message
        try:
            message = _parse_message(frames)
            if isinstance(handler, MessageHandler):
                (<MessageHandler>handler).take(message, frames_nbytes(frames))
            else:
                handler(message, frames_nbytes(frames))
        except TensorwireError as exc:
            logger.warning("closing connection to %s: %s", self.conn.peer_address, exc)
            self.close_with(exc)
        except Exception as exc:
            logger.exception("RPC session on %s failed", self.conn.peer_address)
            self.close_with(TransportError(f"RPC session failed: {exc!r}"))
