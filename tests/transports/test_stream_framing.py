"""The sans-IO framing, without sockets: any chunking gives the same messages."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorwire.errors import LimitExceededError, ProtocolError, TransportError
from tensorwire.transports import FrameInfo, Limits
from tensorwire.transports._frames import default_allocator
from tensorwire.transports._stream_framing import (
    DIRECT_MIN,
    GOODBYE,
    HANDSHAKE,
    FrameReader,
    Goodbye,
    pack_header,
    pack_one_frame,
)


def stream_of(messages: list[list[bytes]]) -> bytes:
    out = [HANDSHAKE]
    for frames in messages:
        out.append(pack_header([len(f) for f in frames], ["cpu"] * len(frames)))
        out.extend(frames)
    return b"".join(out)


def feed(reader: FrameReader, data: bytes, chunks: list[int]) -> list[Any]:
    """Feed ``data`` in pieces of the given sizes (cycled); allocate on demand."""
    events: list[Any] = []
    pos, turn = 0, 0
    while True:
        while reader.frames_announced is not None:
            reader.allocate(default_allocator)
        while reader.events:
            events.append(reader.events.popleft())
        if pos == len(data):
            return events
        buffer = reader.get_buffer()
        assert len(buffer) > 0
        step = min(len(buffer), chunks[turn % len(chunks)], len(data) - pos)
        turn += 1
        buffer[:step] = data[pos : pos + step]
        pos += step
        reader.buffer_updated(step)


frame_sizes = st.one_of(
    st.integers(0, 300),
    st.sampled_from([DIRECT_MIN - 1, DIRECT_MIN, DIRECT_MIN + 1, 3 * DIRECT_MIN]),
)
messages_st = st.lists(st.lists(frame_sizes, max_size=6), min_size=1, max_size=6)


@settings(max_examples=40, deadline=None)
@given(messages_st, st.lists(st.integers(1, 200_000), min_size=1, max_size=5), st.booleans())
def test_any_chunking_yields_the_messages(
    sizes: list[list[int]], chunks: list[int], auto: bool
) -> None:
    messages = [
        [bytes([(m + f) % 256]) * size for f, size in enumerate(frame_sizes)]
        for m, frame_sizes in enumerate(sizes)
    ]
    reader = FrameReader(Limits())
    # With auto_allocate, small one-frame messages skip frames_announced.
    reader.auto_allocate = auto
    events = feed(reader, stream_of(messages), chunks)
    assert [[bytes(f) for f in e] for e in events] == messages
    for event in events:
        for frame in event:
            assert frame.dtype == np.uint8 and frame.flags.writeable
            assert frame.nbytes == 0 or frame.ctypes.data % 64 == 0


@pytest.mark.parametrize(
    ("limits", "size"),
    [(Limits(max_frame_bytes=10), 11), (Limits(max_message_bytes=15), 16)],
)
def test_auto_allocate_still_checks_the_limits(limits: Limits, size: int) -> None:
    reader = FrameReader(limits)
    reader.auto_allocate = True
    data = stream_of([[b"a" * 10], [b"b" * size]])
    buffer = reader.get_buffer()
    buffer[: len(data)] = data
    with pytest.raises(LimitExceededError, match=f"of {size} bytes exceeds"):
        reader.buffer_updated(len(data))
    assert [bytes(f) for f in reader.events.popleft()] == [b"a" * 10]


def test_large_frames_are_received_in_place() -> None:
    reader = FrameReader(Limits())
    size = 4 * DIRECT_MIN
    header = HANDSHAKE + pack_header([size], ["cpu"])
    buffer = reader.get_buffer()
    buffer[: len(header)] = header
    reader.buffer_updated(len(header))
    assert reader.frames_announced == [FrameInfo(0, size, "cpu")]
    target = np.empty(size, np.uint8)
    reader.allocate(lambda info: target)
    view = reader.get_buffer()
    # The reader hands out the frame's own memory, not a staging buffer.
    assert np.frombuffer(view, np.uint8).ctypes.data == target.ctypes.data
    assert len(view) == size
    view[:] = b"\7" * size
    reader.buffer_updated(size)
    (message,) = reader.events
    assert message[0] is target and target.sum() == 7 * size


def test_goodbye_ends_the_stream() -> None:
    reader = FrameReader(Limits())
    events = feed(reader, HANDSHAKE + GOODBYE + b"ignored", [100])
    assert len(events) == 1 and isinstance(events[0], Goodbye)
    assert not reader.mid_message


def test_mid_message_is_reported() -> None:
    reader = FrameReader(Limits())
    data = stream_of([[b"abcdef"]])
    feed(reader, data[:-2], [1000])
    assert reader.mid_message


@pytest.mark.parametrize(
    ("limits", "sizes", "match"),
    [
        (Limits(max_frames=2), [1, 1, 1], "3 frames exceeds the limit of 2"),
        (Limits(max_frame_bytes=10), [11], "frame of 11 bytes exceeds the limit of 10"),
        (Limits(max_message_bytes=15), [8, 8], "message of 16 bytes exceeds the limit of 15"),
    ],
)
def test_limits_are_checked_before_allocation(
    limits: Limits, sizes: list[int], match: str
) -> None:
    reader = FrameReader(limits)
    data = HANDSHAKE + pack_header(sizes, ["cpu"] * len(sizes))
    buffer = reader.get_buffer()
    buffer[: len(data)] = data
    with pytest.raises(LimitExceededError, match=match):
        reader.buffer_updated(len(data))
    assert reader.frames_announced is None


@pytest.mark.parametrize(("allocator", "match"), [
    (lambda info: np.empty(9, np.uint8), "9 bytes for frame 0 of 10"),
    (lambda info: bytes(10), "read-only"),
    (lambda info: 1 / 0, "receive allocator failed: ZeroDivisionError"),
])
def test_allocator_must_give_exact_writable_memory(allocator: Any, match: str) -> None:
    reader = FrameReader(Limits())
    data = HANDSHAKE + pack_header([10], ["cpu"])
    reader.get_buffer()[: len(data)] = data
    reader.buffer_updated(len(data))
    reader.allocate(allocator)  # called once the frame's bytes are due
    with pytest.raises(TransportError, match=match):
        reader.get_buffer()


def test_frames_are_allocated_only_when_their_bytes_are_due() -> None:
    """A peer that announces frames and never sends them makes the reader
    reserve nothing for them (issue 21)."""
    reader = FrameReader(Limits())
    size = 4 * DIRECT_MIN
    data = HANDSHAKE + pack_header([size, size], ["cpu", "cpu"])
    reader.get_buffer()[: len(data)] = data
    reader.buffer_updated(len(data))
    allocated: list[int] = []

    def allocator(info: FrameInfo) -> Any:
        allocated.append(info.index)
        return np.empty(info.nbytes, np.uint8)

    reader.allocate(allocator)
    assert allocated == []
    view = reader.get_buffer()  # the driver is about to read frame 0
    assert allocated == [0] and len(view) == size
    view[:] = b"\1" * size
    reader.buffer_updated(size)
    assert allocated == [0]
    reader.get_buffer()
    assert allocated == [0, 1]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_after_handshake_gives_protocol_errors_only(garbage: bytes) -> None:
    reader = FrameReader(Limits(max_frame_bytes=1 << 20, max_message_bytes=1 << 20))
    with contextlib.suppress(ProtocolError, LimitExceededError):
        feed(reader, HANDSHAKE + garbage, [7, 64])


def test_handshake_is_checked() -> None:
    with pytest.raises(ProtocolError, match="not a tensorwire endpoint"):
        feed(FrameReader(Limits()), b"SSH-2.0-OpenSSH", [100])
    with pytest.raises(ProtocolError, match="version 2"):
        feed(FrameReader(Limits()), b"TWIR\x02\0\0\0", [100])


def test_message_buffered_only_for_a_small_message_wholly_in_the_read_ahead_buffer() -> None:
    reader = FrameReader(Limits())
    small = stream_of([[b"abc", b"defg"]])
    buffer = reader.get_buffer()
    buffer[: len(small) - 1] = small[:-1]
    reader.buffer_updated(len(small) - 1)
    assert reader.frames_announced is not None
    assert not reader.message_buffered  # one byte is still missing
    reader.get_buffer()[:1] = small[-1:]
    reader.buffer_updated(1)
    assert reader.message_buffered
    reader.allocate(default_allocator)
    assert [bytes(f) for f in reader.events.popleft()] == [b"abc", b"defg"]

    big = pack_header([DIRECT_MIN * 2], ["cpu"])
    reader.get_buffer()[: len(big)] = big
    reader.buffer_updated(len(big))
    assert reader.frames_announced is not None
    assert not reader.message_buffered  # beyond one slab: its allocator decides


@pytest.mark.parametrize("size", [0, 1, 4096, 2**40])
def test_pack_one_frame_is_the_one_frame_header(size: int) -> None:
    assert pack_one_frame(size) == pack_header([size]) == pack_header([size], ["cpu"])


def _reader_with(messages: list[bytes], *, goodbye: bool = False) -> FrameReader:
    """A reader that parsed ``messages`` (one frame each) from one read."""
    reader = FrameReader(Limits())
    reader.auto_allocate = True
    data = stream_of([[m] for m in messages]) + (GOODBYE if goodbye else b"")
    reader.get_buffer()[: len(data)] = data
    reader.buffer_updated(len(data))
    return reader


def test_one_read_parses_every_complete_message() -> None:
    reader = _reader_with([b"m%d" % i for i in range(100)], goodbye=True)
    assert len(reader.events) == 101
    assert isinstance(reader.events[-1], Goodbye)


def test_hand_out_passes_at_most_the_budget_and_stops_before_the_goodbye() -> None:
    reader = _reader_with([b"a", b"b", b"c"], goodbye=True)
    got: list[bytes] = []
    assert reader.hand_out(lambda message: got.append(bytes(message[0])), 2) == 2
    assert reader.hand_out(lambda message: got.append(bytes(message[0])), 2) == 1
    assert got == [b"a", b"b", b"c"]
    assert reader.hand_out(got.append, 2) == 0
    assert isinstance(reader.events[0], Goodbye)


def test_hand_out_stops_once_the_receiver_pauses_or_ends_the_stream() -> None:
    reader = _reader_with([b"a", b"b", b"c", b"d"])

    def pause(message: list[Any]) -> None:
        reader.paused = True

    assert reader.hand_out(pause, 10) == 1
    assert reader.hand_out(pause, 10) == 0  # still paused
    reader.paused = False

    def end(message: list[Any]) -> None:
        reader.release()

    assert reader.hand_out(end, 10) == 1
    assert not reader.events  # released with the stream


def test_what_the_receiver_raises_propagates_and_the_rest_stays() -> None:
    reader = _reader_with([b"a", b"b"])

    def fail(message: list[Any]) -> None:
        raise ValueError("consumer bug")

    with pytest.raises(ValueError, match="consumer bug"):
        reader.hand_out(fail, 10)
    assert len(reader.events) == 1
