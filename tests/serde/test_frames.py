"""Encoder.encode_frames and Decoder.decode_frames: a value as one list of
frames (the header, then the buffers), as the RPC core encodes and decodes
every call's arguments and result."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tensorwire import serde

from ._helpers import transport_buffers

VALUES: list[Any] = [
    7,
    None,
    "text",
    [[1, 2.5, "a"], {"k": b"v"}],
    {"big": np.arange(10_000.0), "small": np.arange(3), "t": (1, 2)},
    [b"x" * 5000, memoryview(b"y" * 4000), np.ones((40, 40), order="F")],
]


@pytest.mark.parametrize("value", VALUES, ids=range(len(VALUES)))
def test_encode_frames_is_encode_as_one_list(value: Any) -> None:
    encoder = serde.Encoder()
    header, buffers = encoder.encode(value)
    frames = encoder.encode_frames(value)
    assert frames[0] == header
    assert [bytes(memoryview(f)) for f in frames[1:]] == [bytes(memoryview(b)) for b in buffers]


@pytest.mark.parametrize("value", VALUES, ids=range(len(VALUES)))
def test_decode_frames_round_trip(value: Any) -> None:
    frames = serde.Encoder().encode_frames(value)
    decoded = serde.Decoder().decode_frames([frames[0], *transport_buffers(frames[1:])])
    header, buffers = serde.encode(value)
    expected = serde.decode(header, transport_buffers(buffers))
    assert _plain(decoded) == _plain(expected)


def test_one_frame_without_buffers() -> None:
    frames = serde.Encoder().encode_frames([1, "a"])
    assert len(frames) == 1 and type(frames[0]) is bytes
    assert serde.Decoder().decode_frames(frames) == [1, "a"]


def test_decode_frames_refuses_no_frames_and_missing_buffers() -> None:
    decoder = serde.Decoder()
    with pytest.raises(serde.DecodeError, match="no frames"):
        decoder.decode_frames([])
    frames = serde.Encoder().encode_frames(np.arange(10_000.0))
    with pytest.raises(serde.DecodeError, match="announces 1 buffers, 0 were given"):
        decoder.decode_frames(frames[:1])


def test_encode_frames_errors_as_encode() -> None:
    class Unknown:
        pass

    encoder = serde.Encoder()
    with pytest.raises(serde.EncodeError, match=r"value\[1\]\['k'\]"):
        encoder.encode_frames([1, {"k": Unknown()}])
    assert encoder.encode_frames(3) == [encoder.encode(3)[0]]  # usable again


def test_encode_frames_of_a_registered_type_that_encodes_again() -> None:
    # A registered encode function that calls the same encoder meanwhile
    # gets a fresh one: the outer frames are unchanged.
    registry = serde.TypeRegistry()
    encoder = serde.Encoder(registry=registry, inline_threshold=0)

    class Box:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

    def encode_box(box: Box) -> Any:
        encoder.encode_frames(["inner", np.arange(5)])
        return box.inner

    registry.register(Box, name="box", encode=encode_box, decode=Box)
    frames = encoder.encode_frames([Box(np.arange(4.0)), np.arange(3)])
    assert len(frames) == 3
    value = serde.Decoder(registry=registry).decode_frames(frames)
    assert isinstance(value[0], Box)
    np.testing.assert_array_equal(value[0].inner, np.arange(4.0))
    np.testing.assert_array_equal(value[1], np.arange(3))


def _plain(value: Any) -> Any:
    """``value`` with arrays and views as comparable lists and bytes."""
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tolist())
    if isinstance(value, memoryview):
        return ("view", value.tobytes())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    return value
