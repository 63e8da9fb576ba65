"""Sans-IO framing of messages on a byte stream (tcp://, and UCX's control).

Bytes in, messages out; no sockets, no event loop. The asyncio drivers feed
it with ``get_buffer()`` / ``buffer_updated(n)`` (the shape of
``asyncio.BufferedProtocol``), so a large frame is received straight into
the buffer its allocator handed out. The layout is in docs/protocol.md.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from ..errors import LimitExceededError, ProtocolError, TensorwireError, TransportError
from ._frame_table import (
    DEVICE_CODES,
    KIND_DATA,
    KIND_GOODBYE,
    ONE_DATA_PRELUDE,
    ONE_FRAME_SIZE,
    ONE_FRAME_WORDS,
    PRELUDE,
    PRELUDE_SIZE,
    decode_table,
    device_name,
    encode_table,
    table_size,
)
from ._frames import ALIGNMENT, FrameInfo, default_allocator, host_empty, writable_view
from ._limit_checks import check_frame_count, check_limits, refused_head
from .config import Limits

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


def _slab_frames(infos: list[FrameInfo]) -> tuple[list[Any], list[memoryview]]:
    offsets = []
    size = 0
    for info in infos:
        offsets.append(size)
        size += -(-info.nbytes // ALIGNMENT) * ALIGNMENT
    slab = host_empty(size)
    frames = [slab[o : o + info.nbytes] for o, info in zip(offsets, infos, strict=True)]
    return frames, [frame.data for frame in frames]


def check_handshake(data: bytes | bytearray | memoryview) -> None:
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


def pack_header(sizes: Sequence[int], devices: Sequence[str] | None = None) -> bytes:
    """The prelude and frame table that precede a message's frames
    (``devices`` None: all in host memory)."""
    if devices is None or all(d == "cpu" for d in devices):
        return encode_table(sizes)
    return encode_table(sizes, bytes(DEVICE_CODES[d] for d in devices))


def pack_one_frame(nbytes: int) -> bytes:
    """``pack_header([nbytes])``, the common case, at a fraction of the cost."""
    return ONE_FRAME_WORDS.pack(ONE_DATA_PRELUDE, nbytes, 0)


class Goodbye:
    """Event: the peer closed the connection politely."""

    __slots__ = ()


class Refused:
    """Event: a message beyond the limits was skipped (see ``skip_oversized``)."""

    __slots__ = ("error",)

    def __init__(self, error: LimitExceededError) -> None:
        self.error = error


class _State:
    """The reader's states: plain ints, since an attribute of an Enum class
    costs several times a plain one (EnumType.__getattr__), and
    ``_process`` looks at the state for every message."""

    HANDSHAKE = 1
    PRELUDE = 2
    TABLE = 3
    ALLOCATE = 4
    FRAMES = 5
    CLOSED = 6
    SKIP = 7


class FrameReader:
    """Parses a byte stream into messages.

    After ``buffer_updated`` the caller looks at ``events`` (a deque of
    completed messages, each a list of frames, or :class:`Goodbye`) and at
    ``frames_announced``: once a message's table has arrived, the reader waits
    for ``allocate(allocator)``, so the receiver chooses where the frames go.
    The driver stops reading while it waits: a consumer that does not call
    ``recv()`` pushes back on its sender instead of growing a queue.

    Raises (from ``buffer_updated`` and ``allocate``):
        ProtocolError: malformed stream.
        LimitExceededError: a message beyond ``limits``.
    """

    def __init__(self, limits: Limits, *, handshake: bool = True) -> None:
        self.limits = limits
        self.events: deque[list[Any] | Goodbye | Refused] = deque()
        #: Skip a message beyond the limits (a Refused event) instead of
        #: raising LimitExceededError, where its frame table was read.
        self.skip_oversized = False
        #: Allocate every small one-frame host message with the default
        #: allocator as soon as it is whole in the read-ahead buffer, without
        #: stopping at ``frames_announced`` (set by a driver whose consumer
        #: would do just that: see ``StreamConnection.deliver_to``).
        self.auto_allocate = False
        #: With ``auto_allocate``: such a message's frame is a ``bytearray``
        #: copy instead of an aligned NumPy array (see
        #: ``Connection.deliver_to``).
        self.small_as_bytearray = False
        # While skipping: the refusal, its head frame being kept, and the
        # bytes still to drop after it.
        self._refused: LimitExceededError | None = None
        self._skip_left = 0
        #: Bytes of CUDA frames received into host memory and copied up.
        self.staged_bytes = 0
        self._staging_bytes = bytearray(STAGING_SIZE)
        self._staging = memoryview(self._staging_bytes)
        # A one-frame message up to this size passes every limit and fits
        # one slab: _take_small may take it.
        self._small_max = min(limits.max_frame_bytes, limits.max_message_bytes, SLAB_MAX)
        self._start = 0
        self._end = 0
        self._state = _State.HANDSHAKE if handshake else _State.PRELUDE
        self._direct = False
        # The buffer being filled (frame table or a frame) and how far.
        self._target: memoryview | None = None
        self._pos = 0
        self._infos: list[FrameInfo] = []
        self._announced = 0
        self._announced_bytes = 0
        self._slab = False
        self._frames: list[Any] = []
        # A frame's view is None until it is allocated (_open_frame).
        self._views: list[memoryview | None] = []
        self._allocator: Any = None
        self._bounce: dict[int, Any] = {}
        self._index = 0

    @property
    def frames_announced(self) -> list[FrameInfo] | None:
        """The next message's frames once its table arrived and before allocation."""
        return self._infos if self._state == _State.ALLOCATE else None

    @property
    def message_buffered(self) -> bool:
        """True when the announced message fits one slab and all of it is in
        the read-ahead buffer already: allocating it with the default
        allocator completes it at once, and holds no more memory than the
        read-ahead buffer did."""
        return (
            self._state == _State.ALLOCATE
            and self._slab
            and self._end - self._start >= self._announced_bytes
        )

    @property
    def awaiting_handshake(self) -> bool:
        """True until the peer's handshake has arrived and checked out."""
        return self._state == _State.HANDSHAKE

    @property
    def mid_message(self) -> bool:
        """True when the stream stopped inside a message (EOF here is an error)."""
        if self._state in (_State.TABLE, _State.ALLOCATE, _State.FRAMES, _State.SKIP):
            return True
        return self._state == _State.PRELUDE and self._end > self._start

    def release(self) -> None:
        """Drop every buffer: the stream has ended. Frames of a message cut
        short and the read-ahead buffer then go by reference counting, even
        while something still refers to the reader (issue 21: a cycle kept
        80 abandoned 4 MiB messages until the cycle collector ran)."""
        self._state = _State.CLOSED
        self._frames, self._views, self._infos = [], [], []
        self._allocator = None
        self._bounce = {}
        self._target = None
        self._refused = None
        self._staging = memoryview(b"")
        self._staging_bytes = bytearray()
        self._start = self._end = 0

    def get_buffer(self) -> memoryview:
        """Where the next bytes from the stream should be written.

        Raises:
            TensorwireError: the next bytes are a frame's, and allocating it
                failed (see ``_open_frame``).
        """
        target = self._target
        if target is None and self._state == _State.FRAMES and self._start == self._end:
            # The next bytes are the next frame's: allocate it, so that they
            # land in it straight away.
            target = self._target = self._open_frame()
            self._pos = 0
        if target is not None and self._start == self._end:
            remaining = len(target) - self._pos
            if remaining >= DIRECT_MIN:
                self._direct = True
                return target[self._pos :]
        self._direct = False
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == STAGING_SIZE:
            pending = self._end - self._start
            self._staging[:pending] = self._staging[self._start : self._end]
            self._start, self._end = 0, pending
        return self._staging[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        """``nbytes`` were written into the last buffer from ``get_buffer``."""
        if self._direct:
            self._pos += nbytes
            assert self._target is not None
            if self._pos == len(self._target):
                self._target_done()
        else:
            self._end += nbytes
        self._process()

    def allocate(self, allocator: Any) -> None:
        """Allocate the announced message's frames with ``allocator``."""
        if self._state != _State.ALLOCATE:
            raise RuntimeError("no message is waiting for allocation")
        infos = self._infos
        views: list[memoryview | None]
        if allocator is default_allocator and self._slab:
            frames, slab_views = _slab_frames(infos)
            views = list(slab_views)
            if self._end - self._start >= self._announced_bytes:
                # The whole message is already in the read-ahead buffer: copy
                # it out in one pass (the common case for small RPC messages).
                staging, start = self._staging, self._start
                for view in slab_views:
                    size = len(view)
                    view[:] = staging[start : start + size]
                    start += size
                self._start = start
                self.events.append(frames)
                self._infos = []
                self._state = _State.PRELUDE
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
        self._state = _State.FRAMES
        self._next_frame()
        self._process()

    def _open_frame(self) -> memoryview:
        """Allocate the frame whose bytes are due; its view to fill.

        Raises:
            TensorwireError: what the allocator raised, or TransportError
                for anything else it raised or returned amiss.
        """
        index = self._index
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

    def _next_frame(self) -> None:
        views = self._views
        while self._index < len(views):
            view = views[self._index]
            if view is None:
                if self._infos[self._index].nbytes:
                    self._target = None  # opened once its bytes come (_process)
                    return
                view = self._open_frame()  # empty: nothing to wait for
            if len(view):
                self._target, self._pos = view, 0
                return
            self._index += 1
        self._finish_message()

    def _finish_message(self) -> None:
        if self._bounce:
            from ._device import copy_host_to_device

            for index, bounce in self._bounce.items():
                copy_host_to_device(self._frames[index], bounce)
                self.staged_bytes += bounce.nbytes
            self._bounce = {}
        self.events.append(self._frames)
        self._frames, self._views, self._infos = [], [], []
        self._allocator = None
        self._target = None
        self._state = _State.PRELUDE

    def _target_done(self) -> None:
        if self._state == _State.SKIP:
            assert self._target is not None and self._refused is not None
            self._refused.head = bytes(self._target)
            self._target = None
            self._report_refused()
            return
        if self._state == _State.TABLE:
            assert self._target is not None
            table = self._target
            self._target = None
            self._parse_table(table, self._announced)
        else:
            self._index += 1
            self._target = None
            self._next_frame()

    def _parse_table(self, table: memoryview, nframes: int) -> None:
        n = nframes
        sizes, codes = decode_table(table, n)
        all_host = codes.count(0) == n
        if not all_host:
            for index, code in enumerate(codes):
                device_name(code, index)
        try:
            check_limits(sizes, self.limits)
        except LimitExceededError as exc:
            if not self.skip_oversized:
                raise
            self._skip(exc, sizes)
            return
        # Known here already: whether the default allocation is one slab.
        self._announced_bytes = total = sum(sizes)
        self._slab = all_host and total <= SLAB_MAX
        if all_host:
            self._infos = [FrameInfo(i, size) for i, size in enumerate(sizes)]
        else:
            self._infos = [
                FrameInfo(i, size, device_name(code, i))
                for i, (size, code) in enumerate(zip(sizes, codes, strict=True))
            ]
        self._state = _State.ALLOCATE

    def _skip(self, error: LimitExceededError, sizes: Sequence[int]) -> None:
        """Drop the announced message's bytes; keep its first frame if small."""
        head = refused_head(sizes, self.limits)
        self._refused = error
        self._skip_left = sum(sizes) - (head or 0)
        self._state = _State.SKIP
        if head:
            self._target, self._pos = memoryview(bytearray(head)), 0
        else:
            if head == 0:
                error.head = b""
            self._report_refused()

    def _report_refused(self) -> None:
        """The refusal is known (and its head kept): report it now, not
        after the skipped bytes, which may never come (a peer announcing
        2**40 bytes before its hello is then dropped at once)."""
        error, self._refused = self._refused, None
        assert error is not None
        self.events.append(Refused(error))
        self._skip_done()

    def _skip_done(self) -> None:
        if not self._skip_left:
            self._state = _State.PRELUDE

    def _take_small(self) -> bool:
        """Take every small message of one frame already whole in the
        read-ahead buffer, up to the first other one; True: took some.

        The RPC hot path (under ``auto_allocate``). Same checks and result
        as the general path (``allocate(default_allocator)`` after the
        table), a fraction of the work, and one call for all the messages
        one read brought.
        """
        data, staging = self._staging_bytes, self._staging
        start = first = self._start
        end = self._end
        limit = self._small_max
        events = self.events
        as_bytearray = self.small_as_bytearray
        while end - start >= ONE_FRAME_SIZE:
            prelude, size, code = ONE_FRAME_WORDS.unpack_from(data, start)
            if (prelude != ONE_DATA_PRELUDE or code or size > limit
                    or end - start - ONE_FRAME_SIZE < size):
                break
            start += ONE_FRAME_SIZE
            if as_bytearray:
                events.append([data[start : start + size]])
            else:
                frame = host_empty(size)
                frame.data[:] = staging[start : start + size]
                events.append([frame])
            start += size
        self._start = start
        return start != first

    def _process(self) -> None:
        staging = self._staging
        while True:
            avail = self._end - self._start
            state = self._state
            if state == _State.SKIP and self._target is None:
                if not avail:
                    return
                take = min(avail, self._skip_left)
                self._start += take
                self._skip_left -= take
                self._skip_done()
                continue
            if self._target is not None:
                if not avail:
                    return
                take = min(avail, len(self._target) - self._pos)
                self._target[self._pos : self._pos + take] = staging[
                    self._start : self._start + take
                ]
                self._start += take
                self._pos += take
                if self._pos == len(self._target):
                    self._target_done()
                continue
            if state == _State.PRELUDE:
                if avail < PRELUDE_SIZE:
                    return
                if self.auto_allocate and self._take_small():
                    continue
                kind, reserved1, reserved2, nframes = PRELUDE.unpack_from(staging, self._start)
                if reserved1 or reserved2:
                    raise ProtocolError("nonzero reserved bytes in message prelude")
                self._start += PRELUDE_SIZE
                if kind == KIND_GOODBYE:
                    self._state = _State.CLOSED
                    self.events.append(Goodbye())
                    return
                if kind != KIND_DATA:
                    raise ProtocolError(f"unknown message kind {kind}")
                if nframes == 0:
                    self.events.append([])
                    continue
                check_frame_count(nframes, self.limits)
                self._announced = nframes
                size = table_size(nframes)
                if avail - PRELUDE_SIZE >= size:
                    # The common case: the whole table is already here.
                    table = staging[self._start : self._start + size]
                    self._start += size
                    self._parse_table(table, nframes)
                    if self._state != _State.ALLOCATE:
                        continue  # refused: skipping, or skipped already
                    return
                self._target = memoryview(bytearray(size))
                self._pos = 0
                self._state = _State.TABLE
            elif state == _State.FRAMES:
                # The next frame's first bytes are here: allocate it now.
                if not avail:
                    return
                self._target, self._pos = self._open_frame(), 0
            elif state == _State.HANDSHAKE:
                if avail < len(HANDSHAKE):
                    return
                check_handshake(staging[self._start : self._start + len(HANDSHAKE)])
                self._start += len(HANDSHAKE)
                self._state = _State.PRELUDE
            else:
                # ALLOCATE waits for the receiver; CLOSED ignores the rest.
                return
