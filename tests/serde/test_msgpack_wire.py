"""The header body is msgpack exactly as msgpack-python writes and reads it.

The encoder and decoder write and read msgpack themselves (``_encoder.pyx``,
``_decoder.pyx``); msgpack-python is the reference: the same bytes out for
the same values, the same values in.
"""

from __future__ import annotations

import math
import re
import struct
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgpack import ExtType

from tensorwire import serde
from tensorwire.serde import _format as F

PREFIX0 = F.PREFIX + struct.pack("<I", 0)
# Every bytes value inline (as msgpack's bin), as msgpack writes them.
ENCODER = serde.Encoder(inline_threshold=1 << 30)
INT64_MIN, UINT64_MAX = -(1 << 63), (1 << 64) - 1


def _reference(value: Any) -> bytes:
    return msgpack.Packer(use_bin_type=True).pack(_lowered(value))


def _lowered(value: Any) -> Any:
    """``value`` with the ext types of docs/protocol.md spelled out as ExtType."""
    t = type(value)
    if t is list:
        return [_lowered(v) for v in value]
    if t is dict:
        return {_lowered(k): _lowered(v) for k, v in value.items()}
    if t is tuple:
        return ExtType(F.EXT_TUPLE, _reference(list(value)))
    if t is complex:
        return ExtType(F.EXT_COMPLEX, struct.pack("<dd", value.real, value.imag))
    if t is int and not INT64_MIN <= value <= UINT64_MAX:
        size = (value.bit_length() + 8) // 8
        return ExtType(F.EXT_BIGINT, value.to_bytes(size, "little", signed=True))
    return value


def _same(a: Any, b: Any) -> bool:
    """Equal values of the same types all the way down (True is not 1; NaN is NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, complex):
        return _same(a.real, b.real) and _same(a.imag, b.imag)
    return bool(a == b)


_native_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(INT64_MIN, UINT64_MAX), st.floats(),
    st.text(max_size=40), st.binary(max_size=300),
)  # fmt: skip
_keys = st.one_of(st.text(max_size=8), st.integers(INT64_MIN, UINT64_MAX), st.binary(max_size=8),
                  st.booleans(), st.none(), st.floats(allow_nan=False))  # fmt: skip
_native = st.recursive(
    _native_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=20), st.dictionaries(_keys, children, max_size=20)
    ),
    max_leaves=40,
)
_ext_scalars = st.one_of(
    _native_scalars, st.integers(), st.complex_numbers(), st.integers(-(1 << 300), 1 << 300)
)
_with_ext = st.recursive(
    _ext_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=20),
        st.lists(children, max_size=20).map(tuple),
        st.dictionaries(st.one_of(_keys, st.tuples(st.integers(), st.text(max_size=3))), children,
                        max_size=20),
    ),
    max_leaves=40,
)
_SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(value=_native)
def test_native_values_encode_to_msgpacks_bytes(value: Any) -> None:
    header, buffers = ENCODER.encode(value)
    assert buffers == []
    assert header[:8] == PREFIX0
    assert header[8:] == msgpack.Packer(use_bin_type=True).pack(value)


@_SETTINGS
@given(value=_native)
def test_msgpacks_bytes_decode_to_the_value(value: Any) -> None:
    assert _same(serde.decode(PREFIX0 + msgpack.packb(value, use_bin_type=True)), value)


@_SETTINGS
@given(value=_with_ext)
def test_ext_values_are_msgpack_ext_types(value: Any) -> None:
    header, _ = ENCODER.encode(value)
    assert header[8:] == _reference(value)
    assert _same(serde.decode(PREFIX0 + _reference(value)), value)


LENGTHS = [0, 1, 15, 16, 31, 32, 255, 256, 65535, 65536]


@pytest.mark.parametrize("n", LENGTHS)
def test_every_length_form(n: int) -> None:
    # fix, 8-, 16- and 32-bit lengths of str, bin, array and map.
    for value in ("x" * n, b"x" * n, [None] * n, {i: None for i in range(n)}):
        header, _ = ENCODER.encode(value)
        assert header[8:] == msgpack.packb(value, use_bin_type=True)
        assert serde.decode(header) == value


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16, 17, 255, 256, 65535, 65536])
def test_every_ext_length_form(n: int) -> None:
    # fixext 1/2/4/8/16 and ext 8/16/32: an inline bytearray's payload is 1 + its size.
    value = bytearray(b"y" * (n - 1))
    header, _ = ENCODER.encode(value)
    payload = bytes((F.BYTES_INLINE,)) + bytes(value)
    assert header[8:] == msgpack.packb(ExtType(F.EXT_BYTEARRAY, payload))
    assert serde.decode(header) == value


@pytest.mark.parametrize(
    "value",
    [0, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, (1 << 63) - 1, 1 << 63,
     UINT64_MAX, -1, -32, -33, -128, -129, -(1 << 15), -(1 << 15) - 1, -(1 << 31),
     -(1 << 31) - 1, INT64_MIN, UINT64_MAX + 1, INT64_MIN - 1, 0.0, -0.0, math.inf, math.nan,
     1e308, 5e-324],
)  # fmt: skip
def test_number_forms(value: Any) -> None:
    header, _ = ENCODER.encode(value)
    assert header[8:] == _reference(value)
    assert _same(serde.decode(header), value)


def test_float32_is_read_as_float() -> None:
    body = msgpack.Packer(use_single_float=True).pack(1.5)
    assert body[0] == 0xCA
    out = serde.decode(PREFIX0 + body)
    assert type(out) is float and out == 1.5


def test_duplicate_keys_keep_the_last_value_as_msgpack_does() -> None:
    body = b"\x82\xa1k\x01\xa1k\x02"
    assert serde.decode(PREFIX0 + body) == msgpack.unpackb(body) == {"k": 2}


def test_nested_tuples_and_registered_values_close_their_ext_headers() -> None:
    # Each level's payload length is known only once it is written: lengths
    # across the 8- and 16-bit forms at every level.
    for n in (0, 1, 14, 250, 300, 70000):
        value = ((("z" * n,), [("q",)] * 3), {(1, "k"): ("v" * n,)})
        header, _ = ENCODER.encode(value)
        assert header[8:] == _reference(value)
        assert serde.decode(header) == value


def test_the_protocol_docs_example_is_what_encode_writes() -> None:
    """docs/protocol.md's example header, byte for byte (it once said v1)."""
    text = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text()
    block = text.split("### Example", 1)[1].split("```", 2)[1]
    written = bytearray()
    for line in block.splitlines():
        for token in line.split():
            if not re.fullmatch(r"[0-9a-f]{2}", token):
                break
            written.append(int(token, 16))
    header, buffers = serde.encode({"w": np.zeros(1024, "<f4"), "step": 3})
    assert [memoryview(b).nbytes for b in buffers] == [4096]
    assert bytes(header) == bytes(written)
