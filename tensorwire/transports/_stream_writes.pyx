"""Writing messages on a byte stream, compiled (issue 22): a batch of
messages as the buffers of one scatter-gather write, and that write on a
non-blocking socket.

``outgoing_many`` turns everything a connection was given in one loop turn
into one list of buffers: a message's header, then its frames themselves
(zero-copy views), except that consecutive small one-frame messages (an RPC
call's REQUEST or RESPONSE) are copied, headers and all, into one buffer of
their own, since copying a few hundred bytes costs less than a buffer each
(a header object, a buffer request and an iovec entry per message).
``write_some`` puts as much of the list as the socket takes into one
``sendmsg`` (IOV_MAX buffers at a time), and leaves the rest at the front
of the list for the next try.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.exc cimport PyErr_SetFromErrno
from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

from ._frames import device_nbytes, host_view, is_device_frame
from ._stream_framing import pack_header

from ._frame_table cimport ONE_FRAME_HEADER_SIZE, write_one_frame_header

__all__ = ("IOV_MAX", "JOIN_MAX", "outgoing", "outgoing_many", "write_some")

#: sendmsg() takes at most this many buffers per call (IOV_MAX on Linux).
IOV_MAX = 1024
cdef Py_ssize_t _IOV_MAX = IOV_MAX

#: A one-frame message whose frame is a bytes object of at most this many
#: bytes is copied into the buffer it shares with the small messages next to
#: it in the batch (see the module); larger frames always go as views.
JOIN_MAX = 4096
cdef Py_ssize_t _JOIN_MAX = JOIN_MAX


cdef extern from "<sys/uio.h>":
    struct iovec:
        void* iov_base
        size_t iov_len

cdef extern from "<sys/socket.h>":
    struct msghdr:
        void* msg_name
        int msg_namelen
        iovec* msg_iov
        size_t msg_iovlen
        void* msg_control
        size_t msg_controllen
        int msg_flags
    ssize_t sendmsg(int fd, const msghdr* msg, int flags) nogil
    int MSG_NOSIGNAL


cdef inline Py_ssize_t _small_size(frames) except -2:
    """The frame's bytes if ``frames`` is a small one-frame message (a
    bytes frame of at most JOIN_MAX bytes), else -1."""
    if type(frames) is not list and type(frames) is not tuple:
        return -1
    if len(frames) != 1:
        return -1
    frame = frames[0]
    if type(frame) is not bytes or PyBytes_GET_SIZE(frame) > _JOIN_MAX:
        return -1
    return PyBytes_GET_SIZE(frame)


cdef Py_ssize_t _append_joined(list buffers, list batch, Py_ssize_t start,
                               Py_ssize_t end, Py_ssize_t nbytes) except -1:
    """Append the small one-frame messages ``batch[start:end]``, of
    ``nbytes`` on the wire in all, to ``buffers`` as one bytes object:
    each message's header, then its frame."""
    joined = PyBytes_FromStringAndSize(NULL, nbytes)
    cdef unsigned char* p = <unsigned char*>PyBytes_AS_STRING(joined)
    cdef Py_ssize_t index, size
    for index in range(start, end):
        frame = batch[index][0]
        size = PyBytes_GET_SIZE(frame)
        write_one_frame_header(p, size)
        memcpy(p + ONE_FRAME_HEADER_SIZE, PyBytes_AS_STRING(frame), size)
        p += ONE_FRAME_HEADER_SIZE + size
    buffers.append(joined)
    return nbytes


