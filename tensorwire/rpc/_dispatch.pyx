# cython: language_level=3
"""The server's dispatch of a request to its handler, compiled: the record
of one hosted method (``Method``), where a session's REQUESTs arrive
(``RequestDispatch``), the record of one call that runs in a task
(``ServerCall``; ``server._Call`` adds its streaming parts) and the path
such a call runs (``run_call``: its arguments, the handler, its answer as a
RESPONSE, stream items or an ERROR, metrics and the timeline).

A unary call whose handler cannot suspend (no ``await`` in its body:
``Method.at_once``) needs no task: ``RequestDispatch._run_at_once`` runs its
coroutine to its end in one C-level step, in a context of its own, and
answers at once, with no ``ServerCall`` or ``CallState``. Every other call
runs in a task, through ``run_call``. Both paths build their answer, map
errors and record metrics with the same helpers (the end of the module).
"""

cimport cython
from cpython.contextvars cimport PyContext_CopyCurrent, PyContext_Enter, PyContext_Exit
from cpython.ref cimport PyObject, Py_XDECREF
from cpython.sequence cimport PySequence_Fast_ITEMS
from libc.stdint cimport uint64_t

from .._counters cimport MethodMetrics, now, record_call
from ..serde._decoder cimport Decoder
from ..serde._encoder cimport Encoder
from ._call_table cimport CallTable
from ._calls cimport CallState
from ._driver_core cimport DriverCore, MessageHandler
from ._slots cimport Slots
from ._wire cimport Request, encode_reply_value

import asyncio
import logging
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
from . import protocol
from ._calls import SERVER
from .service import argument_checker, cannot_suspend, positional_arity, signature_text


cdef extern from "Python.h":
    # Python 3.10+: one step of a coroutine without a StopIteration at its
    # end. PYGEN_ERROR (-1) means an exception is set.
    enum:
        PYGEN_NEXT
    int PyIter_Send(object iterator, object arg, PyObject **result) except -1
    # Python 3.9+: a call with its positional arguments in a C array.
    object PyObject_Vectorcall(object callable, PyObject **args, size_t nargsf,
                               PyObject *kwnames)


logger = logging.getLogger("tensorwire.rpc.server")

cdef object _CancelledError = asyncio.CancelledError
cdef object _EncodeError = serde.EncodeError
cdef object _DecodeError = serde.DecodeError
cdef object _encode_message = protocol.encode
cdef int _SERVER = SERVER
cdef int _REQUEST = protocol.Kind.REQUEST
cdef int _RESPONSE = protocol.Kind.RESPONSE
cdef int _ERROR = protocol.Kind.ERROR


@cython.final
cdef class Method:
    """One hosted method as dispatch reads it: its handler (a bound method of
    the service), its ``MethodInfo``, metrics, whether its calls run at once,
    and what checking its arguments takes."""

    cdef readonly str name
    cdef readonly object func
    cdef readonly object info
    cdef readonly MethodMetrics metrics
    cdef readonly bint streaming
    # A unary handler that cannot suspend: its calls need no task of their
    # own, no deadline timer, no cancellation.
    cdef readonly bint at_once
    # Arguments that fit by count alone (the usual call) need no check.
    cdef Py_ssize_t _arity
    cdef object _check

    def __init__(self, str name, func, info, MethodMetrics metrics):
        self.name = name
        self.func = func
        self.info = info
        self.metrics = metrics
        self.streaming = info.streaming
        self.at_once = not info.streaming and cannot_suspend(func)
        self._arity = positional_arity(info.signature)
        self._check = argument_checker(info.signature)

    def __repr__(self):
        return f"<Method {self.name}>"

    cpdef void check(self, list args, dict kwargs) except *:
        """Raises InvalidArgument when the arguments do not fit the handler."""
        if not kwargs and len(args) == self._arity:
            return  # every parameter given by position: the usual call
        try:
            self._check(args, kwargs)
        except TypeError as exc:
            shown = signature_text(self.info.signature)
            raise InvalidArgument(f"arguments do not fit {self.name}{shown}: {exc}") from None

    cdef object call(self, list args, dict kwargs):
        """The handler called: its coroutine (or async generator)."""
        if kwargs:
            return self.func(*args, **kwargs)
        # The list's items as the call's arguments: no tuple made of them,
        # no empty keyword dict copied into the call.
        return PyObject_Vectorcall(self.func, PySequence_Fast_ITEMS(args), len(args), NULL)


