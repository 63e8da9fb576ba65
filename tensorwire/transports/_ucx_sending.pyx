"""Sending on a ucx:// connection, compiled: every message becomes a
header and its separate frames, each posted as a UCX tag send, and the
sends UCX does not complete at once are watched until it does (issue 22:
this runs for every message sent).

Posting is synchronous, so messages leave in the order of the calls that
posted them, and UCX matches one endpoint's messages with one tag in the
order posted: no lock is held while a send completes, and many messages
can be under way at once. A message is posted whole or not at all
(buffers are wrapped first), so a cancelled wait never cuts one in half:
UCX completes it on its own (the runtime keeps its buffers referenced).
"""

from ..errors import ConnectionClosedError
from ._ucx_messages cimport Outgoing
from ._ucx_runtime import translate

__all__ = ("post_messages",)


def _ignore_completion(request):
    """The completion of a send whose connection had already failed."""


cdef object _send_failed(object conn, object rt, object exc):
    """End ``conn`` after a failed send; the error for the sender."""
    error = translate(rt, exc, f"send to {conn._peer_address} failed")
    conn._fail(
        error
        if isinstance(error, ConnectionClosedError)
        else ConnectionClosedError(f"send to {conn._peer_address} failed: {error}")
    )
    return error


cdef class _SendsInFlight:
    """The sends of one post that UCX did not complete at once: resolves
    ``done`` when the last one completes, or with the first failure."""

    cdef object conn
    cdef object rt
    cdef object done
    cdef Py_ssize_t left

    def __cinit__(self, object conn, object rt, object done, Py_ssize_t left):
        self.conn = conn
        self.rt = rt
        self.done = done
        self.left = left

    def __call__(self, request):
        if self.done.done():
            return
        if request is None:
            # The runtime was torn down before UCX finished.
            self.done.set_exception(self.conn._closed_error())
            return
        try:
            request.check_error()
        except Exception as exc:
            self.done.set_exception(_send_failed(self.conn, self.rt, exc))
            return
        self.left -= 1
        if self.left == 0:
            self.done.set_result(None)


def post_messages(object conn, object messages):
    """Post every message of ``messages`` (each a sequence of frames) on
    ``conn`` (a UCXConnection) now, in order; None when UCX completed
    every send at once, else a future for the rest.

    Raises:
        ConnectionClosedError: the connection is closed, or UCX refused a
            post (which ends the connection).
        TransportError: a frame is not a usable buffer (nothing was sent).
    """
    rt = conn._rt
    if rt is None:
        raise conn._closed_error()
    Array = rt.Array
    header_tag = conn._tag_header_out
    frame_tag = conn._tag_frame_out
    cdef list outgoing = []
    cdef list arrays = []  # the header's and frames' ucxx Arrays, in order
    cdef list tags = []
    cdef Outgoing message
    cdef bint device = False
    cdef Py_ssize_t nbytes = 0, i, n
    try:
        for frames in messages:
            message = Outgoing(frames)
            outgoing.append(message)
            device |= message.device
            nbytes += message.nbytes
            arrays.append(Array(message.header))
            tags.append(header_tag)
            for frame in message.frames:
                arrays.append(Array(frame))
                tags.append(frame_tag)
    except Exception as exc:
        raise translate(rt, exc, f"cannot send to {conn._peer_address}") from exc
    if device:
        # UCX reads device frames on streams of its own: wait once for the
        # work queued on the caller's streams (docs/gpu.md).
        from ._device import sync_current_streams

        sync_current_streams()
    ep = conn._ep
    cdef list waiting = []  # (request, array) of the sends still in flight
    n = len(arrays)
    try:
        for i in range(n):
            array = arrays[i]
            request = ep.tag_send(array, tags[i])
            if request.completed:
                request.check_error()
            else:
                waiting.append((request, array))
    except Exception as exc:
        # What was posted before the failure may still be read by UCX:
        # its buffers stay referenced until UCX lets go of them.
        for request, array in waiting:
            rt.watch(request, array, _ignore_completion)
        _send_failed(conn, rt, exc)
        raise conn._closed_error() from exc
    count = len(outgoing)
    conn._sent += count
    conn.messages_sent += count
    conn.bytes_sent += nbytes
    if not waiting:
        rt.posted()
        return None
    done = conn._loop.create_future()
    sends = _SendsInFlight(conn, rt, done, len(waiting))
    for request, array in waiting:
        # Not completed at once: mostly a large frame's rendezvous, which
        # the receiver answers as soon as it sees it (else a full send
        # queue, which drains as soon as the peer reads).
        rt.watch(request, array, sends, True)
    return done