cdef Py_ssize_t _append_message(list buffers, frames, owner) except -1:
    """Append the buffers of one message to ``buffers``; its bytes.

    Host frames go as zero-copy views; a CUDA frame is first copied to host
    memory, since a socket cannot read device memory, and counted in the
    ``device_bytes_staged`` of ``owner`` (the connection that sends it).
    """
    cdef Py_ssize_t nbytes, total, index
    cdef list sizes = []
    cdef list devices = None
    cdef list views = []
    for index in range(len(frames)):
        frame = frames[index]
        # bytes and memoryviews (what serde and the RPC layer send) skip
        # the device check, which costs a failed attribute lookup.
        if type(frame) is not bytes and type(frame) is not bytearray \
                and type(frame) is not memoryview and is_device_frame(frame):
            from ._device import device_to_host

            if devices is None:
                devices = ["cpu"] * index
            nbytes = device_nbytes(frame)
            devices.append("cuda")
            views.append(device_to_host(frame).data)
            if owner is not None:
                owner.device_bytes_staged += nbytes
        else:
            view = host_view(frame)
            nbytes = view.nbytes
            if devices is not None:
                devices.append("cpu")
            views.append(view)
        sizes.append(nbytes)
    header = pack_header(sizes, devices)
    buffers.append(header)
    buffers.extend(views)
    total = len(header)
    for nbytes in sizes:
        total += nbytes
    return total


def outgoing(frames, owner=None):
    """The buffers that put ``frames`` on a byte stream: header, then frames
    (see ``outgoing_many``)."""
    return outgoing_many((frames,), owner)[0]


def outgoing_many(messages, owner):
    """The buffers that put every message of ``messages`` on a byte stream,
    in order, and their bytes in all: ``(buffers, nbytes)``.

    Host frames go as zero-copy views; CUDA frames are staged in host
    memory and counted in ``owner.device_bytes_staged``.

    Raises:
        TransportError: a frame that is neither a contiguous buffer nor CUDA memory.
    """
    cdef list batch = messages if type(messages) is list else list(messages)
    cdef list buffers = []
    cdef Py_ssize_t total = 0, index = 0, end, size, joined
    cdef Py_ssize_t count = len(batch)
    while index < count:
        # The run of small one-frame messages from here, if any: one buffer.
        end = index
        joined = 0
        while end < count:
            size = _small_size(batch[end])
            if size < 0:
                break
            joined += ONE_FRAME_HEADER_SIZE + size
            end += 1
        if end > index:
            total += _append_joined(buffers, batch, index, end, joined)
            index = end
        else:
            total += _append_message(buffers, batch[index], owner)
            index += 1
    return buffers, total


def write_some(int fd, list buffers):
    """Send what the socket ``fd`` takes now of ``buffers``, removing it
    from their front (a buffer sent in part is replaced by a view of its
    rest); returns the bytes sent. Stops when the socket is full or all
    is sent.

    Raises:
        OSError: the send failed (not for a full socket).
    """
    cdef Py_ssize_t count, held, i, sent = 0, done
    cdef ssize_t n
    cdef msghdr message
    cdef iovec* iov = <iovec*>malloc(_IOV_MAX * sizeof(iovec))
    cdef Py_buffer* views = <Py_buffer*>malloc(_IOV_MAX * sizeof(Py_buffer))
    if iov == NULL or views == NULL:
        free(iov)
        free(views)
        raise MemoryError()
    try:
        while buffers:
            count = min(len(buffers), _IOV_MAX)
            held = 0
            try:
                for i in range(count):
                    PyObject_GetBuffer(buffers[i], &views[i], PyBUF_SIMPLE)
                    held += 1
                    iov[i].iov_base = views[i].buf
                    iov[i].iov_len = views[i].len
                message.msg_name = NULL
                message.msg_namelen = 0
                message.msg_iov = iov
                message.msg_iovlen = count
                message.msg_control = NULL
                message.msg_controllen = 0
                message.msg_flags = 0
                with nogil:
                    n = sendmsg(fd, &message, MSG_NOSIGNAL)
                if n < 0:
                    if errno == EAGAIN:  # EWOULDBLOCK on Linux
                        return sent
                    if errno == EINTR:
                        continue
                    PyErr_SetFromErrno(OSError)
                sent += n
                # Drop what went out from the front of the list.
                done = 0
                while done < count and <size_t>n >= iov[done].iov_len:
                    n -= iov[done].iov_len
                    done += 1
                if done < count and n:
                    buffers[done] = memoryview(buffers[done]).cast("B")[n:]
            finally:
                for i in range(held):
                    PyBuffer_Release(&views[i])
            del buffers[:done]
            if done < count:
                return sent  # the socket took part: it is full now
        return sent
    finally:
        free(iov)
        free(views)
