"""Sans-IO framing of messages on a byte stream (tcp://, and UCX's control).

Bytes in, messages out; no sockets, no event loop. The asyncio drivers feed
it with ``get_buffer()`` / ``buffer_updated(n)`` (the shape of
``asyncio.BufferedProtocol``), so a large frame is received straight into
the buffer its allocator handed out. The layout is in docs/protocol.md.

Compiled (issue 22): this is the per-message work of a stream connection.
One ``buffer_updated`` parses every complete message the read brought
(aiohttp's ``_http_parser.pyx`` does the same), and ``hand_out`` passes
them to their consumer, a bounded number per call (the fairness budget of
``_delivery``).
"""

cimport cython

from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from libc.stdint cimport uint64_t
from libc.string cimport memcpy

from ..errors import LimitExceededError, ProtocolError, TensorwireError, TransportError

from ._frame_table import DEVICE_CODES, KIND_DATA, KIND_GOODBYE
from ._frame_table import PRELUDE, PRELUDE_SIZE, encode_table
from ._frames import ALIGNMENT, FrameInfo, default_allocator, host_empty, writable_view
from ._limit_checks import check_frame_count, check_limits, refused_head

from ._receiver cimport MessageReceiver
from ._frame_table cimport (
    ONE_DATA_PRELUDE_WORD,
    ONE_FRAME_HEADER_SIZE,
    decode_sizes,
    device_name,
    load_u64le,
    one_frame_header,
    table_size,
)

__all__ = (
    "GOODBYE",
    "HANDSHAKE",
    "PROTOCOL_VERSION",
    "FrameReader",
    "Goodbye",
    "check_handshake",
    "pack_header",
)

PROTOCOL_VERSION = 1
MAGIC = b"TWIR"
#: Sent once by each side when a stream connection opens: magic, version,
#: three reserved zero bytes.
HANDSHAKE = MAGIC + bytes([PROTOCOL_VERSION, 0, 0, 0])

GOODBYE = PRELUDE.pack(KIND_GOODBYE, 0, 0, 0)

#: Read-ahead buffer for preludes, tables and small frames: one recv() often
#: brings several small messages. Frames (or their rest) of at least
#: DIRECT_MIN bytes are received straight into their own buffer instead.
STAGING_SIZE = 256 * 1024
DIRECT_MIN = 64 * 1024

#: The default allocation of a message whose frames together are at most this
#: large is one buffer, with each frame a 64-byte-aligned slice of it: one
#: allocation instead of one per frame, for the many small RPC messages. The
#: frames then keep each other's memory alive, which is bounded by this.
SLAB_MAX = 64 * 1024

# The same as C constants, for the per-message code below.
cdef Py_ssize_t _STAGING_SIZE = STAGING_SIZE
cdef Py_ssize_t _DIRECT_MIN = DIRECT_MIN
cdef Py_ssize_t _SLAB_MAX = SLAB_MAX
cdef Py_ssize_t _PRELUDE_SIZE = PRELUDE_SIZE
cdef Py_ssize_t _ALIGNMENT = ALIGNMENT
cdef Py_ssize_t _HANDSHAKE_SIZE = len(HANDSHAKE)
cdef int _KIND_DATA = KIND_DATA
cdef int _KIND_GOODBYE = KIND_GOODBYE


cdef tuple _slab_frames(list infos):
    """One aligned buffer for all the frames of a small message; the frames
    (slices of it) and their views."""
    cdef list offsets = []
    cdef Py_ssize_t size = 0, nbytes
    for info in infos:
        offsets.append(size)
        nbytes = info.nbytes
        size += (nbytes + _ALIGNMENT - 1) // _ALIGNMENT * _ALIGNMENT
    slab = host_empty(size)
    cdef list frames = [slab[o : o + info.nbytes] for o, info in zip(offsets, infos)]
    return frames, [frame.data for frame in frames]


