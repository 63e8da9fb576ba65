# cython: language_level=3
"""The unary call of the RPC client, compiled: ``ClientCore._call`` and what
it asks on every call (its deadline, the connected session, the encoded
arguments and their streamed one, the result of the answer), each without
a Python frame. ``Client`` (client.py) is ``ClientCore`` with the API;
``client._ClientSession`` is ``SessionCore`` (one connection as a call
reads it) with opening the connection and its message handlers.
"""

# now(): time.perf_counter(), read in C (the clock of record_call).
from .._counters cimport MethodMetrics, now as perf_now, record_call
from ._calls_in_flight cimport CallsInFlight, UnaryCall
from ._slots cimport Slots
from ._wire cimport Response

import asyncio
import collections.abc
import logging
import math

from ..errors import (
    ConfigError,
    DeadlineExceeded,
    ProtocolError,
    RemoteError,
    Unavailable,
    Unimplemented,
)
from . import protocol
from ._calls_in_flight import LONGEST

logger = logging.getLogger("tensorwire.rpc.client")

#: Seconds the client's own deadline timer waits past the deadline.
cdef double DEADLINE_GRACE = 0.05

cdef double _LONGEST = LONGEST
cdef object _Error = protocol.Error
cdef object _Item = protocol.Item
cdef object _End = protocol.End
cdef object _AsyncIterable = collections.abc.AsyncIterable
cdef object _get_running_loop = asyncio.get_running_loop
#: Argument types that are never async iterables, checked first: the ABC's
#: isinstance() costs several times a set lookup, for every argument.
cdef frozenset _PLAIN = frozenset({int, float, str, bytes, bool, type(None), list, tuple, dict})


cpdef double sendable(double timeout) except? -1.0:
    """A call's timeout outside (0, LONGEST), as its request can carry it:
    none left is 0.0 (the call then fails before it is sent), a longer one
    is ``LONGEST``.

    Raises:
        ConfigError: the timeout is not a number of seconds (NaN).
    """
    if math.isnan(timeout):
        raise ConfigError(f"a call's timeout must be a number of seconds, got {timeout!r}")
    return 0.0 if timeout <= 0.0 else _LONGEST


cdef Py_ssize_t stream_index(tuple args) except -2:
    """Where the async-iterable argument is in ``args``; -1 without one."""
    cdef Py_ssize_t index
    for index, arg in enumerate(args):
        if type(arg) not in _PLAIN and isinstance(arg, _AsyncIterable):
            return index
    return -1


cpdef tuple split_stream(tuple args):
    """``(args, source, index)``: the async-iterable argument (if any) taken
    out of ``args``, and where it was; ``(args, None, -1)`` without one."""
    cdef Py_ssize_t index = stream_index(args)
    if index < 0:
        return args, None, -1
    return args[:index] + args[index + 1:], args[index], index


def remote_error(message):
    """The ``RemoteError`` subclass an ERROR message stands for."""
    cls = RemoteError.for_status(message.status, message.type_name)
    return cls(message.message, type_name=message.type_name,
               remote_traceback=message.traceback, details=message.details)


def unexpected_answer(message, str method):
    """What a unary call raises for an answer that is not a RESPONSE: the
    ERROR's, or for the ITEM or END of a method that streams its result
    ``Unimplemented`` (see ``_calls_in_flight``, probing calls)."""
    if isinstance(message, _Error):
        return remote_error(message)
    if isinstance(message, (_Item, _End)):
        return Unimplemented(f"{method} streams its result: call it with stream(), not call()")
    return ProtocolError(f"unexpected {message.kind.name} for unary call {method}")


cdef class SessionCore:
    """One connection of a client, as every call reads it: its loop, its
    driver, its call slots and its calls in flight (C fields).
    ``client._ClientSession`` adds opening it and its message handlers."""

    # Its fields are declared in _client_core.pxd: _loop (and its bound
    # method _loop_time), driver, slots, calls, error.

    @property
    def loop(self):
        """The event loop the connection runs on."""
        return self._loop

    @loop.setter
    def loop(self, loop):
        self._loop = loop
        self._loop_time = loop.time

    cdef double time(self) except? -1.0:
        """The loop's time (its bound method, kept: no lookup per call)."""
        return self._loop_time()

    @property
    def alive(self):
        """Connected, and the connection not closed."""
        return self.connected()

    cdef bint connected(self):
        return self.driver is not None and self.driver.error is None

    cpdef bint take_slot(self):
        """Take a call slot, if a call can start at once: connected, one is
        free and the output to the server is under its bound."""
        return (self.connected() and not self.driver.reading_paused
                and self.slots.try_acquire())

    cdef UnaryCall start(self, str method, double deadline, double now, tuple args,
                         dict kwargs, MethodMetrics metrics):
        """A unary call (no streamed argument) of ``args`` and ``kwargs`` in
        flight, its REQUEST posted (``CallsInFlight.start``), in a slot this
        session gave the caller; the slot goes back if the call cannot
        start."""
        try:
            return self.calls.start(self.driver, method, deadline, now, args, kwargs, metrics,
                                    DEADLINE_GRACE)
        except BaseException:
            self.slots.release()
            raise

    cdef void end(self, UnaryCall call, str method) except *:
        """``call`` is over for its caller (``CallsInFlight.end``): its
        slot goes back."""
        try:
            self.calls.end(self.driver, call, method)
        finally:
            self.slots.release()


