"""Round trips of NumPy values (the table follows Dask protocol/tests/test_numpy.py)."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

from tensorwire import serde
from tensorwire.errors import EncodeError

from ._helpers import roundtrip, transport_buffers

DTYPES = [
    "?", "i1", "u1", "<i2", ">i2", "<u2", ">u2", "<i4", ">i4", "<u4", ">u4", "<i8", ">i8",
    "<u8", ">u8", "<f2", ">f2", "<f4", ">f4", "<f8", ">f8", "<c8", ">c8", "<c16", ">c16",
]  # fmt: skip
SIZES = [0, 1, 2, 3, 2**4, 2**10, 2**16]


def _arrays() -> list[np.ndarray[Any, Any]]:
    x = np.arange(24, dtype="f8").reshape(2, 3, 4)
    return [
        np.array(5.0),  # 0-d
        np.array([], dtype="f4"),
        np.empty((0, 3), dtype="i8"),
        np.empty((3, 0, 2), dtype="<c8"),
        x,
        x[:, ::2],  # non-contiguous
        x[::-1],  # negative strides
        x.T,  # Fortran order
        np.asfortranarray(x),
        np.asfortranarray(x)[:, 1:],  # neither order
        np.broadcast_to(np.arange(3.0), (1000, 3)),  # zero-strided
        np.broadcast_to(np.float32(1), (7, 5)),
        np.broadcast_to(np.arange(4.0)[:, None], (4, 6))[::2],
        np.arange(10, dtype=">i4"),  # big-endian
        np.asfortranarray(np.arange(12, dtype=">f8").reshape(3, 4)),
        np.ones((1, 1, 1), dtype="u2"),
        np.zeros((1 << 16,), dtype="?"),
    ]


@pytest.mark.parametrize("threshold", [0, 1024, 1 << 30])
@pytest.mark.parametrize("arr", _arrays(), ids=lambda a: f"{a.dtype.str}{a.shape}{a.strides}")
def test_array_roundtrip(arr: np.ndarray[Any, Any], threshold: int) -> None:
    out = roundtrip(arr, inline_threshold=threshold)
    assert type(out) is np.ndarray
    assert out.dtype == arr.dtype  # byte order kept
    assert out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)
    if arr.flags.f_contiguous and not arr.flags.c_contiguous:
        assert out.flags.f_contiguous
    assert out.flags.aligned


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_and_size(dtype: str, size: int) -> None:
    rng = np.random.default_rng(size)
    arr = rng.integers(0, 100, size).astype(dtype)
    out = roundtrip(arr)
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out, arr)


@pytest.mark.parametrize(
    "scalar",
    [np.bool_(True), np.int8(-3), np.uint64(2**64 - 1), np.float16(1.5), np.float32(2.5),
     np.float64(-0.0), np.complex64(1 + 2j), np.complex128(3 - 4j), np.int64(-(2**63))],
)  # fmt: skip
def test_numpy_scalars(scalar: np.generic) -> None:
    out = roundtrip(scalar)
    assert type(out) is type(scalar)
    assert out == scalar


def test_broadcast_sends_data_once_where_both_ends_allow_it() -> None:
    arr = np.broadcast_to(np.arange(3.0), (1 << 20, 3))
    limits = serde.Limits(broadcast=True)
    header, buffers = serde.Encoder(limits=limits).encode(arr)
    assert sum(memoryview(b).nbytes for b in buffers) + len(header) < 200
    out = serde.Decoder(limits=limits).decode(header, buffers)
    np.testing.assert_array_equal(out, arr)
    assert not out.flags.writeable  # like np.broadcast_to


def _ptr(a: Any) -> int:
    return int(np.frombuffer(a, dtype=np.uint8).__array_interface__["data"][0])


@pytest.mark.parametrize("order", ["C", "F"])
def test_encode_is_zero_copy(order: str) -> None:
    arr = np.ones((64, 32), dtype="f8", order=order)
    _, buffers = serde.encode(arr)
    assert len(buffers) == 1
    assert isinstance(buffers[0], memoryview)
    assert buffers[0].format == "B"
    assert buffers[0].nbytes == arr.nbytes
    assert _ptr(buffers[0]) == arr.__array_interface__["data"][0]
    assert np.shares_memory(np.frombuffer(buffers[0], dtype=np.uint8), arr)


def test_non_contiguous_is_compacted_once() -> None:
    arr = np.ones((64, 64), dtype="f8")[:, ::2]
    _, buffers = serde.encode(arr)
    assert not np.shares_memory(np.frombuffer(buffers[0], dtype=np.uint8), arr)
    assert buffers[0].nbytes == arr.nbytes


@pytest.mark.parametrize("order", ["C", "F"])
def test_decode_is_zero_copy_and_writable(order: str) -> None:
    arr = np.arange(4096, dtype="<f4").reshape(64, 64).copy(order=order)
    header, buffers = serde.encode(arr)
    received = transport_buffers(buffers)
    out = serde.decode(header, received)
    assert out.__array_interface__["data"][0] == received[0].__array_interface__["data"][0]
    assert out.flags.writeable
    out[0, 0] = 42
    assert np.frombuffer(received[0], dtype="<f4")[0] == 42
    if order == "F":
        assert out.flags.f_contiguous


def test_decode_read_only_buffer_gives_read_only_view() -> None:
    arr = np.arange(1000, dtype="i8")
    header, buffers = serde.encode(arr)
    data = bytes(buffers[0])
    out = serde.decode(header, [data])
    assert not out.flags.writeable
    assert np.shares_memory(out, np.frombuffer(data, dtype=np.uint8))


def test_misaligned_buffer_is_copied_aligned() -> None:
    arr = np.arange(1000, dtype="f8")
    header, buffers = serde.encode(arr)
    raw = np.zeros(arr.nbytes + 1, dtype=np.uint8)
    raw[1:] = np.frombuffer(buffers[0], dtype=np.uint8)
    out = serde.decode(header, [raw[1:]])
    assert out.flags.aligned
    np.testing.assert_array_equal(out, arr)


def test_inline_small_arrays_are_writable_copies() -> None:
    arr = np.arange(4, dtype="f4")
    header, buffers = serde.encode(arr)
    assert buffers == []
    out = serde.decode(header, [])
    assert out.flags.writeable and out.flags.aligned
    np.testing.assert_array_equal(out, arr)


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (np.array([object()], dtype=object), "object arrays"),
        (np.zeros(3, dtype=[("a", "i4"), ("b", "f8")]), "structured dtypes"),
        (np.array(["x"]), "'<U1'"),
        (np.array([1], dtype="M8[ns]"), "'<M8[ns]'"),
        (np.str_("x"), "'<U1'"),
        (np.ma.masked_array([1, 2]), "ndarray subclasses"),
    ],
)
def test_unsupported_numpy_values(value: Any, needle: str) -> None:
    with pytest.raises(EncodeError, match="unsupported") as info:
        serde.encode({"params": [1, 2, 3, value]})
    assert needle in str(info.value)
    assert "value['params'][3]" in str(info.value)


def test_ml_dtypes() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    names = ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]
    for name in names:
        dt = np.dtype(getattr(ml_dtypes, name))
        arr = np.linspace(-2, 2, 2000).astype(dt)
        out = roundtrip({"x": arr, "s": arr[3]})
        assert out["x"].dtype == dt
        assert out["x"].tobytes() == arr.tobytes()
        assert type(out["s"]) is type(arr[3])
    assert "ml_dtypes" in sys.modules
