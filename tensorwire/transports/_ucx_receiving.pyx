"""Receiving on a ucx:// connection, compiled: posting the header receive,
parsing what arrived, allocating the frames and receiving them into their
buffers, and handing the message over (issue 22: this runs for every
message received).

:class:`Receiving` is the base of ``UCXConnection``: it holds the receive
state in typed fields and the per-message methods; the connection's
Python part (``_ucx_connection.py``) sets it up, skips refused messages
(``_ucx_skipping.py``), follows the control channel and fails the
connection (``_fail``, ``_refuse``, ``_skip``, ``_peer_done``, called from
here as ordinary methods).
"""

from ..errors import LimitExceededError, TensorwireError, TransportError
from ._delivery import READ_BUDGET_MESSAGES, call_consumer, consumer_failed
from ._frames import default_allocator, interface_nbytes, writable_view
from ._receiver cimport MessageReceiver
from ._ucx_messages cimport Announced
from ._ucx_messages import one_inline_frame
from ._ucx_runtime import translate, ucx_error_name

cdef Py_ssize_t _READ_BUDGET = READ_BUDGET_MESSAGES


cdef _check_device_buffer(object rt, object buffer, object info, bint ours):
    """An allocator's device buffer is one, of the announced size. Not
    asked of a buffer ``default_allocator`` made (``ours``): each read of
    the CUDA interface can cost a CUDA call, and UCX reads it once more."""
    if not rt.cuda_support:
        raise TransportError("a CUDA frame arrived but this UCX has no CUDA support")
    if ours:
        return
    cai = getattr(buffer, "__cuda_array_interface__", None)
    if cai is None:
        raise TransportError(f"allocator returned no CUDA buffer for frame {info.index}")
    nbytes = interface_nbytes(cai)
    if nbytes != info.nbytes:
        raise TransportError(
            f"allocator returned {nbytes} bytes for frame {info.index} of {info.nbytes}"
        )


