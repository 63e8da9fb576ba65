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
import functools
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeAlias

import numpy as np

from ..errors import ConfigError, InvalidArgument
from ._arrays import array_module

__all__ = (
    "BF16",
    "FP8",
    "FP8E4M3",
    "FP8E5M2",
    "FP16",
    "LINK_CLASSES",
    "CompressionSpec",
    "Compressor",
    "ErrorFeedback",
    "Int8",
    "LinkFeedback",
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
        data = payload["data"]
        grad: Array = array_module(data).asarray(data).astype(dtype, copy=False)
        return grad


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


@functools.cache
def _fp8_dtype(fmt: str) -> np.dtype[Any]:
    """The ml_dtypes float8 type (imported on first use, like serde does)."""
    import ml_dtypes

    dtype: np.dtype[Any] = np.dtype(getattr(ml_dtypes, fmt))
    return dtype


@functools.cache
def _fp8_values(fmt: str) -> np.ndarray[Any, np.dtype[np.float64]]:
    """The value of each of the 256 codes, for decoding by table lookup.

    A lookup with the scale folded into the 256 entries is one pass over the
    chunk, several times faster than ml_dtypes' cast followed by a multiply.
    """
    values = np.arange(256, dtype=np.uint8).view(_fp8_dtype(fmt)).astype(np.float64)
    values.flags.writeable = False
    return values


@functools.cache
def _fp8_codes(fmt: str) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The fp8 code of each float32 whose low 16 bits are zero, by its high 16 bits."""
    high = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    with np.errstate(invalid="ignore", over="ignore"):
        codes = high.view(np.float32).astype(_fp8_dtype(fmt)).view(np.uint8)
    codes.flags.writeable = False
    return codes


def _float32_to_fp8(scaled: np.ndarray[Any, np.dtype[np.float32]], fmt: str) -> Array:
    """Round finite float32 values within the format's range to fp8 codes.

    The same codes as ml_dtypes' cast (round to nearest even), at about three
    times its speed: the value is first rounded to its high 16 bits *to
    odd* (truncate, then set the last bit if anything nonzero was cut),
    which never changes the final rounding to fewer bits (Boldo and
    Melquiond 2008, "Emulation of FMA and correctly rounded sums: proved
    algorithms using rounding to odd"; fp8 keeps at most 3 of bfloat16's 7
    mantissa bits), and a 65536-entry table does the rest.
    """
    bits = scaled.view(np.uint32)
    # (low 16 bits + 0xFFFF) carries into bit 16 exactly when they are nonzero.
    index = np.bitwise_and(bits, np.uint32(0xFFFF))
    index += np.uint32(0xFFFF)
    index |= bits
    index >>= np.uint32(16)
    codes: Array = np.take(_fp8_codes(fmt), index)
    return codes


class FP8(Compressor):
    """8-bit floating point with one scale per chunk (``ml_dtypes`` formats).

    The chunk is scaled so that its largest magnitude lands on the format's
    largest finite value, then rounded to nearest even: every entry keeps
    about the same *relative* precision (3 mantissa bits for e4m3, 2 for
    e5m2) instead of int8's uniform steps, which small entries of a chunk
    with one large outlier lose entirely. Entries below the format's
    smallest subnormal (relative to the chunk's peak, 2**-17 for e4m3,
    2**-32 for e5m2) become zero, and error feedback sends them later. The
    scale travels as a float64, so a chunk whose peak is itself a float32
    subnormal still round-trips. A chunk of zeros gets scale 1.0.

    Sent as one byte per entry (the raw fp8 codes as uint8) plus the scale.
    Lossy, so the worker keeps error feedback. Use :class:`FP8E4M3` (more
    precision, range 448; the better default for gradients) or
    :class:`FP8E5M2` (more range, 57344; matters little with a per-chunk scale).
    """

    name: ClassVar[str] = "fp8"
    error_feedback: ClassVar[bool] = True
    #: The ml_dtypes type name.
    format: ClassVar[str]
    #: Largest finite value of the format.
    fmax: ClassVar[float]

    def compress(self, grad: Array) -> Payload:
        fp8 = _fp8_dtype(self.format)
        if not grad.size:
            return {"data": np.empty(0, np.uint8), "scale": 1.0}
        # max and -min are two passes without the temporary that abs() makes;
        # a NaN anywhere propagates into them.
        peak = max(float(grad.max()), -float(grad.min()))
        if not np.isfinite(peak):
            raise InvalidArgument(f"{self.name} compression of a gradient holding inf or NaN")
        if peak == 0.0:
            return {"data": np.zeros(grad.size, np.uint8), "scale": 1.0}
        scale = peak / self.fmax
        factor = self.fmax / peak
        # |grad| * factor <= fmax up to one rounding, far below the point
        # where the cast would overflow to NaN (fmax plus half a step).
        if grad.dtype.itemsize <= 4 and factor < 1e37:
            scaled = np.multiply(grad, factor, dtype=np.float32)
            return {"data": _float32_to_fp8(scaled, self.format), "scale": scale}
        # float64 gradients, and a peak that is (near) a float32 subnormal so
        # that 1/scale overflows float32: scale in float64, let ml_dtypes round.
        scaled64 = np.multiply(grad, factor, dtype=np.float64)
        return {"data": scaled64.astype(fp8).view(np.uint8), "scale": scale}

    @classmethod
    def _decode(cls, payload: Payload, dtype: np.dtype[Any]) -> Array:
        data = np.asarray(payload["data"])
        if data.dtype != np.uint8 or data.ndim != 1:
            raise ValueError(f"data must be a flat uint8 array, got {data.dtype} {data.shape}")
        scale = float(payload["scale"])
        if not (np.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be positive and finite, got {scale}")
        # The products are rounded once, from float64, so a scale that is
        # subnormal in ``dtype`` loses nothing.
        table = (_fp8_values(cls.format) * scale).astype(dtype)
        result: Array = np.take(table, data)
        return result


class FP8E4M3(FP8):
    """FP8 e4m3 (``ml_dtypes.float8_e4m3fn``: no infinities, largest 448); also ``"fp8"``."""

    name: ClassVar[str] = "fp8_e4m3"
    format: ClassVar[str] = "float8_e4m3fn"
    fmax: ClassVar[float] = 448.0

    @staticmethod
    def decompress(payload: Payload, size: int, dtype: np.dtype[Any]) -> Array:
        return FP8E4M3._decode(payload, dtype)


class FP8E5M2(FP8):
    """FP8 e5m2 (``ml_dtypes.float8_e5m2``: IEEE-like, largest 57344)."""

    name: ClassVar[str] = "fp8_e5m2"
    format: ClassVar[str] = "float8_e5m2"
    fmax: ClassVar[float] = 57344.0

    @staticmethod
    def decompress(payload: Payload, size: int, dtype: np.dtype[Any]) -> Array:
        return FP8E5M2._decode(payload, dtype)


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


for _cls in (NoCompression, FP16, BF16, Int8, FP8E4M3, FP8E5M2, TopK):
    register_compressor(_cls)

_MAKERS: dict[str, Callable[[], Compressor]] = {
    "none": NoCompression, "fp16": FP16, "bf16": BF16, "int8": Int8, "topk": TopK,
    "fp8": FP8E4M3, "fp8_e4m3": FP8E4M3, "fp8_e5m2": FP8E5M2,
}

#: The link classes a compression mapping may name: ``"local"``, a shard on
#: the worker's own host; ``"remote"``, a shard on another host.
LINK_CLASSES = ("local", "remote")

#: One compression for every link, or one per link class
#: (``{"local": None, "remote": "fp8"}``; a missing class means ``"none"``).
CompressionSpec: TypeAlias = (
    "str | Compressor | Mapping[str, str | Compressor | None] | None"
)


def _one(spec: object) -> Compressor:
    if spec is None:
        return NoCompression()
    if isinstance(spec, Compressor):
        return spec
    maker = _MAKERS.get(spec) if isinstance(spec, str) else None
    if maker is None:
        raise ConfigError(f"unknown compression {spec!r}; known: {sorted(_MAKERS)}, "
                          f"a Compressor, None, or a mapping of {LINK_CLASSES} to those")
    return maker()


def compressor_for(spec: CompressionSpec, *, link: str = "remote") -> Compressor:
    """The compressor for one link class.

    ``spec`` is a name (``"none"``, ``"fp16"``, ``"bf16"``, ``"int8"``,
    ``"fp8"`` = ``"fp8_e4m3"``, ``"fp8_e5m2"``, ``"topk"``), a
    :class:`Compressor` instance (returned as is), None (no compression),
    or a mapping from link class to one of those, such as
    ``{"local": None, "remote": "fp8"}``: a class the mapping leaves out
    gets no compression. ``link`` is ``"local"`` for a shard on the
    worker's own host (where compressing a shared-memory copy costs more
    than it saves) and ``"remote"`` (the default) for one on another host.
    Every entry of a mapping is checked, not only ``link``'s.

    Raises:
        ConfigError: an unknown name, link class or mapping key.
    """
    if link not in LINK_CLASSES:
        raise ConfigError(f"unknown link class {link!r}; known: {LINK_CLASSES}")
    if isinstance(spec, Mapping):
        unknown = sorted(map(repr, set(spec) - set(LINK_CLASSES)))
        if unknown:
            raise ConfigError(f"compression mapping has unknown link classes "
                              f"{', '.join(unknown)}; known: {LINK_CLASSES}")
        chosen = {key: _one(value) for key, value in spec.items()}
        return chosen[link] if link in chosen else NoCompression()
    return _one(spec)


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
    grad: Array = array_module(flat).asarray(flat).reshape(-1)  # host or device, as it came
    if grad.size != size:
        raise InvalidArgument(f"{codec} payload has {grad.size} elements, the chunk {size}")
    return grad


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
            # The residual's buffer is this object's own: reusing it for the
            # corrected gradient and then the new residual saves two fresh
            # chunk-sized arrays (and their page faults) per push.
            if residual is not None and residual.shape == grad.shape \
                    and residual.dtype == grad.dtype:
                corrected = np.add(grad, residual, out=residual)
            else:
                corrected = grad + residual if residual is not None else grad
            payload = compressor.compress(corrected)
            sent = compressor.decompress(payload, corrected.size, corrected.dtype)
            if corrected is grad or any(isinstance(v, np.ndarray) and
                                        np.may_share_memory(v, corrected)
                                        for v in payload.values()):
                # Never write into the caller's gradient, nor into a payload
                # that a compressor built as a view of its input.
                self.residuals[key] = corrected - sent
            else:
                self.residuals[key] = np.subtract(corrected, sent, out=corrected)
        payload["codec"] = compressor.name
        return payload


class LinkFeedback:
    """A worker's error feedback per link class (``"local"``, ``"remote"``:
    each its own compressor from ``spec``, see :func:`compressor_for`), so
    that each chunk's residual stays with the compressor of the shard it
    lives on, also when the chunk moves to another shard."""

    def __init__(self, spec: CompressionSpec) -> None:
        self._spec = spec
        #: The error feedback of each link class met so far.
        self.by_link: dict[str, ErrorFeedback] = {}
        #: Residuals of chunks that moved to a shard whose compressor keeps
        #: none: added to the chunk's next gradient once.
        self.carry: dict[str, Array] = {}

    def of(self, link: str) -> ErrorFeedback:
        """The error feedback of ``link``'s class."""
        found = self.by_link.get(link)
        if found is None:
            found = self.by_link[link] = ErrorFeedback(compressor_for(self._spec, link=link))
        return found

    def compress(self, key: str, grad: Array, link: str) -> Payload:
        """The payload of chunk ``key``'s gradient for a shard of ``link``'s
        class, with the residual the chunk carried from its last shard."""
        carried = self.carry.pop(key, None)
        if carried is not None:
            grad = grad + carried
        return self.of(link).compress(key, grad)

    def clear(self) -> None:
        """Forget every residual (they belong to a layout that is gone)."""
        self.by_link.clear()
        self.carry.clear()

    def moved(self, key: str, was: str, now: str) -> None:
        """Chunk ``key`` moved from a shard of class ``was`` to one of
        ``now``: its residual goes with it, to the new class's feedback,
        or to ``carry`` when that compressor keeps none."""
        if was == now or was not in self.by_link:
            return
        residual = self.by_link[was].residuals.pop(key, None)
        if residual is None:
            return
        target = self.of(now)
        if target.compressor.error_feedback:
            target.residuals[key] = residual
        else:
            self.carry[key] = residual
