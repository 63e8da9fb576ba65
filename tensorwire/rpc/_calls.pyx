"""The rules of one RPC call, sans-IO, for both roles (docs/protocol.md,
"Calls" and "Flow control"): one :class:`CallState` per call, on the client
and on the server alike, like h11's state tables.

It does no I/O and knows nothing of asyncio or sockets: the caller tells it
what it is about to send (:meth:`CallState.send`) and what arrived
(:meth:`CallState.receive`), by message kind (``protocol.Kind``: REQUEST 10,
RESPONSE 11, ERROR 12, CANCEL 13, ITEM 14, END 15, CREDIT 16) and, for
CREDIT, its count. Sending what the rules forbid raises
:class:`~tensorwire.errors.LocalProtocolError` (a bug on this side, nothing
is sent); receiving it raises :class:`~tensorwire.errors.ProtocolError`
(the peer broke the protocol; the connection should end).

API (stable; additions only)::

    state = CallState(role, arg_streams=False, result_streams=False, window=0)
    state.send(kind, count=0)        # None, or raises LocalProtocolError
    state.receive(kind, count=0)     # True: deliver it; False: drop it
                                     # (it crossed this side's own end);
                                     # raises ProtocolError
    state.expire()                   # the deadline passed: True if that
                                     # ended the call
    state.open_window()              # the first CREDIT count to send
    state.consume()                  # the consumer took one received ITEM:
                                     # the CREDIT count to send now, or 0
    state.done                       # the call has its terminal outcome
    state.outcome                    # OPEN, RESPONDED, ENDED, FAILED,
                                     # CANCELLED or EXPIRED
    # read-only: role, arg_streams, result_streams, window, ended_by_peer,
    # requested, send_credit, recv_credit, unconsumed, unreturned,
    # out_ended (the stream this side sends had its END), in_ended (the
    # stream it receives had its END)

``role`` is :data:`CLIENT` or :data:`SERVER`. ``arg_streams``: the request
has a streamed argument (ITEMs and END client to server); ``result_streams``:
the method streams its result (ITEMs and END server to client; without it
the server answers RESPONSE). ``window`` is how many ITEMs this side lets
its peer send ahead on the stream it receives (needed only when it
receives one).

The rules:

* The client sends REQUEST first, once; nothing else comes before it.
* A stream's sender sends an ITEM only while it holds credit its receiver
  granted (CREDIT; the first grant is :meth:`~CallState.open_window`), and
  nothing on that stream after its END. The receiver returns credit by one
  rule, :meth:`~CallState.consume`: once the consumer has taken half the
  window (at least one item), it grants that many again.
* Every call has exactly one terminal outcome on each side: RESPONSE
  (unary), END of the result stream, ERROR, the client's CANCEL, or the
  deadline (:meth:`~CallState.expire`, this side's own timer). The END of
  a streamed argument is not terminal.
* After its outcome a side sends nothing, with one exception: after its
  deadline the client may send one CANCEL and the server one ERROR (its
  DEADLINE_EXCEEDED). What arrives after an outcome this side decided
  (CANCEL sent, RESPONSE/END/ERROR sent, deadline) is dropped: it may have
  crossed that end in flight. What arrives after an outcome the peer
  decided (a RESPONSE, END or ERROR received; a CANCEL received) is a
  ProtocolError: the peer said the call was over.
* The server may answer (RESPONSE, ERROR, its END) before the streamed
  argument has ended; the client then stops sending it.
* The client cannot know whether a method streams its result: a client
  that asked for a stream of a unary method grants CREDIT, which the
  server drops (``receive`` returns False), and gets a RESPONSE, which
  ends its call (RESPONDED) for the caller to report the mismatch.

The unary calls of both roles go through here too, so the transitions a
unary call takes (construct, REQUEST, RESPONSE) are a few C comparisons;
the error paths, which build messages, are out of line.
"""

cimport cython

from tensorwire.errors import ConfigError, LocalProtocolError, ProtocolError

# Message kinds: protocol.Kind's values (tests check they agree).
cdef enum:
    _REQUEST = 10
    _RESPONSE = 11
    _ERROR = 12
    _CANCEL = 13
    _ITEM = 14
    _END = 15
    _CREDIT = 16

cdef enum:
    _CLIENT = 0
    _SERVER = 1

cdef enum:
    _OPEN = 0
    _RESPONDED = 1
    _ENDED = 2
    _FAILED = 3
    _CANCELLED = 4
    _EXPIRED = 5

