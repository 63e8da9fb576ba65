"""The decoder trusts nothing: every bad input is a DecodeError that says why."""

from __future__ import annotations

import contextlib
import struct
import tracemalloc
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tensorwire import serde
from tensorwire.errors import DecodeError
from tensorwire.serde import _format as F

from ._helpers import transport_buffers

PREFIX0 = F.PREFIX + struct.pack("<I", 0)


def _header(value: Any, nbufs: int = 0) -> bytes:
    return F.PREFIX + struct.pack("<I", nbufs) + msgpack.packb(value, use_bin_type=True)


def _array_ext(
    kind: int = F.KIND_NDARRAY,
    code: int = 10,
    flags: int = 0,
    shape: tuple[int, ...] = (4,),
    ref: int = 0,
    extra: bytes = b"",
    device: int = 0,
) -> msgpack.ExtType:
    head = F.ARRAY_HEAD.pack(kind, code, flags, len(shape), device, ref)
    return msgpack.ExtType(F.EXT_ARRAY, head + struct.pack(f"<{len(shape)}Q", *shape) + extra)


U8 = np.zeros(16, dtype=np.uint8)

CASES: list[tuple[str, Any, list[Any], str]] = [
    ("empty", b"", [], "shorter than"),
    ("short", b"TWS", [], "shorter than"),
    ("magic", b"XYZ\x01\x00\x00\x00\x00\xc0", [], "not a tensorwire header"),
    ("version", b"TWS\x03\x00\x00\x00\x00\xc0", [], "unsupported header version 3"),
    ("no body", PREFIX0, [], "malformed header"),
    ("truncated", PREFIX0 + b"\x92\x01", [], "malformed header"),
    ("garbage", PREFIX0 + b"\xc1", [], "malformed header"),
    ("trailing", PREFIX0 + b"\xc0\xc0", [], "trailing bytes"),
    ("buffer count", _header(None, 2), [U8], "announces 2 buffers, 1 were given"),
    ("unused buffer", _header(None, 1), [U8], "buffers [0] are not referenced"),
    ("index out of range", _header(_array_ext(ref=3), 1), [U8], "buffer index 3 out of range"),
    ("used twice", _header([_array_ext(), _array_ext()], 1), [U8], "referenced twice"),
    ("size mismatch", _header(_array_ext(shape=(5,)), 1), [U8], "has 16 bytes, shape (5,)"),
    ("huge shape", _header(_array_ext(shape=(10**8, 10**8)), 1), [U8], "max_array_elements"),
    ("overflow dims", _header(_array_ext(shape=(0, 2**64 - 1, 2**64 - 1)), 1), [U8],
     "max_array_elements"),
    ("unknown dtype", _header(_array_ext(code=200), 1), [U8], "unknown dtype code 200"),
    ("unknown kind", _header(_array_ext(kind=9), 1), [U8], "unknown array kind 9"),
    ("unknown flags", _header(_array_ext(flags=0x80), 1), [U8], "unknown array flags"),
    ("ndim", _header(msgpack.ExtType(F.EXT_ARRAY, F.ARRAY_HEAD.pack(0, 10, 0, 65, 0, 0))), [],
     "65 dims"),
    ("truncated dims", _header(msgpack.ExtType(F.EXT_ARRAY, F.ARRAY_HEAD.pack(0, 10, 0, 3, 0, 0)
     + b"\x00" * 9)), [], "truncated (ndim 3)"),
    ("inline size", _header(_array_ext(flags=F.FLAG_INLINE, extra=b"\x00" * 3)), [],
     "inline array data has 3 bytes"),
    ("inline with ref", _header(_array_ext(flags=F.FLAG_INLINE, ref=1)), [],
     "inline array with a buffer index"),
    ("broadcast", _header(_array_ext(flags=F.FLAG_BROADCAST, extra=struct.pack("<Q", 1)), 1),
     [U8], "broadcast (zero-stride) array of shape (4,) is refused"),
    ("unknown ext", _header(msgpack.ExtType(99, b"")), [], "unknown ext type code 99"),
    ("complex size", _header(msgpack.ExtType(F.EXT_COMPLEX, b"123")), [], "complex must be 16"),
    ("bad tuple", _header(msgpack.ExtType(F.EXT_TUPLE, b"\x01")), [], "not a msgpack array"),
    ("garbage tuple", _header(msgpack.ExtType(F.EXT_TUPLE, b"\xc1")), [], "malformed tuple"),
    ("unhashable key", PREFIX0 + b"\x81\x90\x01", [], "unhashable"),
    ("bad utf8", PREFIX0 + b"\xa2\xff\xfe", [], "UTF-8"),
    ("bytes index", _header(msgpack.ExtType(F.EXT_BYTES, b"\x00")), [], "4-byte buffer index"),
    ("bytes mode", _header(msgpack.ExtType(F.EXT_BYTEARRAY, b"\x07")), [], "unknown bytes mode"),
    ("registered shape", _header(msgpack.ExtType(F.EXT_REGISTERED, msgpack.packb(1))), [],
     "expected [name, value]"),
    ("scalar dims", _header(_array_ext(kind=F.KIND_NPSCALAR, flags=F.FLAG_INLINE,
     extra=b"\x00" * 16)), [], "0 dims"),
    ("not a buffer", _header(_array_ext(), 1), [object()], "neither the buffer protocol"),
    ("header type", 12345, [], "buffer protocol"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("header", "buffers", "needle"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_malformed(header: Any, buffers: list[Any], needle: str) -> None:
    with pytest.raises(DecodeError) as info:
        serde.decode(header, buffers)
    assert needle in str(info.value)


def test_deep_nesting_refused() -> None:
    deep = PREFIX0 + b"\x91" * 300 + b"\xc0"
    with pytest.raises(DecodeError, match="max_depth=100"):
        serde.decode(deep, [])
    tuples: Any = None
    for _ in range(150):
        tuples = msgpack.ExtType(F.EXT_TUPLE, msgpack.packb([tuples]))
    with pytest.raises(DecodeError, match="max_depth"):
        serde.decode(_header(tuples), [])
    assert serde.decode(PREFIX0 + b"\x91" * 50 + b"\xc0", []) is not None


def test_header_size_limit() -> None:
    dec = serde.Decoder(limits=serde.Limits(max_header_bytes=64))
    with pytest.raises(DecodeError, match="max_header_bytes=64"):
        dec.decode(_header("x" * 100), [])


def test_huge_claimed_shape_does_not_allocate() -> None:
    # 10**12 float64 elements (8 TB) claimed, a 16-byte buffer given.
    header = _header(_array_ext(code=11, shape=(10**12,)), 1)
    with pytest.raises(DecodeError, match="has 16 bytes"):
        serde.decode(header, [U8])


def test_inline_bytes_cannot_exceed_header() -> None:
    header = PREFIX0 + b"\xc6\xff\xff\xff\xff" + b"x" * 10
    with pytest.raises(DecodeError, match="malformed header"):
        serde.decode(header, [])


def test_device_buffer_for_host_array() -> None:
    class FakeDevice:
        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            return {"shape": (16,), "typestr": "|u1", "data": (0, False), "version": 3}

    with pytest.raises(DecodeError, match="device buffer"):
        serde.decode(_header(_array_ext(), 1), [FakeDevice()])


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "ndarray"])
def test_header_input_types(kind: str) -> None:
    header, buffers = serde.encode({"a": np.arange(1000.0), "b": (1, 2)})
    h: Any = {
        "bytes": header,
        "bytearray": bytearray(header),
        "memoryview": memoryview(header),
        "ndarray": np.frombuffer(header, dtype=np.uint8).copy(),
    }[kind]
    out = serde.decode(h, transport_buffers(buffers))
    assert out["b"] == (1, 2)


# -- properties -------------------------------------------------------------------

_DTYPES = st.sampled_from(
    ["?", "i1", "u1", "<i2", ">u2", "<i4", ">i4", "<u8", ">i8", "<f2", ">f2", "<f4", ">f8",
     "<c8", ">c16"]
).map(np.dtype)  # fmt: skip

_arrays = hnp.arrays(
    _DTYPES,
    hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6),
    elements={"allow_nan": False},
).flatmap(
    lambda a: st.sampled_from(
        [a, a.T, a[::-1] if a.ndim else a, a[..., ::2] if a.ndim else a, np.asfortranarray(a)]
    )
)

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20),
    st.binary(max_size=2000), st.complex_numbers(allow_nan=False),
)  # fmt: skip
_keys = st.one_of(st.text(max_size=5), st.integers(), st.tuples(st.integers(), st.text(max_size=3)))
_values = st.recursive(
    st.one_of(_scalars, _arrays),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(_keys, children, max_size=4),
    ),
    max_leaves=12,
)