cdef class ClientCore:
    """The client's state that every call reads, and its per-call helpers."""

    # Its fields are declared in _client_core.pxd: _config (with its
    # _default_timeout and _timeline), _session,
    # _encoder, _decoder, _metrics.

    @property
    def config(self):
        """The client's ``ClientConfig``."""
        return self._config

    @config.setter
    def config(self, config):
        self._config = config
        self._default_timeout = config.timeout
        self._timeline = config.timeline

    async def _call(self, str method, object timeout, bint idempotent, *args, **kwargs):
        """``call``, with its options by position: a typed proxy's method is
        this with them bound (``functools.partial``: no Python frame of its
        own, no keyword dict built for the options on every call). The one
        coroutine from the call to its answer: the call in flight starts
        and ends by C calls (``CallsInFlight.start`` and ``end``)."""
        cdef Py_ssize_t stream_arg = stream_index(args)
        source = None
        if stream_arg >= 0:
            args, source, stream_arg = split_stream(args)
        cdef MethodMetrics metrics = self._metrics[method]
        cdef bint retry = idempotent and source is None  # once, after losing the connection
        cdef double started = perf_now()
        cdef double now = self._now()
        cdef double deadline = now + self._timeout(timeout)
        cdef SessionCore session
        cdef UnaryCall call
        cdef bint error = True
        try:
            while True:
                session = self._connected()
                if session is None:
                    # Arguments that cannot be encoded fail the call now,
                    # not once connected (once connected, they are encoded
                    # with the REQUEST, when the call has its id).
                    self._encoder.encode_arguments(args, kwargs)
                    session = await self._ready_by(deadline, method)
                    now = session.time()  # it waited
                try:
                    if not session.take_slot():
                        await session.wait_for_slot(deadline, method)
                        now = session.time()  # it waited
                    if source is not None:
                        message, nbytes = await self._call_streaming(
                            session, method, deadline, stream_arg, args, kwargs, metrics, source)
                    else:
                        call = session.start(method, deadline, now, args, kwargs, metrics)
                        try:
                            await call.future
                        finally:
                            session.end(call, method)
                        message, nbytes = call.answer, call.answer_bytes
                except Unavailable:
                    if not retry:
                        raise
                    retry = False
                    logger.info("retrying idempotent %s after losing the connection", method)
                    continue
                result = self._result(message, nbytes, metrics, method)
                error = False
                return result
        except DeadlineExceeded:
            raise  # the server's own, with its message and traceback
        except TimeoutError:
            raise DeadlineExceeded(f"{method} did not finish within its deadline") from None
        finally:
            record_call(metrics, self._timeline, method, "rpc.client", started, error)

    async def _call_streaming(self, SessionCore session, str method, double deadline,
                              int stream_arg, tuple args, dict kwargs, MethodMetrics metrics,
                              source):
        """``_call``'s unary call with a streamed argument (``source``), in
        a slot the session gave it, to the answer ``(message, nbytes)``;
        the slot goes back. Rarer than a plain call: a coroutine of its
        own, which sends the items meanwhile."""
        try:
            waiter, on_sent = self._streaming_argument(session, method, source, metrics)
            return await session.calls.call_streaming(
                session.driver, method, deadline, stream_arg, args, kwargs, metrics, DEADLINE_GRACE,
                waiter, on_sent)
        finally:
            session.slots.release()

    cpdef double _deadline(self, object timeout) except? -1.0:
        """The loop time by which a call with ``timeout`` must end.

        Raises:
            ConfigError: the timeout is not a number of seconds (NaN).
        """
        return self._now() + self._timeout(timeout)

    cdef double _now(self) except? -1.0:
        """The loop time: the session's loop's when connected, since
        get_running_loop() asks the OS for the pid on every call on Python
        3.11."""
        cdef SessionCore session = self._session
        return session.time() if session is not None else _get_running_loop().time()

    cdef double _timeout(self, object timeout) except? -1.0:
        """A call's ``timeout`` (None: the configured one), as its request
        can carry it (see ``sendable``)."""
        cdef double seconds = self._default_timeout if timeout is None else timeout
        return seconds if 0.0 < seconds < _LONGEST else sendable(seconds)

    cdef SessionCore _connected(self):
        """The session, when it is connected (a call need not wait)."""
        session = self._session
        return session if session is not None and session.connected() else None

    cpdef list _encode(self, object value):
        """The frames of ``value``."""
        return self._encoder.encode_frames(value)

    cpdef object _result(self, object message, Py_ssize_t nbytes, MethodMetrics metrics,
                         str method):
        """A unary call's result, from its answer.

        Raises:
            RemoteError: the answer is an ERROR.
            ProtocolError: the answer is neither RESPONSE nor ERROR.
        """
        metrics.bytes_in += nbytes
        if type(message) is not Response:
            raise unexpected_answer(message, method)
        return (<Response>message).decode_value(self._decoder)
