"""Headers that would make a few received bytes cost the receiver far more:
broadcast (zero-stride) arrays, and out-of-band bytes whose buffer is not the
size the sender meant."""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import numpy as np
import pytest

from tensorwire import serde
from tensorwire.errors import DecodeError
from tensorwire.serde import _format as F


def _broadcast_bomb() -> tuple[bytes, list[bytes]]:
    """A float32 array of 2**28 elements with stride 0 over a 4-byte buffer."""
    desc = (F.ARRAY_HEAD.pack(F.KIND_NDARRAY, 10, F.FLAG_BROADCAST, 1, 0, 0)
            + struct.pack("<QQ", 1 << 28, 1))
    header = F.PREFIX + struct.pack("<I", 1) + msgpack.packb(msgpack.ExtType(F.EXT_ARRAY, desc))
    return header, [np.zeros(4, dtype=np.uint8).tobytes()]


def test_a_broadcast_array_is_refused_by_default() -> None:
    header, buffers = _broadcast_bomb()
    assert len(header) + len(buffers[0]) < 64
    with pytest.raises(DecodeError, match="zero-stride"):
        serde.decode(header, buffers)
    # Accepted only where the receiver asks for it.
    out = serde.Decoder(limits=serde.Limits(broadcast=True)).decode(header, buffers)
    assert out.shape == (1 << 28,) and out.strides == (0,)


@pytest.mark.parametrize("arr", [
    np.broadcast_to(np.arange(3.0), (100, 3)),
    np.broadcast_to(np.float32(2), (7, 5)),
    np.broadcast_to(np.arange(4.0)[:, None], (4, 6))[::2],
], ids=["rows", "scalar", "strided"])
def test_the_encoder_sends_a_broadcast_array_dense(arr: np.ndarray[Any, Any]) -> None:
    header, buffers = serde.encode(arr)
    out = serde.decode(header, buffers)  # a default decoder takes it
    np.testing.assert_array_equal(out, arr)
    assert out.flags.c_contiguous and out.flags.writeable


@pytest.mark.parametrize("value", [b"b" * 4096, bytearray(b"a" * 4096),
                                   memoryview(b"m" * 4096)], ids=type)
def test_an_out_of_band_bytes_frame_of_the_wrong_size_is_refused(value: object) -> None:
    header, buffers = serde.encode(value)
    (buffer,) = buffers
    assert serde.decode(header, [buffer]) == value
    for wrong in (memoryview(buffer)[:-1], bytes(buffer) + b"!"):
        with pytest.raises(DecodeError, match=r"has 40(95|97) bytes, the header declares 4096"):
            serde.decode(header, [wrong])
