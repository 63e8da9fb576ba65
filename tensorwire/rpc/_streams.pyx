# cython: language_level=3
"""The streams of one call, compiled, for both roles: ``CallStreams`` drives
the ITEMs, END and CREDITs of a call through its ``CallState`` (``_calls``),
which holds the rules (docs/protocol.md, "Flow control"). The client uses
it for a streamed result and a streamed argument, the server for a
streamed argument and a streamed result: there is no per-role copy of the
credit rules.

Receiving (the stream this side receives)::

    streams.open()              # grant the peer the window (first CREDIT)
    streams.receive(message, nbytes)
                                # ITEM, END, CREDIT (and on the client its
                                # call's RESPONSE or ERROR) from the peer;
                                # raises ProtocolError: the peer broke the
                                # rules, the connection should end
    streams.take()              # the next ITEM, or None: none buffered, or
                                # the stream ended (``finished``); returns
                                # credit by CallState.consume()'s rule
    await streams.wait()        # until take() has something to say
    await streams.next_item()   # take(), waiting; None at the stream's END

Sending (the stream this side sends)::

    await streams.send_item(frames)   # waits for credit; False: the call
                                      # is over, the sender stops
    await streams.send_end()

Ending::

    streams.end_with(error)     # the call failed here (connection lost,
                                # the caller's iterable raised): the
                                # receiver gets ``error`` after what is
                                # buffered, the sender at once
    streams.cancel()            # the client stops the call (CANCEL),
                                # unless it is over for the server already

``future`` is the answer of a client's unary call with a streamed argument
(``(message, nbytes)`` of its RESPONSE or ERROR), so that ``CallStreams``
is the waiter the client's calls in flight (``_calls_in_flight``) hold.
Such a call ``probing`` a method (as ``UnaryCall.probing`` does: a stream
of one item asked for) takes the first ITEM or END as its answer too: the
method streams its result, and the call ends with ``Unimplemented``
instead of waiting for a RESPONSE that never comes.
"""

cimport cython

from ._calls cimport CallState

from collections import deque

from ..errors import LocalProtocolError, Unimplemented
from . import protocol
from ._client_core import remote_error

cdef int _RESPONSE = protocol.Kind.RESPONSE
cdef int _ERROR = protocol.Kind.ERROR
cdef int _CANCEL = protocol.Kind.CANCEL
cdef int _ITEM = protocol.Kind.ITEM
cdef int _END = protocol.Kind.END
cdef int _CREDIT = protocol.Kind.CREDIT
cdef object _Item = protocol.Item
cdef object _End = protocol.End
cdef object _Credit = protocol.Credit
cdef object _Cancel = protocol.Cancel


cdef inline void _wake(object waiter) except *:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


