# cython: language_level=3
"""The client's calls in flight on one connection, compiled: call id -> what
waits for the answer, the REQUEST that starts a call, the RESPONSE that
resolves it, and the calls' deadlines on one loop timer.

A plain unary call is a ``UnaryCall`` here: a ``CallState`` (``_calls``),
which every message of the call goes through, with its future, resolved
(with None) once its answer and the answer's size are kept on it
(``answer``, ``answer_bytes``: no tuple per call). The client's ``_call``
starts one (``CallsInFlight.start``), awaits its future and ends it
(``CallsInFlight.end``): C calls, no coroutine of their own. Any other
waiter (a stream's record, see ``_streams.CallStreams``) has a ``future``
and a ``fail(error)`` and gets its messages from the session's
``on_other``, as does every message that belongs to no unary call.

A client cannot know whether a method it calls unary streams its result
(docs/protocol.md, "Flow control"): the first unary call of each method on
a connection asks for a stream of one item (``UnaryCall.probing``: a
CREDIT of 1 after its REQUEST). A unary method drops the credit and
answers RESPONSE, and its later calls ask for nothing; a streaming method
sends its first ITEM (or its END), which ends the call here with
``Unimplemented`` and a CANCEL, instead of a wait for a RESPONSE that never
comes.
"""

cimport cython
from cpython.mem cimport PyMem_Free, PyMem_Malloc

from .._counters cimport MethodMetrics
from ._call_table cimport CallTable
from ._calls cimport CallState
from ._driver_core cimport DriverCore, MessageHandler
from ..serde._encoder cimport Encoder
from ._wire cimport Response, ValueMessage, encode_request_value

import asyncio
from heapq import heapify, heappop, heappush

from ..errors import DeadlineExceeded, Unavailable
from . import protocol
from ._calls import CLIENT, EXPIRED, RESPONDED

cdef int _CLIENT = CLIENT
cdef int _EXPIRED = EXPIRED
cdef int _RESPONDED = RESPONDED
cdef int _REQUEST = protocol.Kind.REQUEST
cdef int _RESPONSE = protocol.Kind.RESPONSE
cdef int _CANCEL = protocol.Kind.CANCEL
cdef int _CREDIT = protocol.Kind.CREDIT
cdef object _Cancel = protocol.Cancel
cdef object _Credit = protocol.Credit
cdef object _CancelledError = asyncio.CancelledError
cdef object _timeout_at = asyncio.timeout_at

#: The longest timeout a request carries: a longer one, infinity included,
#: is this (half the protocol's bound: "no deadline" for any practical use).
LONGEST = protocol.MAX_TIMEOUT / 2
cdef double _LONGEST = LONGEST
cdef double _INF = float("inf")


@cython.final
cdef class DeadlineQueue:
    """Deadlines in increasing order, first in, first out: (when, call id)
    in a ring of two C arrays, which doubles when full. ``push`` takes a
    deadline not earlier than ``last`` (the caller checks)."""

    # Its fields are declared in _calls_in_flight.pxd: size, last, _head,
    # _capacity (a power of two), _when, _ids.

    def __cinit__(self):
        self._allocate(64)

    def __dealloc__(self):
        PyMem_Free(self._when)
        PyMem_Free(self._ids)

    def __len__(self):
        return self.size

    cdef void _allocate(self, Py_ssize_t capacity) except *:
        """Fresh arrays of ``capacity`` entries, which take over those queued."""
        cdef double *when = <double *>PyMem_Malloc(capacity * sizeof(double))
        cdef unsigned long long *ids = <unsigned long long *>PyMem_Malloc(
            capacity * sizeof(unsigned long long))
        if when == NULL or ids == NULL:
            PyMem_Free(when)
            PyMem_Free(ids)
            raise MemoryError()
        cdef Py_ssize_t i, at
        for i in range(self.size):
            at = (self._head + i) & (self._capacity - 1)
            when[i] = self._when[at]
            ids[i] = self._ids[at]
        PyMem_Free(self._when)
        PyMem_Free(self._ids)
        self._when, self._ids = when, ids
        self._head = 0
        self._capacity = capacity

    cdef void push(self, double when, unsigned long long call_id) except *:
        if self.size == self._capacity:
            self._allocate(2 * self._capacity)
        cdef Py_ssize_t at = (self._head + self.size) & (self._capacity - 1)
        self._when[at] = when
        self._ids[at] = call_id
        self.size += 1
        self.last = when

    cdef inline double front_when(self) noexcept:
        return self._when[self._head]

    cdef inline unsigned long long front_id(self) noexcept:
        return self._ids[self._head]

    cdef inline void pop(self) noexcept:
        self._head = (self._head + 1) & (self._capacity - 1)
        self.size -= 1

    cdef void keep(self, CallTable pending) except *:
        """Drop the entries whose call id is not in ``pending``."""
        cdef Py_ssize_t i, at, kept = 0, mask = self._capacity - 1
        for i in range(self.size):
            at = (self._head + i) & mask
            if pending.has(self._ids[at]):
                self._when[(self._head + kept) & mask] = self._when[at]
                self._ids[(self._head + kept) & mask] = self._ids[at]
                kept += 1
        self.size = kept

    cdef void clear(self) noexcept:
        self.size = 0


