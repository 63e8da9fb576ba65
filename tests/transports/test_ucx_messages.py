"""The ucx:// message header without UCX: what Outgoing builds is what
Announced and the one-inline-frame fast path read back."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tensorwire.errors import LimitExceededError, ProtocolError, TransportError
from tensorwire.transports import Limits
from tensorwire.transports._frame_table import INLINE_FLAG, KIND_DATA
from tensorwire.transports._ucx_messages import (
    INLINE_BYTES,
    ONE_INLINE,
    Announced,
    Outgoing,
    one_inline_frame,
)


class FakeDeviceArray:
    """A device frame as a transport sees one: a CUDA array interface and
    no buffer protocol (no GPU is touched: the header only reads its size)."""

    def __init__(self, shape: tuple[int, ...], strides: tuple[int, ...] | None = None) -> None:
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": shape, "typestr": "<f4", "data": (0, False), "strides": strides,
            "version": 3,
        }


def received(header: bytes) -> bytearray:
    """A header as it sits in the receive buffer: followed by stale bytes."""
    return bytearray(header) + bytearray(b"\xee" * 64)


def test_one_small_bytes_frame_is_inline_and_read_back_by_the_fast_path() -> None:
    out = Outgoing([b"hello"])
    assert out.header == ONE_INLINE.pack(KIND_DATA, 0, 0, 1, 5, INLINE_FLAG) + b"hello"
    assert (out.frames, out.nbytes, out.device) == ([], 5, False)
    buf = received(out.header)
    assert one_inline_frame(buf, INLINE_BYTES, True) == bytearray(b"hello")
    frame = one_inline_frame(buf, INLINE_BYTES, False)
    assert isinstance(frame, np.ndarray) and frame.tobytes() == b"hello"
    assert frame.ctypes.data % 64 == 0


def test_the_fast_path_leaves_every_other_header_to_announced() -> None:
    assert one_inline_frame(received(Outgoing([b"hello"]).header), 4, True) is None
    for frames in ([b"a", b"b"], [bytes(INLINE_BYTES + 1)], [np.arange(4)]):
        header = Outgoing(frames).header
        if len(frames) == 1 and isinstance(frames[0], np.ndarray):
            # One inline frame, but not a bytes object: same header.
            assert one_inline_frame(received(header), INLINE_BYTES, True) == bytearray(
                frames[0].tobytes())
            continue
        assert one_inline_frame(received(header), INLINE_BYTES, True) is None
    assert one_inline_frame(bytearray(10), INLINE_BYTES, True) is None


def test_announced_reads_inline_and_separate_host_and_device_frames() -> None:
    big = np.arange(2000, dtype=np.int64)  # 16,000 bytes: separate
    device = FakeDeviceArray((3, 4))
    out = Outgoing([b"abc", big, b"", device, memoryview(b"xyz")])
    assert out.device
    assert out.nbytes == 3 + big.nbytes + 48 + 3
    assert len(out.frames) == 2 and out.frames[1] is device
    assert bytes(out.frames[0]) == big.tobytes()
    ann = Announced(memoryview(received(out.header)), Limits())
    assert [(i.index, i.nbytes, i.device) for i in ann.infos] == [
        (0, 3, "cpu"), (1, big.nbytes, "cpu"), (2, 0, "cpu"), (3, 48, "cuda"), (4, 3, "cpu")]
    assert {k: bytes(v) for k, v in ann.inline.items()} == {0: b"abc", 4: b"xyz"}
    assert ann.nbytes == out.nbytes


def test_announced_refuses_what_the_limits_refuse_and_bad_headers() -> None:
    header = received(Outgoing([bytes(100), bytes(100)]).header)
    with pytest.raises(LimitExceededError):
        Announced(memoryview(header), Limits(max_frame_bytes=50))
    assert Announced(memoryview(header), Limits(max_frame_bytes=50), check=False).nbytes == 200
    with pytest.raises(ProtocolError):
        Announced(memoryview(bytearray(4)), Limits())
    header[0] = 9
    with pytest.raises(ProtocolError):
        Announced(memoryview(header), Limits())


def test_frames_that_cannot_be_sent_are_refused_before_anything_is_sent() -> None:
    with pytest.raises(TransportError, match="contiguous"):
        Outgoing([np.arange(20)[::2]])
    with pytest.raises(TransportError, match="contiguous"):
        Outgoing([FakeDeviceArray((4, 4), strides=(32, 4))])
    with pytest.raises(TransportError, match="buffer protocol"):
        Outgoing([object()])


@pytest.mark.parametrize("offset", [0, 2, 16, 48, 62])
def test_a_separate_host_frame_tells_where_it_starts_past_a_64_byte_boundary(
        offset: int) -> None:
    raw = np.zeros(20_000 + 128, np.uint8)
    start = (offset - raw.ctypes.data) % 64
    frame = raw[start : start + 20_000]
    assert frame.ctypes.data % 64 == offset
    out = Outgoing([b"head", frame, FakeDeviceArray((2, 2))])
    ann = Announced(memoryview(received(out.header)), Limits())
    assert [(i.device, i.offset) for i in ann.infos] == [
        ("cpu", 0), ("cpu", offset), ("cuda", 0)]
    # An odd address is told rounded down to an even one.
    odd = raw[start + 1 : start + 1 + 19_000]
    (info,) = Announced(memoryview(received(Outgoing([odd]).header)), Limits()).infos
    assert info.offset == offset


def test_an_offset_on_an_inline_or_device_frame_is_a_protocol_error() -> None:
    for frames in ([b"abc"], [FakeDeviceArray((2, 2))]):
        header = received(Outgoing(frames).header)
        header[16] |= 0x7C  # the code byte of frame 0
        with pytest.raises(ProtocolError, match="offset"):
            Announced(memoryview(header), Limits())
    header = received(Outgoing([bytes(8)]).header)
    header[16] = 2  # device code 2 does not exist
    with pytest.raises(ProtocolError, match="device code"):
        Announced(memoryview(header), Limits())