@cython.final
cdef class CallStreams:
    """The streams of one call on either side (see the module).

    ``state`` is the call's CallState, with its REQUEST recorded before
    anything here is used; ``driver`` the connection's driver (``send``,
    ``send_soon``, ``loop``); ``name`` the method, for messages; ``metrics``
    (may be set later) counts the bytes of the streams' messages;
    ``call_id`` (may be set later: a client's call has its id once it is
    registered) is the call's id on the wire.
    """

    cdef readonly CallState state
    cdef public unsigned long long call_id
    cdef public object metrics
    cdef readonly object future
    cdef readonly bint finished
    cdef readonly bint probing
    cdef object _driver
    cdef str _name
    cdef object _items
    cdef object _waiter
    cdef object _credit_waiter
    cdef object _error

    def __init__(self, CallState state, driver, str name, metrics=None,
                 unsigned long long call_id=0, bint probing=False):
        self.state = state
        self.probing = probing
        self.call_id = call_id
        self._driver = driver
        self._name = name
        self.metrics = metrics
        self.future = driver.loop.create_future()
        self._items = deque()

    def __repr__(self):
        return (f"<CallStreams {self._name} call {self.call_id} buffered={len(self._items)} "
                f"{self.state!r}>")

    # -- receiving -------------------------------------------------------------

    def open(self):
        """Grant the peer the whole window on the stream this side
        receives (the first CREDIT)."""
        self._driver.send_soon(_Credit(self.call_id, self.state.open_window()))

    cpdef bint receive(self, message, Py_ssize_t nbytes) except -1:
        """A message of this call from the peer. Returns False when it is
        dropped (it crossed this side's end of the call in flight).

        Raises:
            ProtocolError: the peer may not send it now (an ITEM beyond its
                credit, before any, after END or on a call without that
                stream; a CREDIT below 1; anything after it ended the call).
        """
        cdef int kind = message.kind
        cdef long long count = message.count if kind == _CREDIT else 0
        if not self.state.receive(kind, count) or self._error is not None:
            return False
        if kind == _CREDIT:
            _wake(self._credit_waiter)
            return True
        if kind == _RESPONSE or kind == _ERROR or self.probing:
            # The call is over for the server, or (an ITEM or END for a
            # probing call) for the caller: a sender waiting for credit stops.
            _wake(self._credit_waiter)
            if not self.state.result_streams or self.probing:
                if not self.future.done():
                    self.future.set_result((message, nbytes))
                return True
        if self.metrics is not None:
            self.metrics.bytes_in += nbytes
        self._items.append(message)
        _wake(self._waiter)
        return True

    cpdef object take(self):
        """The next ITEM received (the message), or None when none is
        buffered or the stream has ended (then ``finished`` is True).

        Taking an ITEM returns credit to the peer by the one rule
        (``CallState.consume``).

        Raises:
            RemoteError: the peer ended the call with ERROR.
            Unimplemented: a client asked for a stream and the method
                answered with one RESPONSE.
            the error the streams ended with (``end_with``), once what was
                buffered before it has been taken.
        """
        if self.finished:
            return None
        if not self._items:
            if self._error is not None:
                self.finished = True
                raise self._error
            return None
        message = self._items.popleft()
        cdef int kind = message.kind
        cdef long long count
        if kind == _ITEM:
            count = self.state.consume()
            if count:
                self._driver.send_soon(_Credit(self.call_id, count))
            return message
        self.finished = True
        if kind == _ERROR:
            raise remote_error(message)
        if kind == _RESPONSE:
            raise Unimplemented(
                f"{self._name} answers with one RESPONSE, not a stream: call it with "
                f"call(), not stream()")
        return None  # END

    async def wait(self):
        """Until ``take()`` has something to say: an ITEM, the stream's
        END, or an error."""
        if self._items or self.finished or self._error is not None:
            return
        self._waiter = self._driver.loop.create_future()
        await self._waiter

    async def next_item(self):
        """The next ITEM, waiting for it; None at the stream's END (see
        ``take`` for what it raises)."""
        while True:
            message = self.take()
            if message is not None or self.finished:
                return message
            await self.wait()

    # -- sending ---------------------------------------------------------------

    cdef bint _may_go_on(self) except -1:
        """Whether the stream this side sends goes on: False once the call
        is over; raises the error the streams ended with."""
        if self._error is not None:
            raise self._error
        return not self.state.ended()

    async def send_item(self, list frames):
        """Send one ITEM of the stream this side sends, once the peer has
        granted credit for it. Returns False, sending nothing, when the
        call is over (the peer answered or cancelled, or its deadline
        passed): the sender stops.

        Raises:
            the error the streams ended with (``end_with``).
            Unavailable: the connection is gone.
        """
        while self.state.send_credit <= 0:
            if not self._may_go_on():
                return False
            self._credit_waiter = self._driver.loop.create_future()
            await self._credit_waiter
        if not self._may_go_on():
            return False
        self.state.send(_ITEM)
        self._count_out(await self._driver.send(_Item(self.call_id, frames)))
        return True

    async def send_end(self):
        """End the stream this side sends (END). Returns False, sending
        nothing, when the call is over.

        Raises:
            the error the streams ended with (``end_with``).
            Unavailable: the connection is gone.
        """
        if not self._may_go_on():
            return False
        self.state.send(_END)
        self._count_out(await self._driver.send(_End(self.call_id)))
        return True

    cdef void _count_out(self, Py_ssize_t nbytes) except *:
        if self.metrics is not None:
            self.metrics.bytes_out += nbytes

    # -- ending ----------------------------------------------------------------

    def end_with(self, error):
        """The call failed on this side with ``error``: what arrives later
        is dropped, a receiver gets ``error`` after the items buffered
        before it, a sender at once, and ``future`` fails with it."""
        if self._error is None:
            self._error = error
        if not self.future.done():
            self.future.set_exception(error)
            self.future.exception()  # retrieved: a stream never looks at it
        _wake(self._waiter)
        _wake(self._credit_waiter)

    def fail(self, error):
        """``end_with``, under the name the client's calls in flight use."""
        self.end_with(error)

    def cancel(self):
        """The client stops the call: CANCEL goes out unless the call is
        over for the server already (its END, ERROR or RESPONSE arrived, or
        CANCEL went out before). Returns whether it went out."""
        try:
            self.state.send(_CANCEL)
        except LocalProtocolError:
            return False
        self._driver.send_soon(_Cancel(self.call_id))
        _wake(self._credit_waiter)
        return True