cdef inline void _fail(object future, object error) except *:
    if not future.done():
        future.set_exception(error)
        future.exception()  # retrieved: a stream may never look at it


@cython.final
cdef class UnaryCall(CallState):
    """A plain unary call in flight: its state (a client's ``CallState``,
    which every message of the call goes through) and its future, one
    object."""

    # Its fields are declared in _calls_in_flight.pxd: future, call_id,
    # probing, answer, answer_bytes.

    @staticmethod
    cdef UnaryCall waiting_on(object future, bint probing):
        """A call whose caller waits on ``future``; made by C calls (the
        type's allocator, no ``__init__`` to parse arguments for)."""
        cdef UnaryCall call = UnaryCall.__new__(UnaryCall)
        call.future = future
        # A probing call asks for a stream of one item (see the module);
        # the arguments CallState.__init__ checks are valid here.
        call._setup(_CLIENT, False, probing, 1 if probing else 0)
        call.probing = probing
        return call

    cdef void deliver(self, object message, Py_ssize_t nbytes) except *:
        """A message of this call from the server; the state machine says
        whether it ends the wait (a message after the call's end is dropped,
        one the server may not send is a ProtocolError). A probing call's
        wait ends with the stream's first ITEM or END too: its caller
        reports the mismatch."""
        cdef int kind = _RESPONSE if type(message) is Response else message.kind
        if self.receive(kind) and not self.future.done():
            self.answer = message
            self.answer_bytes = nbytes
            self.future.set_result(None)

    cdef bint may_cancel(self):
        """Whether the server is to hear of this call's end (CANCEL): not
        after its answer, once after its deadline."""
        return not self.ended() or self.outcome == _EXPIRED