@cython.final
cdef class RequestDispatch(MessageHandler):
    """A server session's messages arrive here (``take``, a C call from the
    driver): a REQUEST starts its call; every other message goes to the
    session's ``on_other``. ``attach`` the session's driver before the
    first message: answers are posted to it."""

    cdef object _session
    cdef object _on_other
    cdef object _call_class
    # What every call reads, fixed for the session's life: its calls in
    # flight (those in a task), the server's methods, slots and codec.
    cdef CallTable _calls
    cdef dict _methods
    cdef Slots _slots
    cdef Decoder _decoder
    cdef Encoder _encoder
    cdef object _timeline
    cdef Py_ssize_t _limit
    cdef DriverCore _driver
    # False once the server is shutting down: new calls are refused.
    cdef public bint accepting
    # The session holds a weak reference (it stops new calls by it).
    cdef object __weakref__

    def __init__(self, session, on_other, call_class):
        self._session = session
        self._on_other = on_other
        self._call_class = call_class
        self._calls = session.calls
        self._methods = session.server._methods
        self._slots = session._slots
        self._decoder, self._encoder = session._decoder, session._encoder
        self._timeline = session._timeline
        self._limit = session._limit
        self.accepting = True

    def attach(self, DriverCore driver not None):
        """Answers go to ``driver`` (the session's, made after this)."""
        self._driver = driver

    cdef void take(self, object message, Py_ssize_t nbytes) except *:
        if type(message) is Request:
            self._start(<Request>message, nbytes)
        else:
            self._on_other(message, nbytes)

    cdef void _start(self, Request request, Py_ssize_t nbytes) except *:
        cdef uint64_t call_id = request.call_id
        if self._calls.has(call_id):
            raise ProtocolError(f"call id {call_id} is already in use")
        if not self.accepting or self._calls.size >= self._limit:
            error = (
                Unavailable("the server is shutting down") if not self.accepting
                else ResourceExhausted(
                    f"more than {self._limit} calls in flight on one connection")
            )
            self._session.driver.send_soon(error_message(call_id, error))
            return
        method = self._methods.get(request.method)
        if (method is not None and (<Method>method).at_once and request.stream_arg < 0
                and self._run_at_once(request, call_id, nbytes, method)):
            return
        self._start_call(self._call_class(self._session, request, nbytes), method)

    cdef bint _run_at_once(self, Request request, uint64_t call_id, Py_ssize_t nbytes,
                           Method method) except -1:
        """Run a call of an ``at_once`` method to its end, now: its handler's
        coroutine one step (``PyIter_Send``, which ends it), in a copy of
        the current context as a task would have, then its answer. False,
        and nothing done, when no slot is free: the call waits for one in a
        task."""
        cdef Slots slots = self._slots
        if not slots.try_acquire():
            return False
        cdef double started = now()
        cdef MethodMetrics metrics = method.metrics
        metrics.bytes_in += nbytes
        cdef bint failed = True
        cdef bint suspended
        cdef PyObject *out = NULL
        reply = None
        try:
            args, kwargs = unpack_arguments(request, method, self._decoder)
            method.check(args, kwargs)
            context = PyContext_CopyCurrent()
            PyContext_Enter(context)
            try:
                coro = method.call(args, kwargs)
                suspended = PyIter_Send(coro, None, &out) == PYGEN_NEXT
                result = <object>out
                Py_XDECREF(out)
            finally:
                PyContext_Exit(context)
            if suspended:  # a bug: cannot_suspend() was wrong
                coro.close()
                raise RuntimeError(f"{method.name} suspended, though it has no await")
            reply = _response(call_id, method, result, self._encoder)
            failed = False
        except _CancelledError:
            pass  # a handler that cancels itself gets no reply, as in a task
        except Exception as exc:
            reply = _error(method.name, call_id, exc)
        finally:
            slots.release()
            record_call(metrics, self._timeline, method.name, "rpc.server", started, failed)
        if reply is not None:
            _post(self._driver, metrics, reply)
        return True

    cdef void _start_call(self, ServerCall call, Method method) except *:
        """Run ``call`` in a task of its own, which a CANCEL or the deadline
        cancels."""
        cdef bint arg_streams = call.request.stream_arg >= 0
        call.state = CallState(_SERVER, arg_streams, method is not None and method.streaming,
                               call.session.server.config.stream_window if arg_streams else 0)
        call.state.receive(_REQUEST)
        task = call.task = call._loop.create_task(run_call(call, method))
        self._calls.put(call.call_id, call)
        task.add_done_callback(call.forget)