cdef class Receiving:
    """The receive side of a ucx:// connection (see the module docstring)."""

    # Set up by the connection.
    cdef public object _loop
    cdef public object _rt  # the Runtime; None once the connection failed
    cdef public object _ep
    cdef public object _config
    cdef public object _allocator
    cdef public object _queue  # RecvQueue
    cdef public object _tag_header_in
    cdef public object _tag_frame_in
    cdef public object _peer_address
    cdef public bytearray _header_buf
    cdef public object _header_view
    # One wrapper for every header receive (UCX writes into the buffer).
    cdef public object _header_array
    # Set by deliver_to(): messages go there instead of to recv().
    cdef public object _receiver
    # Set by refuse_oversized().
    cdef public object _on_refused
    # Under deliver_to with the default allocator: the largest one-frame
    # inline message taken by the fast path (0: none).
    cdef public Py_ssize_t _fast_max
    cdef public bint _small_as_bytearray
    # Set by pause_reading(): no receive is posted.
    cdef public bint _held
    cdef public bint _pumping
    # A header or a message's frames are in flight.
    cdef public bint _busy
    # A parsed header whose frames are not allocated yet (nobody took them).
    cdef public Announced _announced
    cdef public list _frames
    cdef public object _frames_bytes
    cdef public Py_ssize_t _frames_left
    cdef public Py_ssize_t _received
    # Messages the peer said it sent before its goodbye (None: no goodbye).
    cdef public object _peer_sent
    cdef public object _error
    cdef public object _last_activity

    def _pump(self):
        """Post the next UCX receives while someone takes messages.

        A receive that UCX completes at once (the message was already
        there, the common case under load) is handled here in the loop,
        without a round through the runtime's progress.
        """
        if self._pumping:
            return  # re-entered from a delivery: the loop below goes on
        self._pumping = True
        cdef Py_ssize_t budget = _READ_BUDGET
        try:
            while self._error is None and not self._busy:
                rt = self._rt
                if rt is None:
                    return
                if self._held or (self._receiver is None and not self._queue.waiters):
                    return
                if self._announced is not None:
                    self._allocate(rt, self._announced)
                    continue
                if self._peer_sent is not None and self._received >= self._peer_sent:
                    self._peer_done()
                    return
                request = self._post_recv(rt, self._header_array, self._tag_header_in)
                if request is None:
                    return
                if request.completed:
                    self._header_arrived(request)
                    budget -= 1
                    if budget == 0:
                        # Fairness: a peer whose messages are always there
                        # already must not keep the loop from everyone else
                        # (a consumer's inline work counts, it runs here).
                        self._loop.call_soon(self._pump)
                        return
                else:
                    self._busy = True
                    rt.watch(request, self._header_array, self._on_header)
        finally:
            self._pumping = False

    def _post_recv(self, rt, array, tag):
        """Post a receive into ``array``; None when UCX refused it (the
        connection failed)."""
        try:
            return self._ep.tag_recv(array, tag, rt.TagMaskFull)
        except Exception as exc:
            self._fail(translate(rt, exc, f"receive from {self._peer_address} failed"))
            return None

    def _on_header(self, request):
        self._busy = False
        if self._error is not None or request is None:
            return
        self._header_arrived(request)
        self._pump()

    cdef _header_arrived(self, request):
        self._last_activity = self._loop.time()
        try:
            request.check_error()
        except Exception as exc:
            if ucx_error_name(exc) == "UCXMessageTruncatedError":
                self._refuse(
                    LimitExceededError(
                        f"message header from {self._peer_address} exceeds "
                        f"{len(self._header_buf)} bytes "
                        f"(limit of {self._config.limits.max_frames} frames)"
                    )
                )
            else:
                self._fail(translate(self._rt, exc, f"receive from {self._peer_address} failed"))
            return
        if self._fast_max:
            # The RPC hot path (deliver_to with the default allocator): one
            # small inline host frame, checked and copied out here.
            frame = one_inline_frame(self._header_buf, self._fast_max, self._small_as_bytearray)
            if frame is not None:
                self._frames = [frame]
                self._frames_bytes = len(frame)
                self._finish_message()
                return
        try:
            self._announced = Announced(self._header_view, self._config.limits)
        except LimitExceededError as exc:
            if self._on_refused is None or not self._skip(exc):
                self._refuse(exc)
        except TensorwireError as exc:
            self._refuse(exc)

    cdef _allocate(self, rt, Announced announced):
        """Allocate the announced frames (with the first ``recv()`` waiter's
        allocator, if it has one), copy the inline ones, and post the
        receives of the others."""
        cdef list frames = []
        cdef list targets = []
        cdef Py_ssize_t left = 0
        waiter = None
        if self._receiver is not None:
            alloc = self._allocator
        else:
            waiter, allocator = self._queue.waiters[0]
            alloc = allocator or self._allocator
        cdef bint ours = alloc is default_allocator
        try:
            for info in announced.infos:
                buffer = alloc(info)
                frames.append(buffer)
                if info.device == "cpu":
                    view = writable_view(buffer, info)
                    inline = announced.inline.get(info.index)
                    if inline is not None:
                        view[:] = inline
                    elif info.nbytes:
                        targets.append(view)
                else:
                    _check_device_buffer(rt, buffer, info, ours)
                    if info.nbytes:
                        targets.append(buffer)
        except TensorwireError as exc:
            self._fail(exc)
            return
        except Exception as exc:
            error = TransportError(f"receive allocator failed: {exc!r}")
            error.__cause__ = exc
            self._fail(error)
            return
        self._announced = None
        self._frames = frames
        self._frames_bytes = announced.nbytes
        if waiter is not None:
            self._queue.bind(waiter)
        Array = rt.Array
        for target in targets:
            array = Array(target)
            request = self._post_recv(rt, array, self._tag_frame_in)
            if request is None:
                return
            if request.completed:
                try:
                    request.check_error()
                except Exception as exc:
                    self._fail(translate(rt, exc, f"receive from {self._peer_address} failed"))
                    return
            else:
                left += 1
                # The sender's data follows our go-ahead at once.
                rt.watch(request, array, self._on_frame, True)
        if left:
            self._busy = True
            self._frames_left = left
        else:
            if targets:
                self._last_activity = self._loop.time()
            self._finish_message()

    def _on_frame(self, request):
        if self._error is not None or request is None:
            return
        try:
            request.check_error()
        except Exception as exc:
            self._fail(translate(self._rt, exc, f"receive from {self._peer_address} failed"))
            return
        self._last_activity = self._loop.time()
        self._frames_left -= 1
        if self._frames_left == 0:
            self._busy = False
            self._finish_message()
            self._pump()

    cdef _finish_message(self):
        message = self._frames
        self._frames = []
        self._received += 1
        self.messages_received += 1
        self.bytes_received += self._frames_bytes
        receiver = self._receiver
        if receiver is None:
            self._queue.deliver(message)
        elif isinstance(receiver, MessageReceiver):
            # By a C call (see _receiver).
            try:
                (<MessageReceiver>receiver).receive(message)
            except Exception as exc:
                self._fail(consumer_failed(exc, "message receiver", self._peer_address))
        else:
            error = call_consumer(receiver, message, "message receiver", self._peer_address)
            if error is not None:
                self._fail(error)
        if self._peer_sent is not None and self._received >= self._peer_sent:
            self._peer_done()