def _equal(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


_SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(value=_values, threshold=st.sampled_from([0, 64, 1024]))
def test_property_roundtrip(value: Any, threshold: int) -> None:
    header, buffers = serde.Encoder(inline_threshold=threshold).encode(value)
    assert _equal(serde.decode(header, transport_buffers(buffers)), value)


_VALID = [
    serde.encode(v)
    for v in [
        {"a": np.arange(300.0), "b": [1, (2, 3)], "c": b"x" * 2000},
        (np.ones((3, 4), order="F"), 1 + 2j, 2**70, bytearray(b"q" * 3000)),
        {
            "bc": np.broadcast_to(np.arange(3), (50, 3)),
            "s": np.float32(1),
            "m": memoryview(b"m" * 1500),
        },
    ]
]


@_SETTINGS
@given(
    which=st.integers(0, len(_VALID) - 1),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6),
    cut=st.none() | st.integers(0, 10**6),
    drop_buffer=st.booleans(),
)
def test_property_mutated_headers_only_decode_or_raise(
    which: int, edits: list[tuple[int, int]], cut: int | None, drop_buffer: bool
) -> None:
    header, buffers = _VALID[which]
    mutated = bytearray(header)
    for pos, byte in edits:
        mutated[pos % len(mutated)] = byte
    if cut is not None:
        del mutated[cut % (len(mutated) + 1) :]
    bufs = transport_buffers(buffers)
    if drop_buffer and bufs:
        bufs[0] = bufs[0][: len(bufs[0]) // 2]
    with contextlib.suppress(DecodeError):
        serde.decode(bytes(mutated), bufs)


@_SETTINGS
@given(body=st.binary(max_size=200), nbufs=st.integers(0, 2))
def test_property_random_headers(body: bytes, nbufs: int) -> None:
    with contextlib.suppress(DecodeError):
        serde.decode(F.PREFIX + struct.pack("<I", nbufs) + body, [U8] * nbufs)


# -- the msgpack reader: lengths, nesting and ext codes -----------------------------

HUGE = b"\xff\xff\xff\xff"

TRUNCATED: list[tuple[str, bytes]] = [
    ("map32 count beyond the header", b"\xdf" + HUGE),
    ("map16 count beyond the header", b"\xde\x01\x00" + b"\xc0" * 300),
    ("fixmap missing its entries", b"\x82\xa1a\x01"),
    ("map missing a value", b"\x81\xa1a"),
    ("array32 count beyond the header", b"\xdd" + HUGE),
    ("array16 count beyond the header", b"\xdc\x00\x05\xc0"),
    ("fixarray missing items", b"\x93\x01\x02"),
    ("str32 length beyond the header", b"\xdb" + HUGE + b"abc"),
    ("str8 length beyond the header", b"\xd9\x10abc"),
    ("fixstr length beyond the header", b"\xa5ab"),
    ("bin32 length beyond the header", b"\xc6" + HUGE + b"x"),
    ("ext32 length beyond the header", b"\xc9" + HUGE + b"\x01"),
    ("fixext16 payload cut", b"\xd8\x06" + b"\x00" * 8),
    ("length field cut (str16)", b"\xda\x00"),
    ("length field cut (array32)", b"\xdd\x00\x00"),
    ("length field cut (map16)", b"\xde"),
    ("uint64 cut", b"\xcf\x00\x00\x00"),
    ("float64 cut", b"\xcb\x00\x00"),
    ("float32 cut", b"\xca\x00"),
    ("int16 cut", b"\xd1\x00"),
    ("ext type byte missing", b"\xc7\x00"),
]  # fmt: skip


@pytest.mark.parametrize("body", [c[1] for c in TRUNCATED], ids=[c[0] for c in TRUNCATED])
def test_lengths_past_the_end_are_refused(body: bytes) -> None:
    with pytest.raises(DecodeError, match="malformed header: truncated"):
        serde.decode(PREFIX0 + body, [])
    with pytest.raises(ValueError, match=r"incomplete input|exceeds max_"):
        msgpack.unpackb(body)  # the reference refuses it too


@pytest.mark.parametrize("body", [b"\xdd" + HUGE, b"\xdf" + HUGE, b"\xdb" + HUGE + b"x" * 100])
def test_a_hostile_length_allocates_nothing(body: bytes) -> None:
    # 2**32 items or bytes claimed by a 5-byte header: refused before anything
    # the size of the claim is allocated.
    header = PREFIX0 + body
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError, match="truncated"):
            serde.decode(header, [])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