cdef inline void _copy_into(object target, Py_ssize_t at, const char* data, Py_ssize_t size):
    """Copy ``size`` bytes to a writable byte buffer at ``at``."""
    cdef unsigned char[::1] view
    if size:
        view = target
        memcpy(&view[at], data, size)


def check_handshake(data):
    """Refuse a peer that does not speak this protocol version.

    Raises:
        ProtocolError: wrong magic or unsupported version.
    """
    data = bytes(data)
    if data[:4] != MAGIC:
        raise ProtocolError(f"peer is not a tensorwire endpoint (got {data[:8]!r})")
    if data[4] != PROTOCOL_VERSION:
        raise ProtocolError(
            f"peer speaks wire protocol version {data[4]}, this side {PROTOCOL_VERSION}"
        )


def pack_header(sizes, devices=None):
    """The prelude and frame table that precede a message's frames
    (``devices`` None: all in host memory)."""
    if devices is None or all(d == "cpu" for d in devices):
        return encode_table(sizes)
    return encode_table(sizes, bytes([DEVICE_CODES[d] for d in devices]))


def pack_one_frame(nbytes):
    """``pack_header([nbytes])``, the common case, at a fraction of the cost."""
    return one_frame_header(nbytes)


class Goodbye:
    """Event: the peer closed the connection politely."""

    __slots__ = ()


class Refused:
    """Event: a message beyond the limits was skipped (see ``skip_oversized``)."""

    __slots__ = ("error",)

    def __init__(self, error):
        self.error = error


# The reader's states.
cdef enum State:
    HANDSHAKE_ = 1
    PRELUDE_ = 2
    TABLE = 3
    ALLOCATE = 4
    FRAMES = 5
    CLOSED = 6
    SKIP = 7


@cython.final
cdef class Events:
    """The reader's events in order, first in, first out: the ``deque``
    operations a driver uses (``append``, ``popleft``, ``clear``, ``len``,
    indexing, iteration), and as C calls for the reader's own per-message
    ``push`` and ``pop``. A list read from a head index, closed up when
    emptied (or once its consumed front is most of it)."""

    cdef list _items
    cdef Py_ssize_t _head

    def __cinit__(self):
        self._items = []
        self._head = 0

    cdef inline void push(self, event) except *:
        self._items.append(event)

    cdef object pop(self):
        """The first event, taken off (there is one: the caller checks)."""
        cdef list items = self._items
        cdef Py_ssize_t head = self._head
        event = items[head]
        items[head] = None
        head += 1
        if head == len(items):
            del items[:]
            head = 0
        elif head >= 64 and 2 * head >= len(items):
            del items[:head]
            head = 0
        self._head = head
        return event

    cdef inline bint has_message(self):
        """Whether the first event is a message (a list of frames)."""
        return self._head < len(self._items) and type(self._items[self._head]) is list

    def append(self, event):
        self.push(event)

    def popleft(self):
        if self._head == len(self._items):
            raise IndexError("pop from empty Events")
        return self.pop()

    def clear(self):
        self._items = []
        self._head = 0

    def __len__(self):
        return len(self._items) - self._head

    def __bool__(self):
        return self._head < len(self._items)

    def __getitem__(self, Py_ssize_t index):
        cdef Py_ssize_t size = len(self._items) - self._head
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError("Events index out of range")
        return self._items[self._head + index]

    def __iter__(self):
        return iter(self._items[self._head:])