#: The roles.
CLIENT = _CLIENT
SERVER = _SERVER
#: The outcomes of a call: none yet, then exactly one of the others.
OPEN = _OPEN
RESPONDED = _RESPONDED
ENDED = _ENDED
FAILED = _FAILED
CANCELLED = _CANCELLED
EXPIRED = _EXPIRED
#: The largest count one CREDIT may grant (and the largest window).
MAX_CREDIT = 2**31 - 1

_KINDS = {_REQUEST: "REQUEST", _RESPONSE: "RESPONSE", _ERROR: "ERROR",
          _CANCEL: "CANCEL", _ITEM: "ITEM", _END: "END", _CREDIT: "CREDIT"}
_OUTCOMES = ("open", "answered (RESPONSE)", "ended (END)", "failed (ERROR)",
             "cancelled", "past its deadline")
_ROLES = ("client", "server")


cdef str _kind_name(int kind):
    return _KINDS.get(kind, f"message kind {kind}")


cdef object _local(CallState state, int kind, str why):
    return LocalProtocolError(
        f"the {_ROLES[state.role]} may not send {_kind_name(kind)}: {why}")


cdef object _remote(CallState state, int kind, str why):
    return ProtocolError(
        f"the {_ROLES[1 - state.role]} may not send {_kind_name(kind)}: {why}")