@pytest.mark.parametrize(
    ("opener", "closer"),
    [(b"\x91", b"\xc0"), (b"\x81\xc0", b"\xc0"), (b"\xdc\x00\x01", b"\xc0"),
     (b"\x81\xa1k", b"\xc0")],
    ids=["fixarray", "fixmap key", "array16", "fixmap value"],
)  # fmt: skip
def test_nesting_past_the_depth_limit(opener: bytes, closer: bytes) -> None:
    dec = serde.Decoder(limits=serde.Limits(max_depth=10))
    assert dec.decode(PREFIX0 + opener * 11 + closer, []) is not None  # depths 0..10
    with pytest.raises(DecodeError, match="max_depth=10"):
        dec.decode(PREFIX0 + opener * 12 + closer, [])


def test_nesting_past_the_depth_limit_in_registered_values() -> None:
    reg = serde.TypeRegistry()

    class Box:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

    reg.register(Box, name="Box", encode=lambda b: b.inner, decode=Box)
    value: Any = None
    for _ in range(12):
        value = Box(value)
    header, _ = serde.Encoder(registry=reg).encode(value)
    with pytest.raises(DecodeError, match="max_depth=10"):
        serde.Decoder(registry=reg, limits=serde.Limits(max_depth=10)).decode(header, [])
    assert type(serde.Decoder(registry=reg).decode(header, [])) is Box


