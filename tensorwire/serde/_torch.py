"""PyTorch tensors. Imported only when a tensor is met or a header names one.

Choices (see docs/protocol.md):

* ``requires_grad``: the tensor is detached (autograd graphs do not cross
  processes) and the flag travels; the decoded tensor is a leaf with
  ``requires_grad=True``.
* Non-contiguous tensors (including expanded ones) are compacted with one
  ``.contiguous()`` copy; conjugate/negative views are resolved (one copy).
* ``torch.nn.Parameter`` and other Tensor subclasses decode as plain tensors.
* Data travels as bytes (a ``torch.uint8`` view), which is how bfloat16 and
  float8, which have no NumPy dtype, cross without ml_dtypes.
* Decoding shares memory with the buffer (``torch.frombuffer``), except for a
  read-only buffer: torch tensors cannot be read-only, so sharing one would
  let the user write to immutable memory (and torch warns); the decoder
  copies it into a fresh ``bytearray`` instead.
"""

from __future__ import annotations

from typing import Any

import torch
from msgpack import ExtType

from ..errors import DecodeError
from . import _buffers
from ._format import (
    ARRAY_HEAD,
    DIMS,
    EXT_ARRAY,
    FLAG_CUDA,
    FLAG_INLINE,
    FLAG_REQUIRES_GRAD,
    KIND_TORCH,
    UnsupportedValueError,
    as_memoryview,
)

# Same element formats as the NumPy codes in _dtypes (torch is little-endian).
_TORCH_CODES: dict[torch.dtype, int] = {
    torch.bool: 0,
    torch.int8: 1,
    torch.uint8: 2,
    torch.int16: 3,
    torch.int32: 5,
    torch.int64: 7,
    torch.float16: 9,
    torch.float32: 10,
    torch.float64: 11,
    torch.complex64: 12,
    torch.complex128: 13,
    torch.bfloat16: 64,
}
for _name, _code in (
    ("uint16", 4),
    ("uint32", 6),
    ("uint64", 8),
    ("float8_e4m3fn", 65),
    ("float8_e5m2", 66),
    ("float8_e4m3fnuz", 67),
    ("float8_e5m2fnuz", 68),
    ("float8_e8m0fnu", 72),
):
    _dt = getattr(torch, _name, None)  # newer torch only
    if isinstance(_dt, torch.dtype):
        _TORCH_CODES[_dt] = _code
_CODE_TO_TORCH: dict[int, torch.dtype] = {code: dt for dt, code in _TORCH_CODES.items()}


def itemsize(code: int) -> int | None:
    """Element size in bytes of a wire dtype code, or None if torch lacks it."""
    dtype = _CODE_TO_TORCH.get(code)
    return None if dtype is None else dtype.itemsize


def is_tensor(obj: object) -> bool:
    """True if ``obj`` is a torch tensor (Parameter and subclasses included)."""
    return isinstance(obj, torch.Tensor)


def encode_tensor(tensor: Any, bufs: list[Any], threshold: int) -> ExtType:
    """Describe a tensor as an EXT_ARRAY of kind torch.

    CPU data below ``threshold`` travels inline in the header; CUDA data always goes out of band
    as a device buffer (a 1-D ``torch.uint8`` CUDA tensor).

    Raises:
        UnsupportedValueError: sparse/quantized/meta tensors, unknown dtypes or
            devices other than cpu and cuda.
    """
    t: torch.Tensor = tensor
    if t.layout is not torch.strided:
        raise UnsupportedValueError(f"torch tensors with layout {t.layout} are not supported")
    code = _TORCH_CODES.get(t.dtype)
    if code is None:
        raise UnsupportedValueError(f"unsupported torch dtype {t.dtype}")
    flags = FLAG_REQUIRES_GRAD if t.requires_grad else 0
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()  # the one copy of a non-contiguous tensor
    ndim = t.dim()
    if ndim > len(DIMS) - 1:
        raise UnsupportedValueError(f"torch tensor has {ndim} dims, more than 64")
    dims = DIMS[ndim].pack(*t.shape)
    flat = t.reshape(-1).view(torch.uint8)  # same memory, as bytes
    device = t.device
    if device.type == "cpu":
        host = flat.numpy()
        if host.nbytes < threshold:
            head = ARRAY_HEAD.pack(KIND_TORCH, code, flags | FLAG_INLINE, ndim, 0, 0)
            return ExtType(EXT_ARRAY, head + dims + host.tobytes())
        head = ARRAY_HEAD.pack(KIND_TORCH, code, flags, ndim, 0, len(bufs))
        bufs.append(as_memoryview(host))
        return ExtType(EXT_ARRAY, head + dims)
    if device.type == "cuda":
        index = device.index or 0
        head = ARRAY_HEAD.pack(KIND_TORCH, code, flags | FLAG_CUDA, ndim, index, len(bufs))
        bufs.append(flat)  # exposes __cuda_array_interface__
        return ExtType(EXT_ARRAY, head + dims)
    raise UnsupportedValueError(f"torch tensors on device {device.type!r} are not supported")


def decode_tensor(
    code: int,
    flags: int,
    device: int,
    shape: tuple[int, ...],
    nbytes: int,
    data: Any,
    index: int,
    inline: bool,
) -> torch.Tensor:
    """Build a tensor on the received bytes (``data``: inline bytes or the buffer).

    Raises:
        DecodeError: unknown dtype, a device buffer whose size differs, a CUDA
            tensor and no CUDA, or ``requires_grad`` on a non-float dtype.
    """
    dtype = _CODE_TO_TORCH.get(code)
    if dtype is None:
        raise DecodeError(f"unknown torch dtype code {code}")
    if not inline and _buffers.is_device(data):
        size = _buffers.device_nbytes(data, index)
        if size != nbytes:
            raise DecodeError(
                f"buffer {index} has {size} bytes, the tensor needs {nbytes} (shape {shape})"
            )
        flat = torch.as_tensor(data, device="cuda")  # zero-copy via the interface
        if flat.dtype is not torch.uint8:
            flat = flat.reshape(-1).view(torch.uint8)
    else:
        if inline:
            host: Any = bytearray(data)
        else:
            host, readonly = _buffers.host_bytes(data, index)
            if host.nbytes != nbytes:
                raise DecodeError(
                    f"buffer {index} has {host.nbytes} bytes, the tensor needs {nbytes} "
                    f"(shape {shape})"
                )
            if readonly:
                host = bytearray(host)  # see the module docstring: no read-only tensors
        if nbytes == 0:
            flat = torch.empty(0, dtype=torch.uint8)
        else:
            flat = torch.frombuffer(host, dtype=torch.uint8)
        if flags & FLAG_CUDA:
            if not torch.cuda.is_available():
                raise DecodeError("header holds a CUDA tensor, but torch has no CUDA device")
            # A host buffer for a device tensor (e.g. a TCP transport): one copy up.
            flat = flat.to(f"cuda:{device}")
    itemsize = dtype.itemsize
    if flat.data_ptr() % itemsize:
        flat = flat.clone()  # misaligned: copy into torch's aligned allocation
    tensor = flat.view(dtype).reshape(shape)
    if flags & FLAG_REQUIRES_GRAD:
        if not (dtype.is_floating_point or dtype.is_complex):
            raise DecodeError(f"requires_grad set on a tensor of dtype {dtype}")
        tensor.requires_grad_()
    return tensor
