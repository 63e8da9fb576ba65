# cython: language_level=3
"""The unary call of the RPC client, compiled: ``ClientCore._call`` and what
it asks on every call (its deadline, the connected session, the encoded
arguments and their streamed one, the result of the answer), each without
a Python frame. ``Client`` (client.py) is ``ClientCore`` with the API.
"""

from .._counters cimport record_call

import asyncio
import collections.abc
import logging
import math
import time

from ..errors import ConfigError, DeadlineExceeded, ProtocolError, RemoteError, Unavailable
from . import protocol
from ._calls_in_flight import LONGEST

logger = logging.getLogger("tensorwire.rpc.client")

#: Seconds the client's own deadline timer waits past the deadline.
cdef double DEADLINE_GRACE = 0.05

cdef double _LONGEST = LONGEST
cdef object _Response = protocol.Response
cdef object _Error = protocol.Error
cdef object _AsyncIterable = collections.abc.AsyncIterable
cdef object _get_running_loop = asyncio.get_running_loop
cdef object _perf_counter = time.perf_counter
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


cpdef tuple split_stream(tuple args):
    """``(args, source, index)``: the async-iterable argument (if any) taken
    out of ``args``, and where it was; ``(args, None, -1)`` without one."""
    cdef Py_ssize_t index
    for index, arg in enumerate(args):
        if type(arg) not in _PLAIN and isinstance(arg, _AsyncIterable):
            return args[:index] + args[index + 1:], arg, index
    return args, None, -1


def remote_error(message):
    """The ``RemoteError`` subclass an ERROR message stands for."""
    cls = RemoteError.for_status(message.status, message.type_name)
    return cls(message.message, type_name=message.type_name,
               remote_traceback=message.traceback, details=message.details)


def unexpected_answer(message, str method):
    """What a unary call raises for an answer that is not a RESPONSE."""
    if isinstance(message, _Error):
        return remote_error(message)
    return ProtocolError(f"unexpected {message.kind.name} for unary call {method}")


cdef class ClientCore:
    """The client's state that every call reads, and its per-call helpers."""

    cdef public object config
    cdef public object _session
    # The client's own codec (it runs on one event loop's thread): a call
    # each way less than serde's per-thread functions.
    cdef public object _encoder
    cdef public object _decoder
    cdef public object _metrics

    async def _call(self, str method, object timeout, bint idempotent, *args, **kwargs):
        """``call``, with its options by position: a typed proxy's method is
        this with them bound (``functools.partial``: no Python frame of its
        own, no keyword dict built for the options on every call). One
        compiled coroutine from the call to its answer."""
        cdef double deadline = self._deadline(timeout)
        args, source, stream_arg = split_stream(args)
        payload = self._encode_arguments(args, kwargs)
        metrics = self._metrics[method]
        cdef bint retry = idempotent and source is None  # once, after losing the connection
        cdef double started = _perf_counter()
        cdef bint error = True
        try:
            while True:
                session = self._connected() or await self._ready_by(deadline, method)
                try:
                    if not session.slots.try_acquire():
                        await session.acquire_slot(deadline)
                    try:
                        waiter, on_sent = (None, None) if source is None else \
                            self._streaming_argument(session, method, source, metrics)
                        message, nbytes = await session.calls.call(
                            session.driver, method, deadline, stream_arg, payload, metrics,
                            DEADLINE_GRACE, waiter, on_sent)
                    finally:
                        session.slots.release()
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
            record_call(metrics, self.config.timeline, method, "rpc.client", started, error)

    cpdef double _deadline(self, object timeout) except? -1.0:
        """The loop time by which a call with ``timeout`` must end.

        Raises:
            ConfigError: the timeout is not a number of seconds (NaN).
        """
        session = self._session
        # The session's loop when connected: get_running_loop() asks the OS
        # for the pid on every call on Python 3.11.
        loop = session.loop if session is not None else _get_running_loop()
        cdef double remaining = self.config.timeout if timeout is None else timeout
        if not 0.0 < remaining < _LONGEST:
            remaining = sendable(remaining)
        return loop.time() + remaining

    cpdef object _connected(self):
        """The session, when it is connected (a call need not wait)."""
        session = self._session
        return session if session is not None and session.alive else None

    cpdef list _encode(self, object value):
        """The frames of ``value``."""
        header, buffers = self._encoder.encode(value)
        return [header, *buffers]

    cpdef object _result(self, object message, Py_ssize_t nbytes, object metrics, str method):
        """A unary call's result, from its answer.

        Raises:
            RemoteError: the answer is an ERROR.
            ProtocolError: the answer is neither RESPONSE nor ERROR.
        """
        metrics.bytes_in += nbytes
        if type(message) is not _Response:
            raise unexpected_answer(message, method)
        frames = message.value
        # Without an empty list of buffers: most answers are one frame.
        return (self._decoder.decode(frames[0]) if len(frames) == 1
                else self._decoder.decode(frames[0], frames[1:]))

    cpdef list _encode_arguments(self, tuple args, dict kwargs):
        """The frames of a request's value ``[args, kwargs]``."""
        # A list, not the tuple: msgpack packs a list in C, a tuple through
        # a Python callback (the server takes either).
        header, buffers = self._encoder.encode_nested([list(args), kwargs])
        return [header, *buffers]