# Not final: the client's UnaryCall (_calls_in_flight) derives from it, so
# that a plain unary call in flight is one object.
cdef class CallState:
    """One call's state, on either side (see the module docstring).

    Raises:
        ConfigError: a role other than CLIENT or SERVER, or a window
            outside 1..MAX_CREDIT for a side that receives a stream.
    """

    def __init__(self, int role, bint arg_streams=False, bint result_streams=False,
                  long long window=0):
        if role != _CLIENT and role != _SERVER:
            raise ConfigError(f"a call's role is CLIENT (0) or SERVER (1), not {role}")
        if (result_streams if role == _CLIENT else arg_streams) and not 0 < window <= MAX_CREDIT:
            raise ConfigError(f"a stream's window must be 1..{MAX_CREDIT} items, not {window}")
        self._setup(role, arg_streams, result_streams, window)

    cdef void _setup(self, int role, bint arg_streams, bint result_streams,
                     long long window) noexcept:
        self.role = role
        self.arg_streams = arg_streams
        self.result_streams = result_streams
        # Which stream is whose: the rules of ITEM, END and CREDIT are the
        # same for both roles once "this side's outgoing stream" is known.
        if role == _CLIENT:
            self._out_streams, self._in_streams = arg_streams, result_streams
        else:
            self._out_streams, self._in_streams = result_streams, arg_streams
        self.window = window

    @property
    def done(self):
        """True once the call has its terminal outcome."""
        return self.ended()

    cdef bint ended(self) noexcept:
        """``done``, for a C caller."""
        return self.outcome != _OPEN

    def __repr__(self):
        return (f"<CallState {_ROLES[self.role]} {_OUTCOMES[self.outcome]} "
                f"send_credit={self.send_credit} recv_credit={self.recv_credit}>")

    cdef int _end(self, int outcome, bint by_peer) except -1:
        self.outcome = outcome
        self.ended_by_peer = by_peer
        return 0

    cpdef send(self, int kind, long long count=0):
        """This side is about to send a message of ``kind`` (CREDIT: ``count``).

        Raises:
            LocalProtocolError: the rules forbid it now (nothing changes).
        """
        if self.outcome != _OPEN:
            self._send_after_end(kind)
            return
        if not self.requested:
            if kind == _REQUEST and self.role == _CLIENT:
                self.requested = True
                return
            raise _local(self, kind, "the call has no REQUEST yet")
        if kind == _ITEM:
            if not self._out_streams:
                raise _local(self, kind, "this side sends no stream on this call")
            if self.out_ended:
                raise _local(self, kind, "its stream has ended")
            if self.send_credit <= 0:
                raise _local(self, kind, "no credit")
            self.send_credit -= 1
        elif kind == _END:
            if not self._out_streams:
                raise _local(self, kind, "this side sends no stream on this call")
            if self.out_ended:
                raise _local(self, kind, "its stream has ended already")
            self.out_ended = True
            if self.role == _SERVER:
                self._end(_ENDED, False)
        elif kind == _CREDIT:
            if not self._in_streams:
                raise _local(self, kind, "this side receives no stream on this call")
            if self.in_ended:
                raise _local(self, kind, "the stream it receives has ended")
            if not 0 < count <= MAX_CREDIT:
                raise _local(self, kind, f"a count of {count}")
            self.recv_credit += count
        elif self.role == _CLIENT:
            if kind != _CANCEL:
                raise _local(self, kind, "the client sends it once, first"
                             if kind == _REQUEST else "only the server sends it")
            self._end(_CANCELLED, False)
        else:
            if kind == _RESPONSE:
                if self.result_streams:
                    raise _local(self, kind, "the result streams (ITEMs, then END)")
                self._end(_RESPONDED, False)
            elif kind == _ERROR:
                self._end(_FAILED, False)
            else:
                raise _local(self, kind, "only the client sends it")

    cdef int _send_after_end(self, int kind) except -1:
        # The one message a side may send after its own deadline.
        if (self.outcome == _EXPIRED and self.requested and not self._last_sent
                and kind == (_CANCEL if self.role == _CLIENT else _ERROR)):
            self._last_sent = True
            return 0
        raise _local(self, kind, f"the call is {_OUTCOMES[self.outcome]}")

    cpdef bint receive(self, int kind, long long count=0) except -1:
        """A message of ``kind`` (CREDIT: ``count``) arrived for this call.

        Returns True when it is for the call (deliver it), False when it
        crossed this side's own end in flight (drop it).

        Raises:
            ProtocolError: the peer may not send it now.
        """
        if self.outcome != _OPEN:
            if self.ended_by_peer:
                raise _remote(self, kind, f"the call is {_OUTCOMES[self.outcome]}")
            return False
        if not self.requested:
            if kind == _REQUEST and self.role == _SERVER:
                self.requested = True
                return True
            raise _remote(self, kind, "the call has no REQUEST yet")
        if kind == _ITEM:
            if not self._in_streams:
                raise _remote(self, kind, "it sends no stream on this call")
            if self.in_ended:
                raise _remote(self, kind, "its stream has ended")
            if self.recv_credit <= 0:
                raise _remote(self, kind, "it has no credit left")
            self.recv_credit -= 1
            self.unconsumed += 1
        elif kind == _END:
            if not self._in_streams:
                raise _remote(self, kind, "it sends no stream on this call")
            if self.in_ended:
                raise _remote(self, kind, "its stream has ended already")
            self.in_ended = True
            if self.role == _CLIENT:
                self._end(_ENDED, True)
        elif kind == _CREDIT:
            if not 0 < count <= MAX_CREDIT:
                raise _remote(self, kind, f"a count of {count}")
            if not self._out_streams:
                if self.role == _SERVER:
                    # A client that asked for a stream of a unary method
                    # grants credit for it: it cannot know; the RESPONSE
                    # tells it.
                    return False
                raise _remote(self, kind, "this side sends no stream on this call")
            # Also after this side's END: the grant may have crossed it.
            self.send_credit += count
        elif self.role == _SERVER:
            if kind != _CANCEL:
                raise _remote(self, kind, "the call has its REQUEST already"
                              if kind == _REQUEST else "only the server sends it")
            self._end(_CANCELLED, True)
        else:
            if kind == _RESPONSE:
                # Also when this side asked for a stream: the method turned
                # out to be unary (the caller reports the mismatch).
                self._end(_RESPONDED, True)
            elif kind == _ERROR:
                self._end(_FAILED, True)
            else:
                raise _remote(self, kind, "only the client sends it")
        return True

    cpdef bint expire(self):
        """This side's deadline passed: the call ends (EXPIRED) unless it
        had its outcome already. Returns True if this ended it."""
        if self.outcome != _OPEN:
            return False
        self._end(_EXPIRED, False)
        return True

    cpdef long long open_window(self) except -1:
        """Grant the peer the whole window on the stream this side
        receives: returns the count of the first CREDIT to send.

        Raises:
            LocalProtocolError: no such stream, no REQUEST yet, the call or
                the stream has ended, or the window is open already.
        """
        if not self._in_streams or not self.requested or self._window_open:
            raise _local(self, _CREDIT, "no stream to open, or no REQUEST yet, or "
                         "its window is open already")
        self.send(_CREDIT, self.window)
        self._window_open = True
        return self.window

    cpdef long long consume(self) except -1:
        """The consumer took one received ITEM. Returns the count of the
        CREDIT to send now, 0 for none.

        The one rule of credit return: after the consumer has taken half
        the window (at least one item) since the last grant, it grants that
        many again; none once the stream or the call has ended.

        Raises:
            LocalProtocolError: no received ITEM is left to consume.
        """
        cdef long long count
        if self.unconsumed <= 0:
            raise _local(self, _CREDIT, "it consumed more ITEMs than it received")
        self.unconsumed -= 1
        if self.outcome != _OPEN or self.in_ended:
            return 0
        self.unreturned += 1
        if self.unreturned < self.window // 2:
            return 0
        count = self.unreturned
        self.unreturned = 0
        self.recv_credit += count
        return count