cdef class ServerCall:
    """One call on the server that runs in a task, from its REQUEST to its
    answer."""

    cdef public object session
    cdef public object request
    cdef public unsigned long long call_id
    cdef public Py_ssize_t request_bytes
    cdef public object metrics
    # Its streams (rpc._streams.CallStreams), made by server._Call when
    # the call has one.
    cdef public object streams
    # The call's rules (rpc._calls), set when it starts.
    cdef public CallState state
    # The task it runs in, once started.
    cdef public object task
    cdef public bint _expired
    # The session's loop, not get_running_loop(): on Python 3.11 that asks
    # the OS for the pid every time.
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
        cdef CallTable calls = self.session.calls
        if calls.find(self.call_id) is self:
            calls.remove(self.call_id)


async def run_call(ServerCall call, Method method):
    """The path of every call that runs in a task (see the module);
    ``method`` is None for a method the server does not have (NOT_FOUND)."""
    cdef Request request = call.request
    session = call.session
    # A local of the coroutine, not a field: a coroutine's locals are not
    # cleared by the GC, so the finally below never sees it None.
    cdef Slots slots = session._slots
    cdef double started = now()
    failed = True
    reply = None  # its frames
    cdef int kind = _RESPONSE
    try:
        if method is None:
            method = session.server._method(request.method)  # raises NotFound
        metrics = call.metrics = method.metrics
        metrics.bytes_in += call.request_bytes
        if not slots.try_acquire():
            await slots.acquire()
        try:
            if request.stream_arg < 0:
                args, kwargs = unpack_arguments(request, method, session._decoder)
                method.check(args, kwargs)
            else:
                args, kwargs = call._arguments(method)  # with the streamed argument
            # A timer on the loop rather than asyncio.timeout(): cheaper.
            timer = None
            if request.timeout is not None:
                timer = call._loop.call_later(request.timeout, call._expire)
            try:
                if method.streaming:
                    await call._stream(method, args, kwargs)
                else:
                    result = await method.call(args, kwargs)
                    reply = _response(call.call_id, method, result, session._encoder)
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
        reply = _error(request.method, call.call_id, exc)
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
    _post(<DriverCore>session.driver, call.metrics, reply)


# --- answers, shared by both paths ------------------------------------------------------

cdef list _response(uint64_t call_id, Method method, result, Encoder encoder):
    """The RESPONSE carrying a unary handler's result (its header and the
    result's written together: ``_wire.encode_reply_value``).

    Raises:
        Internal: the result cannot be encoded.
    """
    try:
        return encode_reply_value(_RESPONSE, call_id, result, encoder)
    except _EncodeError as exc:
        raise _cannot_encode(exc, method.name) from None


cdef list _error(str method_name, call_id, exc):
    """The ERROR for a handler's (or its arguments') exception."""
    if not isinstance(exc, RemoteError):
        logger.debug("%s raised", method_name, exc_info=exc)
    return _encode_message(error_message(call_id, exc))


cdef void _post(DriverCore driver, MethodMetrics metrics, list frames) except *:
    """Post an answer, counting its bytes; dropped when the connection is
    gone (nobody to answer)."""
    cdef Py_ssize_t sent
    try:
        sent = driver.post_frames(frames)
    except Unavailable:
        return
    if metrics is not None:
        metrics.bytes_out += sent


cpdef tuple unpack_arguments(Request request, Method method, Decoder decoder):
    """A request's ``(args, kwargs)``.

    Raises:
        InvalidArgument: the value does not decode, or is not [args, kwargs].
    """
    try:
        value = request.decode_value(decoder)
    except _DecodeError as exc:
        raise InvalidArgument(f"the arguments of {method.name} do not decode: {exc}") from None
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


cpdef list encode_value(object value, str method_name, Encoder encoder):
    """The frames of a handler's result or stream item.

    Raises:
        Internal: the value cannot be encoded.
    """
    try:
        return encoder.encode_frames(value)
    except _EncodeError as exc:
        raise _cannot_encode(exc, method_name) from None


cdef object _cannot_encode(object error, str method_name):
    """The ``Internal`` error of a result that did not encode (``error``)."""
    return Internal(f"the result of {method_name} cannot be encoded: {error}")


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