REFUSED_EXT: list[tuple[str, bytes]] = [
    ("msgpack timestamp 32", b"\xd6\xff" + b"\x00" * 4),
    ("msgpack timestamp 64", b"\xd7\xff" + b"\x00" * 8),
    ("msgpack timestamp 96", b"\xc7\x0c\xff" + b"\x00" * 12),
    ("code 0", b"\xd4\x00\x00"),
    ("code 9", b"\xd4\x09\x00"),
    ("code 127", b"\xc7\x00\x7f"),
    ("code -128", b"\xd5\x80\x00\x00"),
]  # fmt: skip


@pytest.mark.parametrize("body", [c[1] for c in REFUSED_EXT], ids=[c[0] for c in REFUSED_EXT])
def test_ext_codes_the_format_does_not_define_are_refused(body: bytes) -> None:
    code = struct.unpack_from("b", body, 2 if body[0] == 0xC7 else 1)[0]
    with pytest.raises(DecodeError, match=f"unknown ext type code {code}$"):
        serde.decode(PREFIX0 + body, [])
    with pytest.raises(DecodeError, match="unknown ext type code"):
        serde.decode(PREFIX0 + b"\x92\x01" + body, [])  # nested too


@pytest.mark.parametrize(
    ("body", "needle"),
    [(_header(msgpack.ExtType(F.EXT_TUPLE, b"\x91\x01\x01"))[8:], "malformed tuple: trailing"),
     (_header(msgpack.ExtType(F.EXT_TUPLE, b"\x92\x01"))[8:], "truncated"),
     (_header(msgpack.ExtType(F.EXT_REGISTERED, msgpack.packb(["nope", 1])))[8:],
      "unknown registered type name 'nope'"),
     (_header(msgpack.ExtType(F.EXT_REGISTERED, msgpack.packb([1, 1])))[8:],
      "expected [name, value]"),
     (b"\xc1", "0xc1")],
    ids=["tuple trailing", "tuple truncated", "registered name", "registered name type", "c1"],
)  # fmt: skip
def test_nested_payloads_are_bounded_by_their_ext(body: bytes, needle: str) -> None:
    with pytest.raises(DecodeError) as info:
        serde.decode(PREFIX0 + body, [])
    assert needle in str(info.value)
