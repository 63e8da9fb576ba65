"""torch CPU tensors, for real (torch is a test dependency, never a codec import)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tensorwire import serde
from tensorwire.errors import EncodeError

from ._helpers import transport_buffers

torch = pytest.importorskip("torch")

DTYPES = [
    "bool", "int8", "uint8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
    "float64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32",
    "uint64",
]  # fmt: skip


def _make(dtype: Any, shape: tuple[int, ...]) -> Any:
    base = torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape) % 7
    return base.to(dtype)


def _rt(value: Any, **kwargs: Any) -> Any:
    header, buffers = serde.Encoder(**kwargs).encode(value)
    return serde.decode(header, transport_buffers(buffers))


@pytest.mark.parametrize("threshold", [0, 1024])
@pytest.mark.parametrize("shape", [(), (0,), (1,), (2, 3), (64, 64), (4, 0, 2)])
@pytest.mark.parametrize("name", DTYPES)
def test_tensor_roundtrip(name: str, shape: tuple[int, ...], threshold: int) -> None:
    dtype = getattr(torch, name, None)
    if dtype is None:
        pytest.skip(f"torch {torch.__version__} has no {name}")
    t = _make(dtype, shape)
    out = _rt(t, inline_threshold=threshold)
    assert type(out) is torch.Tensor
    assert out.dtype == dtype and out.shape == t.shape and out.device.type == "cpu"
    assert torch.equal(out.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_bfloat16_values() -> None:
    t = torch.linspace(-3, 3, 1000, dtype=torch.bfloat16)
    assert torch.equal(_rt(t), t)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.ones(64, 64)[:, ::2],
        lambda: torch.ones(64, 64).t(),
        lambda: torch.ones(1, 64).expand(64, 64),
        lambda: torch.ones(4, 3, dtype=torch.complex64).conj(),
    ],
    ids=["strided", "transposed", "expanded", "conj"],
)  # fmt: skip
def test_non_contiguous_tensors(make: Any) -> None:
    t = make()
    out = _rt(t)
    assert out.is_contiguous()
    assert torch.equal(out, t.resolve_conj())


def test_encode_zero_copy() -> None:
    t = torch.arange(10_000, dtype=torch.float32)
    _, buffers = serde.encode(t)
    assert isinstance(buffers[0], memoryview) and buffers[0].format == "B"
    assert np.frombuffer(buffers[0], dtype=np.uint8).ctypes.data == t.data_ptr()


def test_decode_zero_copy_and_writable() -> None:
    t = torch.arange(10_000, dtype=torch.bfloat16)
    header, buffers = serde.encode(t)
    received = transport_buffers(buffers)
    out = serde.decode(header, received)
    assert out.data_ptr() == received[0].ctypes.data
    out[0] = 5
    assert received[0][:2].view(np.uint16)[0] == out.view(torch.int16)[0].item()


def test_read_only_buffer_is_copied() -> None:
    t = torch.arange(10_000, dtype=torch.float32)
    header, buffers = serde.encode(t)
    data = bytes(buffers[0])
    out = serde.decode(header, [data])  # no torch warning (filterwarnings=error)
    assert torch.equal(out, t)
    out[0] = 1  # writable: it is our own copy


def test_requires_grad_and_parameter() -> None:
    p = torch.nn.Parameter(torch.ones(3, 3))
    out = _rt({"w": p})["w"]
    assert type(out) is torch.Tensor
    assert out.requires_grad and out.is_leaf
    assert torch.equal(out.detach(), p.detach())


def test_sparse_refused_with_path() -> None:
    with pytest.raises(EncodeError, match=r"layout .* value\['g'\]\[0\]"):
        serde.encode({"g": [torch.eye(3).to_sparse()]})


def test_mixed_with_numpy() -> None:
    value = {"t": torch.ones(300), "n": np.ones(300), "step": 1}
    out = _rt(value)
    assert type(out["t"]) is torch.Tensor and type(out["n"]) is np.ndarray


def test_bfloat16_decodes_without_ml_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    # ml_dtypes is optional; torch's own bfloat16 must not depend on it.
    from tensorwire.serde import _dtypes

    def no_ml_dtypes(code: int) -> None:
        raise AssertionError("the torch path looked up a NumPy dtype")

    t = torch.arange(3000, dtype=torch.bfloat16)
    header, buffers = serde.encode(t)
    monkeypatch.setattr(_dtypes, "dtype_for", no_ml_dtypes)
    assert torch.equal(serde.decode(header, transport_buffers(buffers)), t)