# Its typed field in_order is used by fail_all(), which runs from a
# closing session, maybe during a GC teardown: the GC must not set it to
# None first (a C call on it would not check), as asyncpg's protocol.
@cython.no_gc_clear
cdef class CallsInFlight(MessageHandler):
    """The calls in flight on one client connection (see the module)."""

    # Its fields are declared in _calls_in_flight.pxd. Deadlines are
    # (when, call id) entries, with one loop timer for the earliest instead
    # of one per call (a timer costs several times a heap push). Calls of
    # one client mostly share a timeout, so their deadlines come in order:
    # those not earlier than the last one queued go to in_order (a C ring,
    # no Python object each), the others to the heap deadlines. The
    # earliest is at the front of one of the two. Entries of calls that
    # ended leave the front of in_order as new calls come (calls with one
    # timeout mostly end in order too), and the rest when the two grow
    # past _compact_at. _unary: the methods that answered a probing call
    # with RESPONSE.

    def __init__(self, loop, on_other, Encoder encoder=None):
        self.pending = CallTable()
        # Encodes the REQUESTs' arguments (see ``request``).
        self._encoder = Encoder() if encoder is None else encoder
        self._loop = loop
        self._create_future = loop.create_future  # bound once: no lookup per call
        self._on_other = on_other
        self.deadlines = []
        self.in_order = DeadlineQueue()
        self._compact_at = 64
        self._timer_at = float("inf")
        self._unary = set()

    cpdef unsigned long long add(self, object waiter, double expires) except 0:
        """Register ``waiter`` under a new call id, to fail with TimeoutError
        at ``expires`` (loop time) unless it has ended by then. Returns the
        call id."""
        self._last_id += 1
        cdef unsigned long long call_id = self._last_id
        cdef CallTable pending = self.pending
        pending.put(call_id, waiter)
        cdef DeadlineQueue in_order = self.in_order
        while in_order.size and not pending.has(in_order.front_id()):
            in_order.pop()  # its call ended
        if not in_order.size or expires >= in_order.last:
            in_order.push(expires, call_id)
        else:
            heappush(self.deadlines, (expires, call_id))
        if len(self.deadlines) + in_order.size > self._compact_at:
            self._compact()
        if expires < self._timer_at:
            self._arm(expires)
        return call_id

    cdef unsigned long long request(self, object driver, str method, double deadline,
                                    double now, int stream_arg, tuple args, dict kwargs,
                                    object waiter, MethodMetrics metrics, double grace) except 0:
        """Register ``waiter`` and post the call's REQUEST of ``args`` and
        ``kwargs`` (its value, ``[list(args), kwargs]``, encoded here: its
        serde header and the request's are written together once the call
        id is known) with the time left until ``deadline`` (loop time;
        ``now`` is the loop time); the waiter fails at ``deadline + grace``.
        Returns the call id.

        Raises:
            DeadlineExceeded: no time is left (the call is not sent: a
                handler that cannot suspend would still run, and answer
                after the deadline).
            Unavailable: the connection is gone.
            EncodeError: the arguments cannot be encoded (nothing is sent).
        """
        cdef double remaining = deadline - now
        if remaining <= 0.0:
            raise DeadlineExceeded(f"{method}: the deadline passed before the call was sent")
        if driver is None:  # checked here: the C call below would not
            raise Unavailable(f"{method}: not connected")
        # The session's ConnectionDriver: posting the request is a C call.
        cdef DriverCore core = driver
        cdef unsigned long long call_id = self.add(waiter, deadline + grace)
        try:
            metrics.bytes_out += core.post_frames(encode_request_value(
                call_id, method, min(remaining, _LONGEST), stream_arg, args, kwargs,
                self._encoder))
        except BaseException:
            self.pending.remove(call_id)
            raise
        return call_id

    cdef UnaryCall start(self, object driver, str method, double deadline, double now,
                         tuple args, dict kwargs, MethodMetrics metrics, double grace):
        """A unary call without a streamed argument, its REQUEST posted (see
        ``request``); the caller holds its slot, awaits its ``future``
        (then the answer is ``call.answer``, of ``call.answer_bytes``) and
        then calls ``end``, however the wait ended.

        The request is queued without waiting: the answer cannot come
        before it has gone. A call that ends early (deadline, cancel) may
        leave its request still going out, so its arguments must stay
        unchanged until then, as with any send cut short.

        The future fails with TimeoutError at ``deadline + grace``: the
        server enforces the same deadline, and waiting a moment longer
        lets its DEADLINE_EXCEEDED, which says where the time went, arrive
        first. It fails with Unavailable when the connection is lost.

        Raises:
            DeadlineExceeded: the deadline passed before the call was sent.
            Unavailable: the connection is gone.
            EncodeError: the arguments cannot be encoded.
        """
        cdef UnaryCall call = UnaryCall.waiting_on(self._create_future(),
                                                   method not in self._unary)
        call.send(_REQUEST)
        call.call_id = self.request(driver, method, deadline, now, -1, args, kwargs, call,
                                    metrics, grace)
        if call.probing:
            call.send(_CREDIT, 1)
            driver.send_soon(_Credit(call.call_id, 1))
        return call

    cdef void end(self, object driver, UnaryCall call, str method) except *:
        """``call`` (from ``start``) is over for its caller: the server
        stops its handler (CANCEL) unless the call is over for it already,
        and a probing call's RESPONSE says that ``method`` is unary."""
        self._cancel_remote(driver, call.call_id, call)
        self.pending.remove(call.call_id)
        if call.probing and call.outcome == _RESPONDED:
            self._unary.add(method)

    async def call_streaming(self, driver, str method, double deadline, int stream_arg,
                             tuple args, dict kwargs, MethodMetrics metrics, double grace,
                             waiter, on_sent):
        """A unary call with a streamed argument: ``start``, its answer
        awaited and ``end`` for ``waiter`` (its streams), and
        ``on_sent(call_id)``, which starts the task that sends the
        argument's items; returns ``(message, nbytes)``. The caller holds
        the call's slot. A ``waiter.probing`` call asks for a stream of one
        item, as ``start`` does; its answer may then be an ITEM or END (the
        method streams its result: the handler is cancelled).

        Raises:
            as ``start``, and TimeoutError and Unavailable from the wait.
        """
        cdef unsigned long long call_id = self.request(
            driver, method, deadline, self._loop.time(), stream_arg, args, kwargs, waiter,
            metrics, grace)
        if waiter.probing:
            waiter.state.send(_CREDIT, 1)
            driver.send_soon(_Credit(call_id, 1))
        pump = None
        try:
            pump = on_sent(call_id)
            answer = await waiter.future
        except BaseException:
            self._cancel_remote(driver, call_id, waiter)
            raise
        finally:
            self.pending.remove(call_id)
            if pump is not None:
                pump.cancel()
                try:
                    await pump
                except _CancelledError:
                    pass
        if waiter.probing:
            if type(answer[0]) is Response:
                self._unary.add(method)
            else:
                waiter.cancel()  # its first ITEM: the handler stops
        return answer

    cpdef bint probes(self, str method):
        """Whether a unary call of ``method`` asks for a stream of one item
        (see the module): no call of it here has answered RESPONSE yet."""
        return method not in self._unary

    cdef void _cancel_remote(self, driver, unsigned long long call_id, waiter) except *:
        """The caller stopped waiting: the server stops the handler
        (CANCEL), unless the call is over for it already."""
        if not self.pending.has(call_id):
            return
        if type(waiter) is UnaryCall:
            if not (<UnaryCall>waiter).may_cancel():
                return
            (<UnaryCall>waiter).send(_CANCEL)
        driver.send_soon(_Cancel(call_id))

    cdef void take(self, object message, Py_ssize_t nbytes) except *:
        """A message from the server (a C call from the driver: see
        ``MessageHandler``): one of a unary call goes to its ``UnaryCall``;
        everything else to ``on_other``."""
        # RESPONSE and ITEM (compiled) have their call id in a C field.
        cdef unsigned long long call_id
        if isinstance(message, ValueMessage):
            call_id = (<ValueMessage>message).call_id
        else:
            call_id = message.call_id
        waiter = self.pending.find(call_id)
        if type(waiter) is UnaryCall:
            (<UnaryCall>waiter).deliver(message, nbytes)
        else:
            self._on_other(message, nbytes)

    def fail(self, unsigned long long call_id, error):
        """A unary call in flight fails with ``error``; False when
        ``call_id`` is no unary call's."""
        waiter = self.pending.find(call_id)
        if type(waiter) is not UnaryCall:
            return False
        _fail((<UnaryCall>waiter).future, error)
        return True

    def fail_all(self, error):
        """The connection is gone: every call fails with ``error``."""
        for waiter in self.pending.values():  # a list
            if type(waiter) is UnaryCall:
                _fail((<UnaryCall>waiter).future, error)
            else:
                waiter.fail(error)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = float("inf")
        self.deadlines.clear()
        self.in_order.clear()

    cdef void _compact(self) except *:
        """Drop the deadlines of calls that ended."""
        cdef CallTable pending = self.pending
        self.deadlines = [entry for entry in self.deadlines if pending.has(entry[1])]
        heapify(self.deadlines)
        self.in_order.keep(pending)
        self._compact_at = 2 * (len(self.deadlines) + self.in_order.size) + 64

    cdef void _arm(self, double when) except *:
        """Wake up at ``when`` to expire the calls due then."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._loop.call_at(when, self._expire_due)

    def _expire_due(self):
        self._timer = None
        self._timer_at = float("inf")
        heap = self.deadlines
        cdef DeadlineQueue in_order = self.in_order
        cdef double now = self._loop.time()
        cdef unsigned long long call_id
        while True:
            # The earliest of the two fronts, in (when, call id) order.
            if in_order.size and (not heap or (in_order.front_when(), in_order.front_id())
                                  < heap[0]):
                if in_order.front_when() > now:
                    break
                call_id = in_order.front_id()
                in_order.pop()
            elif heap and heap[0][0] <= now:
                call_id = heappop(heap)[1]
            else:
                break
            waiter = self.pending.find(call_id)
            if type(waiter) is UnaryCall:
                # The deadline passed: end the wait.
                if (<UnaryCall>waiter).expire():
                    _fail((<UnaryCall>waiter).future, TimeoutError())
            elif waiter is not None:
                _fail(waiter.future, TimeoutError())
        if heap or in_order:
            self._arm(min(heap[0][0] if heap else _INF,
                          in_order.front_when() if in_order.size else _INF))


async def until_drained(driver, double deadline, str method):
    """Wait, within the call's deadline, until the server has taken enough
    of what this client sent (``TransportConfig.max_unsent_bytes``): a
    server that does not read then holds the client's calls back instead of
    growing its outbox.

    Raises:
        DeadlineExceeded: the deadline passed first (the call was not sent).
        Unavailable: the connection was lost meanwhile.
    """
    try:
        async with _timeout_at(deadline):
            await driver.drained()
    except TimeoutError:
        raise DeadlineExceeded(f"{method}: the deadline passed before the call was sent "
                               f"(the server is not taking what was sent)") from None
