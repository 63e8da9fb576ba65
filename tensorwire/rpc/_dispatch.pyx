# cython: language_level=3
"""The server's dispatch of a request to its handler, compiled: where a
session's REQUESTs arrive (``RequestDispatch``), the record of one call
(``ServerCall``; ``server._Call`` adds its streaming parts), the one path
every call runs (``run_call``: its arguments, the handler, its
answer as a RESPONSE, stream items or an ERROR, metrics and the timeline),
and how it starts (``start_call``).
"""

cimport cython

from .._counters cimport record_call
from ._calls cimport CallState

import asyncio
import contextvars
import logging
import time
import traceback

from .. import serde
from ..errors import (
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    LocalProtocolError,
    ProtocolError,
    RemoteError,
    ResourceExhausted,
    Status,
    Unavailable,
)
from .._eager import start_eagerly
from . import protocol
from ._calls import SERVER
from ._wire import encode_response
from .service import signature_text

logger = logging.getLogger("tensorwire.rpc.server")

cdef object _CancelledError = asyncio.CancelledError
cdef object _Task = asyncio.Task
cdef object _copy_context = contextvars.copy_context
cdef object _perf_counter = time.perf_counter
cdef object _EncodeError = serde.EncodeError
cdef object _DecodeError = serde.DecodeError
cdef object _encode_message = protocol.encode
cdef object _Request = protocol.Request
cdef int _SERVER = SERVER
cdef int _REQUEST = protocol.Kind.REQUEST
cdef int _RESPONSE = protocol.Kind.RESPONSE
cdef int _ERROR = protocol.Kind.ERROR


cdef class RequestDispatch:
    """A server session's messages arrive here: a REQUEST starts its call
    (a ``call_class``, a ``ServerCall``); every other message goes to the
    session's ``on_other``."""

    cdef object _session
    cdef object _on_other
    cdef object _call_class

    def __init__(self, session, on_other, call_class):
        self._session = session
        self._on_other = on_other
        self._call_class = call_class

    def on_message(self, message, Py_ssize_t nbytes):
        if type(message) is _Request:
            self._start(message, nbytes)
        else:
            self._on_other(message, nbytes)

    cdef void _start(self, request, Py_ssize_t nbytes) except *:
        session = self._session
        call_id = request.call_id
        calls = session.calls
        if call_id in calls:
            raise ProtocolError(f"call id {call_id} is already in use")
        if not session._accepting or len(calls) >= session._limit:
            error = (
                Unavailable("the server is shutting down") if not session._accepting
                else ResourceExhausted(
                    f"more than {session._limit} calls in flight on one connection")
            )
            session.driver.send_soon(error_message(call_id, error))
            return
        start_call(self._call_class(session, request, nbytes),
                   session._handlers.get(request.method))


cdef class ServerCall:
    """One call on the server, from its REQUEST to its answer."""

    cdef public object session
    cdef public object request
    cdef public unsigned long long call_id
    cdef public Py_ssize_t request_bytes
    cdef public object metrics
    # Its streams (rpc._streams.CallStreams), made by server._Call when
    # the call has one.
    cdef public object streams
    # The call's rules (rpc._calls), set by start_call.
    cdef public CallState state
    # Set by start_call when the call goes on in a task of its own.
    cdef public object task
    cdef public bint _expired
    # The session's loop, not get_running_loop(): on Python 3.11 that asks
    # the OS for the pid every time, and this runs for every call.
    cdef public object _loop

    def __init__(self, session, request, Py_ssize_t nbytes):
        self.session = session
        self.request = request
        self.call_id = request.call_id
        self.request_bytes = nbytes
        self._loop = session.driver.loop

    def cancel(self):
        if self.task is not None:
            self.task.cancel()

    def _expire(self):
        self._expired = True
        self.state.expire()
        self.forget()
        self.cancel()

    def forget(self, _=None):
        """Stop counting this call against the connection's limit."""
        calls = self.session.calls
        if calls.get(self.call_id) is self:
            del calls[self.call_id]


def start_call(ServerCall call, handler):
    """Run ``call`` (a ``server._Call``): at once, to its end, when its
    handler cannot suspend (no task, no deadline timer, no entry among the
    session's calls in flight: ``_Handler.inline``); else in a task of its
    own, which a CANCEL or the deadline cancels."""
    cdef bint arg_streams = call.request.stream_arg >= 0
    call.state = CallState(_SERVER, arg_streams,
                           handler is not None and handler.info.streaming,
                           call.session.server.config.stream_window if arg_streams else 0)
    call.state.receive(_REQUEST)
    if handler is not None and handler.inline and not arg_streams:
        try:
            # A context of its own, as a task would have.
            task = _copy_context().run(start_eagerly, run_call(call, handler))
        except _CancelledError:
            return  # a handler that cancels itself gets no reply, as in a task
        if task is None:
            return  # the usual case: answered already
        # It waited for one of the server's slots.
    else:
        task = call._loop.create_task(run_call(call, handler))
    call.task = task
    call.session.calls[call.call_id] = call
    task.add_done_callback(call.forget)


