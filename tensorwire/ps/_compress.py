"""Gradient compression: the worker encodes, the shard decodes.

Pure NumPy, no I/O. A compressed chunk is a small dict of arrays and
numbers (it travels through the codec, arrays out of band); ``"codec"``
names the compressor so the shard can decode it.

Lossy compressors keep *error feedback* on the worker (Seide et al. 2014,
"1-bit SGD"; Stich et al. 2018, "Sparsified SGD with memory"): what the
compression dropped from one step's gradient is added to the next step's,
so the sum of what the shards receive tracks the sum of the true gradients.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from ..errors import ConfigError, InvalidArgument

__all__ = (
    "BF16",
    "FP16",
    "Compressor",
    "ErrorFeedback",
    "Int8",
    "NoCompression",
    "TopK",
    "compressor_for",
    "decompress",
    "register_compressor",
)

Array = np.ndarray[Any, Any]
Payload = dict[str, Any]


class Compressor(abc.ABC):
    """How a gradient chunk is encoded for the wire.

    Subclass it, give it a unique ``name`` and register the class with
    :func:`register_compressor` in the worker *and* the shard processes.
    ``compress`` gets a flat float array and returns a payload dict (arrays
    and plain values); ``decompress`` gets that payload back, with
    ``"codec"`` added, and returns a flat array of ``size`` elements of
    ``dtype``.
    """

    name: ClassVar[str]

    #: Whether the worker keeps the compression error and adds it to the next
    #: gradient (see :class:`ErrorFeedback`).
    error_feedback: ClassVar[bool] = False

    @abc.abstractmethod
    def compress(self, grad: Array) -> Payload:
        """Encode one flat gradient chunk."""

    @staticmethod
    @abc.abstractmethod
    def decompress(payload: Payload, size: int, dtype: np.dtype[Any]) -> Array:
        """Decode a payload into a flat array (a fresh one, or a view of it)."""


class NoCompression(Compressor):
    """The gradient as it is."""

    name: ClassVar[str] = "none"

    def compress(self, grad: Array) -> Payload:
        return {"data": grad}

    @staticmethod
    def decompress(payload: Payload, size: int, dtype: np.dtype[Any]) -> Array:
        return np.asarray(payload["data"]).astype(dtype, copy=False)


class FP16(Compressor):
    """IEEE half precision (values beyond 65504 become infinite)."""

    name: ClassVar[str] = "fp16"

    def compress(self, grad: Array) -> Payload:
        return {"data": grad.astype(np.float16)}

    @staticmethod
    def decompress(payload: Payload, size: int, dtype: np.dtype[Any]) -> Array:
        return np.asarray(payload["data"]).astype(dtype)


class BF16(Compressor):
    """bfloat16: float32's range, 8 bits of mantissa, round to nearest even.

    Sent as the upper 16 bits of each float32 (NumPy has no bfloat16).
    """

    name: ClassVar[str] = "bf16"

    def compress(self, grad: Array) -> Payload:
        bits = np.ascontiguousarray(grad, dtype=np.float32).view(np.uint32)
        rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
        upper = ((bits + rounding) >> 16).astype(np.uint16)
        # Rounding must not turn a NaN's payload into infinity.
        upper[np.isnan(grad)] = 0x7FC0
        return {"data": upper}

    @staticmethod
    def decompress(payload: Payload, size: int, dtype: np.dtype[Any]) -> Array:
        upper = np.asarray(payload["data"], dtype=np.uint16)
        return (upper.astype(np.uint32) << 16).view(np.float32).astype(dtype, copy=False)


class Int8(Compressor):
    """Linear quantization to int8 with one scale per chunk (max |g| / 127).

    Lossy, so the worker keeps error feedback.
    """

    name: ClassVar[str] = "int8"
    error_feedback: ClassVar[bool] = True

    def compress(self, grad: Array) -> Payload:
        peak = float(np.max(np.abs(grad))) if grad.size else 0.0
        if not np.isfinite(peak):
            raise InvalidArgument("int8 compression of a gradient holding inf or NaN")
        scale = peak / 127.0 if peak > 0 else 1.0
        quantized = np.rint(grad / scale).astype(np.int8)
        return {"data": quantized, "scale": scale}

    @staticmethod
    def decompress(payload: Payload, size: int, dtype: np.dtype[Any]) -> Array:
        data = np.asarray(payload["data"], dtype=np.int8)
        scale = np.asarray(payload["scale"], dtype=dtype)
        result: Array = data.astype(dtype) * scale
        return result


class TopK(Compressor):
    """Sends the ``ratio`` fraction of entries largest in magnitude (at least one).

    Indices (uint32) and values travel; the rest is kept in the worker's
    error feedback until it grows large enough to be sent.
    """

    name: ClassVar[str] = "topk"
    error_feedback: ClassVar[bool] = True

    def __init__(self, ratio: float = 0.01) -> None:
        if not 0 < ratio <= 1:
            raise ConfigError(f"TopK ratio must be in (0, 1], got {ratio}")
        self.ratio = ratio

    def compress(self, grad: Array) -> Payload:
        k = min(grad.size, max(1, int(grad.size * self.ratio)))
        if k == 0:
            return {"index": np.empty(0, np.uint32), "values": grad[:0]}
        index = np.argpartition(np.abs(grad), grad.size - k)[grad.size - k:]
        index.sort()
        return {"index": index.astype(np.uint32), "values": grad[index]}

    @staticmethod
    def decompress(payload: Payload, size: int, dtype: np.dtype[Any]) -> Array:
        index = np.asarray(payload["index"])
        values = np.asarray(payload["values"])
        if index.shape != values.shape or (index.size and int(index.max()) >= size):
            raise InvalidArgument("top-k payload: indices do not fit the chunk")
        dense = np.zeros(size, dtype)
        dense[index.astype(np.intp)] = values
        return dense


_REGISTRY: dict[str, Callable[[Payload, int, np.dtype[Any]], Array]] = {}


def register_compressor(cls: type[Compressor]) -> type[Compressor]:
    """Make a compressor's payloads decodable in this process (usable as a decorator).

    Raises:
        ConfigError: another class already registered the same name.
    """
    known = _REGISTRY.get(cls.name)
    if known is not None and known is not cls.decompress:
        raise ConfigError(f"a different compressor is registered as {cls.name!r}")
    _REGISTRY[cls.name] = cls.decompress
    return cls


for _cls in (NoCompression, FP16, BF16, Int8, TopK):
    register_compressor(_cls)


def compressor_for(spec: str | Compressor) -> Compressor:
    """A compressor from its name (``"none"``, ``"fp16"``, ``"bf16"``, ``"int8"``,
    ``"topk"``) or the instance itself.

    Raises:
        ConfigError: an unknown name.
    """
    if isinstance(spec, Compressor):
        return spec
    makers: dict[str, Callable[[], Compressor]] = {
        "none": NoCompression, "fp16": FP16, "bf16": BF16, "int8": Int8, "topk": TopK,
    }
    maker = makers.get(spec)
    if maker is None:
        raise ConfigError(f"unknown compression {spec!r}; known: {sorted(makers)}")
    return maker()


def decompress(payload: Payload, size: int, dtype: np.dtype[Any]) -> Array:
    """Decode a payload made by a registered compressor.

    Raises:
        InvalidArgument: unknown codec, or the result does not have ``size`` elements.
    """
    codec = payload.get("codec")
    decoder = _REGISTRY.get(codec) if isinstance(codec, str) else None
    if decoder is None:
        raise InvalidArgument(f"unknown gradient codec {codec!r}; register its Compressor")
    try:
        flat = decoder(payload, size, dtype)
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"bad {codec} payload: {exc}") from None
    flat = np.asarray(flat).reshape(-1)
    if flat.size != size:
        raise InvalidArgument(f"{codec} payload has {flat.size} elements, the chunk {size}")
    return flat


class ErrorFeedback:
    """The worker's residuals: what compression dropped, added back next time.

    ``compress(key, grad)`` compresses ``grad + residual[key]`` and keeps the
    new residual ``(grad + residual) - decompress(payload)``. Compressors
    without ``error_feedback`` pass straight through.
    """

    def __init__(self, compressor: Compressor) -> None:
        self.compressor = compressor
        self.residuals: dict[str, Array] = {}

    def compress(self, key: str, grad: Array) -> Payload:
        """The payload to send for chunk ``key`` (``"codec"`` included)."""
        compressor = self.compressor
        if not compressor.error_feedback:
            payload = compressor.compress(grad)
        else:
            residual = self.residuals.get(key)
            corrected = grad + residual if residual is not None else grad
            payload = compressor.compress(corrected)
            sent = compressor.decompress(payload, corrected.size, corrected.dtype)
            self.residuals[key] = corrected - sent
        payload["codec"] = compressor.name
        return payload