cdef class FrameReader:
    """Parses a byte stream into messages.

    After ``buffer_updated`` the caller looks at ``events`` (``Events``:
    completed messages, each a list of frames, or :class:`Goodbye`) and at
    ``frames_announced``: once a message's table has arrived, the reader waits
    for ``allocate(allocator)``, so the receiver chooses where the frames go.
    The driver stops reading while it waits: a consumer that does not call
    ``recv()`` pushes back on its sender instead of growing a queue.

    Raises (from ``buffer_updated`` and ``allocate``):
        ProtocolError: malformed stream.
        LimitExceededError: a message beyond ``limits``.
    """

    cdef public object limits
    cdef readonly Events events
    #: Skip a message beyond the limits (a Refused event) instead of
    #: raising LimitExceededError, where its frame table was read.
    cdef public bint skip_oversized
    #: Allocate every small one-frame host message with the default
    #: allocator as soon as it is whole in the read-ahead buffer, without
    #: stopping at ``frames_announced`` (set by a driver whose consumer
    #: would do just that: see ``StreamConnection.deliver_to``).
    cdef public bint auto_allocate
    #: With ``auto_allocate``: such a message's frame is a ``bytearray``
    #: copy instead of an aligned NumPy array (see ``Connection.deliver_to``).
    cdef public bint small_as_bytearray
    #: Bytes of CUDA frames received into host memory and copied up.
    cdef public Py_ssize_t staged_bytes
    #: Set by the driver while its consumer asked for no more messages
    #: (``Connection.pause_reading``): ``hand_out`` passes none.
    cdef public bint paused
    # While skipping: the refusal, its head frame being kept, and the
    # bytes still to drop after it.
    cdef object _refused
    cdef Py_ssize_t _skip_left
    # The read-ahead buffer, a view of it, and the unparsed bytes in it.
    cdef bytearray _staging_bytes
    cdef object _staging
    cdef Py_ssize_t _start, _end
    # A one-frame message up to this size passes every limit and fits one
    # slab: _take_small may take it.
    cdef Py_ssize_t _small_max
    cdef State _state
    # Whether the last get_buffer() was a frame's own buffer.
    cdef bint _direct
    # The buffer being filled (frame table or a frame) and how far.
    cdef object _target
    cdef Py_ssize_t _target_size, _pos
    cdef list _infos
    cdef Py_ssize_t _announced, _announced_bytes
    cdef bint _slab
    cdef list _frames
    # A frame's view is None until it is allocated (_open_frame).
    cdef list _views
    cdef object _allocator
    cdef dict _bounce
    cdef Py_ssize_t _index

    def __init__(self, limits, *, handshake=True):
        self.limits = limits
        self.events = Events()
        self.skip_oversized = False
        self.auto_allocate = False
        self.small_as_bytearray = False
        self.paused = False
        self._refused = None
        self._skip_left = 0
        self.staged_bytes = 0
        self._staging_bytes = bytearray(_STAGING_SIZE)
        self._staging = memoryview(self._staging_bytes)
        self._small_max = min(limits.max_frame_bytes, limits.max_message_bytes, _SLAB_MAX)
        self._start = 0
        self._end = 0
        self._state = HANDSHAKE_ if handshake else PRELUDE_
        self._direct = False
        self._set_target(None)
        self._infos = []
        self._announced = 0
        self._announced_bytes = 0
        self._slab = False
        self._frames = []
        self._views = []
        self._allocator = None
        self._bounce = {}
        self._index = 0

    @property
    def frames_announced(self):
        """The next message's frames once its table arrived and before allocation."""
        return self._infos if self._state == ALLOCATE else None

    @property
    def message_buffered(self):
        """True when the announced message fits one slab and all of it is in
        the read-ahead buffer already: allocating it with the default
        allocator completes it at once, and holds no more memory than the
        read-ahead buffer did."""
        return (
            self._state == ALLOCATE
            and self._slab
            and self._end - self._start >= self._announced_bytes
        )

    @property
    def awaiting_handshake(self):
        """True until the peer's handshake has arrived and checked out."""
        return self._state == HANDSHAKE_

    @property
    def mid_message(self):
        """True when the stream stopped inside a message (EOF here is an error)."""
        if self._state in (TABLE, ALLOCATE, FRAMES, SKIP):
            return True
        return self._state == PRELUDE_ and self._end > self._start

    def release(self):
        """Drop every buffer: the stream has ended. Frames of a message cut
        short, messages not handed out and the read-ahead buffer then go by
        reference counting, even while something still refers to the reader
        (issue 21: a cycle kept 80 abandoned 4 MiB messages until the cycle
        collector ran)."""
        self._state = CLOSED
        self.events.clear()
        self._frames, self._views, self._infos = [], [], []
        self._allocator = None
        self._bounce = {}
        self._set_target(None)
        self._refused = None
        self._staging = memoryview(b"")
        self._staging_bytes = bytearray()
        self._start = self._end = 0

    def hand_out(self, receiver, Py_ssize_t budget):
        """Pass the messages at the front of ``events`` to ``receiver``, one
        call each, up to ``budget`` of them; stop before an event that is not
        a message (:class:`Goodbye`, :class:`Refused`), and once ``receiver``
        has set ``paused`` or ended the stream (``release``). Returns how
        many it passed.

        What ``receiver`` raises propagates, its message counted as passed.
        """
        cdef Py_ssize_t handed = 0
        cdef Events events = self.events
        # A MessageReceiver takes each message by a C call.
        cdef MessageReceiver typed = (receiver if isinstance(receiver, MessageReceiver)
                                      else None)
        while handed < budget and not self.paused and events.has_message():
            handed += 1
            if typed is not None:
                typed.receive(events.pop())
            else:
                receiver(events.pop())
        return handed

    def get_buffer(self):
        """Where the next bytes from the stream should be written.

        Raises:
            TensorwireError: the next bytes are a frame's, and allocating it
                failed (see ``_open_frame``).
        """
        cdef Py_ssize_t pending
        if self._target is None and self._state == FRAMES and self._start == self._end:
            # The next bytes are the next frame's: allocate it, so that they
            # land in it straight away.
            self._set_target(self._open_frame())
        if self._target is not None and self._start == self._end:
            if self._target_size - self._pos >= _DIRECT_MIN:
                self._direct = True
                return self._target[self._pos :]
        self._direct = False
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == _STAGING_SIZE:
            pending = self._end - self._start
            self._staging[:pending] = self._staging[self._start : self._end]
            self._start, self._end = 0, pending
        return self._staging[self._end :]

    def buffer_updated(self, Py_ssize_t nbytes):
        """``nbytes`` were written into the last buffer from ``get_buffer``."""
        if self._direct:
            self._pos += nbytes
            if self._pos == self._target_size:
                self._target_done()
        else:
            self._end += nbytes
        self._process()

    def allocate(self, allocator):
        """Allocate the announced message's frames with ``allocator``."""
        cdef list infos, frames, views, slab_views
        cdef Py_ssize_t start, size
        cdef const char* staging
        if self._state != ALLOCATE:
            raise RuntimeError("no message is waiting for allocation")
        infos = self._infos
        if allocator is default_allocator and self._slab:
            frames, slab_views = _slab_frames(infos)
            views = list(slab_views)
            if self._end - self._start >= self._announced_bytes:
                # The whole message is already in the read-ahead buffer: copy
                # it out in one pass (the common case for small RPC messages).
                staging = PyByteArray_AS_STRING(self._staging_bytes)
                start = self._start
                for view in slab_views:
                    size = len(view)
                    _copy_into(view, 0, staging + start, size)
                    start += size
                self._start = start
                self.events.push(frames)
                self._infos = []
                self._state = PRELUDE_
                self._process()
                return
        else:
            # Each frame is allocated once its first bytes are here
            # (_open_frame), not now: a peer that announces frames and never
            # sends them makes us reserve no memory for them.
            self._allocator = allocator
            frames, views = [None] * len(infos), [None] * len(infos)
        self._frames = frames
        self._views = views
        self._index = 0
        self._state = FRAMES
        self._next_frame()
        self._process()

    cdef inline void _set_target(self, target):
        """Fill ``target`` (a writable byte view, or None: nothing) from its start."""
        self._target = target
        self._target_size = 0 if target is None else len(target)
        self._pos = 0

    cdef object _open_frame(self):
        """Allocate the frame whose bytes are due; its view to fill.

        Raises:
            TensorwireError: what the allocator raised, or TransportError
                for anything else it raised or returned amiss.
        """
        cdef Py_ssize_t index = self._index
        info = self._infos[index]
        try:
            buffer = self._allocator(info)
        except TensorwireError:
            raise
        except Exception as exc:
            raise TransportError(f"receive allocator failed: {exc!r}") from exc
        self._frames[index] = buffer
        if info.device == "cpu":
            view = writable_view(buffer, info)
        else:
            # A byte stream cannot write into GPU memory: land the frame in
            # host memory and copy it over once complete.
            bounce = host_empty(info.nbytes)
            self._bounce[index] = bounce
            view = bounce.data
        self._views[index] = view
        return view

    cdef _next_frame(self):
        views = self._views
        while self._index < len(views):
            view = views[self._index]
            if view is None:
                if self._infos[self._index].nbytes:
                    self._set_target(None)  # opened once its bytes come (_process)
                    return
                view = self._open_frame()  # empty: nothing to wait for
            if len(view):
                self._set_target(view)
                return
            self._index += 1
        self._finish_message()

    cdef _finish_message(self):
        if self._bounce:
            from ._device import copy_host_to_device

            for index, bounce in self._bounce.items():
                copy_host_to_device(self._frames[index], bounce)
                self.staged_bytes += bounce.nbytes
            self._bounce = {}
        self.events.push(self._frames)
        self._frames, self._views, self._infos = [], [], []
        self._allocator = None
        self._set_target(None)
        self._state = PRELUDE_

    cdef _target_done(self):
        target = self._target
        self._set_target(None)
        if self._state == SKIP:
            self._refused.head = bytes(target)
            self._report_refused()
        elif self._state == TABLE:
            self._parse_table(target, self._announced)
        else:
            self._index += 1
            self._next_frame()

    cdef _parse_table(self, const unsigned char[::1] table, Py_ssize_t nframes):
        cdef tuple sizes
        cdef bytes codes
        cdef Py_ssize_t i, total
        sizes, codes = decode_sizes(table, nframes, 0)
        cdef bint all_host = codes.count(0) == nframes
        if not all_host:
            for i in range(nframes):
                device_name(codes[i], i)
        try:
            check_limits(sizes, self.limits)
        except LimitExceededError as exc:
            if not self.skip_oversized:
                raise
            self._skip(exc, sizes)
            return
        # Known here already: whether the default allocation is one slab.
        self._announced_bytes = total = sum(sizes)
        self._slab = all_host and total <= _SLAB_MAX
        if all_host:
            self._infos = [FrameInfo(i, sizes[i]) for i in range(nframes)]
        else:
            self._infos = [FrameInfo(i, sizes[i], device_name(codes[i], i))
                           for i in range(nframes)]
        self._state = ALLOCATE

    cdef _skip(self, error, tuple sizes):
        """Drop the announced message's bytes; keep its first frame if small."""
        head = refused_head(sizes, self.limits)
        self._refused = error
        self._skip_left = sum(sizes) - (head or 0)
        self._state = SKIP
        if head:
            self._set_target(memoryview(bytearray(head)))
        else:
            if head == 0:
                error.head = b""
            self._report_refused()

    cdef _report_refused(self):
        """The refusal is known (and its head kept): report it now, not
        after the skipped bytes, which may never come (a peer announcing
        2**40 bytes before its hello is then dropped at once)."""
        error, self._refused = self._refused, None
        self.events.push(Refused(error))
        if not self._skip_left:
            self._state = PRELUDE_

    cdef bint _take_small(self) except -1:
        """Take every small message of one frame already whole in the
        read-ahead buffer, up to the first other one; True: took some.

        The RPC hot path (under ``auto_allocate``). Same checks and result
        as the general path (``allocate(default_allocator)`` after the
        table), a fraction of the work, and one call for all the messages
        one read brought.
        """
        cdef const char* data = PyByteArray_AS_STRING(self._staging_bytes)
        cdef const unsigned char* word
        cdef Py_ssize_t start = self._start, first = self._start, end = self._end
        cdef uint64_t size
        cdef Events events = self.events
        while end - start >= ONE_FRAME_HEADER_SIZE:
            word = <const unsigned char*>data + start
            size = load_u64le(word + 8)
            if (load_u64le(word) != ONE_DATA_PRELUDE_WORD or load_u64le(word + 16) != 0
                    or size > <uint64_t>self._small_max
                    or <uint64_t>(end - start - ONE_FRAME_HEADER_SIZE) < size):
                break
            start += ONE_FRAME_HEADER_SIZE
            if self.small_as_bytearray:
                events.push([PyByteArray_FromStringAndSize(data + start, size)])
            else:
                frame = host_empty(size)
                _copy_into(frame, 0, data + start, size)
                events.push([frame])
            start += size
        self._start = start
        return start != first

    cdef _process(self):
        cdef Py_ssize_t avail, take, size, nframes
        cdef State state
        cdef const unsigned char* data
        while True:
            avail = self._end - self._start
            state = self._state
            if state == SKIP and self._target is None:
                if not avail:
                    return
                take = min(avail, self._skip_left)
                self._start += take
                self._skip_left -= take
                if not self._skip_left:
                    self._state = PRELUDE_
                continue
            if self._target is not None:
                if not avail:
                    return
                take = min(avail, self._target_size - self._pos)
                _copy_into(self._target, self._pos,
                           PyByteArray_AS_STRING(self._staging_bytes) + self._start, take)
                self._start += take
                self._pos += take
                if self._pos == self._target_size:
                    self._target_done()
                continue
            if state == PRELUDE_:
                if avail < _PRELUDE_SIZE:
                    return
                if self.auto_allocate and self._take_small():
                    continue
                data = <const unsigned char*>PyByteArray_AS_STRING(self._staging_bytes)
                data += self._start
                # u8 kind | u8 reserved | u16 reserved | u32 nframes
                if data[1] or data[2] or data[3]:
                    raise ProtocolError("nonzero reserved bytes in message prelude")
                nframes = data[4] | data[5] << 8 | data[6] << 16 | <Py_ssize_t>data[7] << 24
                self._start += _PRELUDE_SIZE
                if data[0] == _KIND_GOODBYE:
                    self._state = CLOSED
                    self.events.push(Goodbye())
                    return
                if data[0] != _KIND_DATA:
                    raise ProtocolError(f"unknown message kind {data[0]}")
                if nframes == 0:
                    self.events.push([])
                    continue
                check_frame_count(nframes, self.limits)
                self._announced = nframes
                size = table_size(nframes)
                if avail - _PRELUDE_SIZE >= size:
                    # The common case: the whole table is already here.
                    table = self._staging[self._start : self._start + size]
                    self._start += size
                    self._parse_table(table, nframes)
                    if self._state != ALLOCATE:
                        continue  # refused: skipping, or skipped already
                    return
                self._set_target(memoryview(bytearray(size)))
                self._state = TABLE
            elif state == FRAMES:
                # The next frame's first bytes are here: allocate it now.
                if not avail:
                    return
                self._set_target(self._open_frame())
            elif state == HANDSHAKE_:
                if avail < _HANDSHAKE_SIZE:
                    return
                check_handshake(self._staging[self._start : self._start + _HANDSHAKE_SIZE])
                self._start += _HANDSHAKE_SIZE
                self._state = PRELUDE_
            else:
                # ALLOCATE waits for the receiver; CLOSED ignores the rest.
                return