async def run_call(ServerCall call, handler):
    """The one path of every call (see the module); ``handler`` is None for
    a method the server does not have (NOT_FOUND)."""
    request = call.request
    session = call.session
    slots = session._slots
    started = _perf_counter()
    failed = True
    reply = None  # its frames
    cdef int kind = _RESPONSE
    try:
        if handler is None:
            handler = session.server._handler(request.method)  # raises NotFound
        metrics = call.metrics = handler.metrics
        metrics.bytes_in += call.request_bytes
        if not slots.try_acquire():
            await slots.acquire()
        try:
            if request.stream_arg < 0:
                args, kwargs = unpack_arguments(request, handler, session._decoder)
                check_arguments(handler, args, kwargs)
            else:
                args, kwargs = call._arguments(handler)  # with the streamed argument
            # A timer on the loop rather than asyncio.timeout(): cheaper,
            # and a handler that cannot suspend needs none.
            timer = None
            if request.timeout is not None and not handler.inline:
                timer = call._loop.call_later(request.timeout, call._expire)
            try:
                if handler.info.streaming:
                    await call._stream(handler, args, kwargs)
                else:
                    # Without an empty keyword dict copied into the call.
                    result = await (handler.func(*args, **kwargs) if kwargs
                                    else handler.func(*args))
                    reply = encode_response(call.call_id,
                                            encode_value(result, handler.name, session._encoder))
            except _CancelledError:
                if not call._expired or call.task is None or call.task.uncancel() > 0:
                    raise
                raise DeadlineExceeded(
                    f"{request.method} did not finish within its deadline "
                    f"of {request.timeout:.3g} s"
                ) from None
            finally:
                if timer is not None:
                    timer.cancel()
        finally:
            slots.release()
        failed = False
    except _CancelledError:
        # Never swallowed; a cancel from the client needs no reply.
        raise
    except Exception as exc:
        if not isinstance(exc, RemoteError):
            logger.debug("%s raised", request.method, exc_info=exc)
        reply = _encode_message(error_message(call.call_id, exc))
        kind = _ERROR
    finally:
        if call.metrics is not None:
            record_call(call.metrics, session._timeline, request.method, "rpc.server",
                        started, failed)
    # The call's slot is free, and its metrics complete, before the client
    # has its answer and may send the next call.
    call.forget()
    if reply is None:
        return
    try:
        call.state.send(kind)
    except LocalProtocolError:
        # Past its deadline, a handler that swallowed the cancel answered
        # anyway: the call is over (the client gives up on its own).
        logger.debug("%s: no answer after the call ended", request.method)
        return
    try:
        sent = session.driver.post_frames(reply)
    except Unavailable:
        return  # the connection is gone: nobody to answer
    if call.metrics is not None:
        call.metrics.bytes_out += sent


cpdef tuple unpack_arguments(object request, object handler, object decoder):
    """A request's ``(args, kwargs)``.

    Raises:
        InvalidArgument: the value does not decode, or is not [args, kwargs].
    """
    frames = request.value
    try:
        # Without an empty list of buffers: most requests are one frame.
        value = (decoder.decode(frames[0]) if len(frames) == 1
                 else decoder.decode(frames[0], frames[1:]))
    except _DecodeError as exc:
        raise InvalidArgument(f"the arguments of {handler.name} do not decode: {exc}") from None
    if type(value) is list and len(value) == 2:
        # What our client sends.
        args, kwargs = value
        if type(args) is list and type(kwargs) is dict:
            return args, kwargs
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not isinstance(value[0], (list, tuple))
        or not isinstance(value[1], dict)
    ):
        raise InvalidArgument("a request's value must be [args, kwargs]")
    args = value[0]
    return (args if type(args) is list else list(args)), value[1]


cpdef void check_arguments(object handler, list args, dict kwargs) except *:
    """Raises InvalidArgument when the arguments do not fit the handler."""
    if not kwargs and len(args) == <Py_ssize_t>handler.arity:
        return  # every parameter given by position: the usual call
    try:
        handler.check(args, kwargs)
    except TypeError as exc:
        shown = signature_text(handler.info.signature)
        raise InvalidArgument(f"arguments do not fit {handler.name}{shown}: {exc}") from None


cpdef list encode_value(object value, str method_name, object encoder):
    """The frames of a handler's result or stream item.

    Raises:
        Internal: the value cannot be encoded.
    """
    try:
        header, buffers = encoder.encode(value)
    except _EncodeError as exc:
        raise Internal(f"the result of {method_name} cannot be encoded: {exc}") from None
    return [header, *buffers]


# --- errors to ERROR messages ----------------------------------------------------------

def error_message(call_id, error):
    """The ERROR that tells the client about ``error``: a RemoteError's own
    status, message and details; any other exception is INTERNAL, with its
    traceback."""
    details = None
    if isinstance(error, RemoteError):
        status, type_name, message = int(error.status), error.type_name, error.message
        trace = error.remote_traceback or (_format(error) if error.sends_traceback else "")
        if error.details:
            details = protocol.sendable_details(error.details)
            if details is None:
                logger.warning("the details of %s are not sent: not plain values, or over "
                               "%d bytes", type_name, protocol.MAX_ERROR_DETAILS)
    else:
        status, type_name, message = int(Status.INTERNAL), type(error).__qualname__, str(error)
        trace = _format(error)
    return protocol.Error(call_id, status, clip(type_name, 256), clip(message),
                          clip(trace, keep_end=True), details)


def clip(text, limit=protocol.MAX_ERROR_TEXT, *, keep_end=False):
    """``text`` cut to ``limit`` characters, saying how much was cut.

    A message keeps its start; a traceback its end, where the error is.
    """
    if len(text) <= limit:
        return text
    keep = limit - 64  # room for the note, which is shorter than 64 characters
    note = f" ... [{len(text) - keep} characters cut] ... "
    return note + text[-keep:] if keep_end else text[:keep] + note


cdef str _format(error):
    return "".join(traceback.format_exception(error))
