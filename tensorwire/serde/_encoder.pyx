# cython: language_level=3, annotation_typing=False
"""Encoder: Python values -> (header, buffers).

The encoder walks the value once in Python, with ``type(x) is``-style dispatch
through a dict of handlers, and lowers it to a tree msgpack packs natively:
arrays, tuples, complex numbers, big ints, bytes-likes and registered types
become msgpack ext values (``_format.EXT_*``); large data stays out of band as
zero-copy buffers. One reused msgpack ``Packer`` packs the tree in C. Small
containers first try a fast path that lets the Packer walk them in C and
falls back to the Python walk whenever the result could differ
(``Encoder._encode_fast`` says how that is decided).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Final

import msgpack
import numpy as np
from msgpack import ExtType

from ..errors import ConfigError, EncodeError
from . import _numpy
from ._format import (
    BUFFER_REF,
    BYTES_INLINE,
    BYTES_OUT_OF_BAND,
    COMPLEX,
    EXT_BIGINT,
    EXT_BYTEARRAY,
    EXT_BYTES,
    EXT_COMPLEX,
    EXT_MEMORYVIEW,
    EXT_REGISTERED,
    EXT_TUPLE,
    PREFIX,
    PREFIX_SIZE,
    PREFIX_STRUCT,
    UnsupportedValueError,
    new_ext,
)
from ._limits import Limits
from ._registry import RegisteredType, TypeRegistry, default_registry

#: Default size (bytes) below which array data and bytes are copied into the
#: header instead of going out of band. Measured in bench/results/serde.md: an
#: out-of-band buffer costs a frame (and a syscall iovec) on the transport,
#: while copying < 1 KiB into the header costs about 0.1 us.
DEFAULT_INLINE_THRESHOLD: Final = 1024

# Values msgpack packs natively and exactly; the walk leaves them as they are.
# (Ints beyond 64 bits reach Encoder._default from inside the Packer.)
_NATIVE: Final = frozenset({str, int, float, bool, type(None)})
#: Values packed with no walk (``Encoder.encode``), and the largest packing
#: of one (a 64-bit int or a float: marker byte and eight bytes).
_SCALARS: Final = frozenset({int, float, bool, type(None)})
_SCALAR_MAX_BYTES: Final = 9
# Dict keys kept as they are (keys are always inline, whatever their size).
_NATIVE_KEYS: Final = frozenset({str, int, float, bool, type(None), bytes})

_Handler = Callable[[Any, list[Any], int], Any]


#: The fast path is tried for containers of at most this many items...
_FAST_MAX_ITEMS: Final = 32
#: ...and tuples nested at most this deep (one Packer per level).
_FAST_TUPLE_LEVELS: Final = 4
#: All bytes except msgpack's array and map markers (fix, 16- and 32-bit).
_NOT_CONTAINER: Final = bytes(
    b for b in range(256) if not (0x80 <= b <= 0x9F or b in (0xDC, 0xDD, 0xDE, 0xDF))
)


_BYTES_LIKE: Final = frozenset({bytes, bytearray, memoryview})
#: Precomputed header prefixes for small buffer counts.
_PREFIXES: Final = tuple(PREFIX_STRUCT.pack(PREFIX, n) for n in range(64))
_PREFIXED: Final = len(_PREFIXES)
_NO_BUFFERS_PREFIX: Final = _PREFIXES[0]


class _FallbackError(Exception):
    """Internal: the fast path met something only the walk handles."""


def _render_path(path: list[str]) -> str:
    return "value" + "".join(reversed(path))


class Encoder:
    """Reusable encoder: ``encode(obj) -> (header, buffers)``.

    Buffers are zero-copy views of the caller's memory (a 1-D unsigned-byte
    ``memoryview`` for host data, an object with ``__cuda_array_interface__``
    for device data), ready for ``socket.sendmsg``; the caller must not modify
    the value until the buffers are sent. Exactly one copy is made of a
    non-contiguous array or tensor (to compact it; a broadcast array in full,
    unless ``limits.broadcast``); C- and F-contiguous arrays are never copied
    unless smaller than ``inline_threshold``.

    An Encoder is not thread-safe (it reuses one msgpack Packer); use one per
    thread. The module-level :func:`encode` keeps one per thread for you.

    Args:
        registry: user types; default: the registry :func:`register` fills.
        inline_threshold: data smaller than this many bytes is copied into the
            header; 0 sends every array and bytes-like out of band.
        limits: bounds on depth, header size and buffer count.

    Raises:
        ConfigError: ``inline_threshold`` is negative or not an int.
    """

    __slots__ = (
        "_fast_bufs",
        "_fast_level",
        "_fast_pack",
        "_fast_packers",
        "_handlers",
        "_leaf_handlers",
        "_limits",
        "_max_buffers",
        "_max_depth",
        "_max_header",
        "_packer",
        "_registry",
        "_scalars",
        "_threshold",
    )

    def __init__(
        self,
        *,
        registry: TypeRegistry | None = None,
        inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
        limits: Limits | None = None,
    ) -> None:
        if type(inline_threshold) is not int or inline_threshold < 0:
            raise ConfigError(f"inline_threshold must be an int >= 0, got {inline_threshold!r}")
        self._registry = default_registry if registry is None else registry
        self._threshold = inline_threshold
        self._limits = Limits() if limits is None else limits
        self._max_depth = self._limits.max_depth
        self._packer = msgpack.Packer(default=self._default, use_bin_type=True, autoreset=True)
        handlers: dict[type, _Handler] = {
            dict: self._enc_dict,
            list: self._enc_list,
            tuple: self._enc_tuple,
            bytes: self._enc_bytes,
            bytearray: self._enc_bytearray,
            memoryview: self._enc_memoryview,
            complex: self._enc_complex,
            np.ndarray: _numpy.ndarray_encoder(inline_threshold, self._limits.broadcast),
            np.memmap: _numpy.ndarray_encoder(inline_threshold, self._limits.broadcast),
        }
        for scalar_type in set(np.sctypeDict.values()):
            handlers[scalar_type] = self._enc_npscalar
        self._handlers = handlers
        # Leaves the fast path may meet (see _encode_fast): everything but
        # containers and bytes-likes, which only the walk handles.
        self._leaf_handlers = {
            t: h
            for t, h in handlers.items()
            if t not in (dict, list, tuple, bytes, bytearray, memoryview)
        }
        self._fast_packers = [
            msgpack.Packer(
                default=self._fast_default, use_bin_type=True, autoreset=True, strict_types=True
            )
            for _ in range(_FAST_TUPLE_LEVELS)
        ]
        self._fast_pack = self._fast_packers[0].pack
        self._fast_level = 0
        self._fast_bufs: list[Any] = []
        self._max_header = self._limits.max_header_bytes
        # Types encode() packs at once, when any header of theirs fits.
        self._scalars = (_SCALARS if self._max_header >= PREFIX_SIZE + _SCALAR_MAX_BYTES
                         else frozenset())
        self._max_buffers = self._limits.max_buffers

    @property
    def inline_threshold(self) -> int:
        """Data smaller than this many bytes is inlined into the header."""
        return self._threshold

    @property
    def limits(self) -> Limits:
        """The limits this encoder enforces."""
        return self._limits

    def encode(self, obj: Any) -> tuple[bytes, list[Any]]:
        """Encode ``obj`` into a header and a list of out-of-band buffers.

        Raises:
            EncodeError: a value of an unsupported type (unregistered class,
                object or structured dtype, subclass of a builtin, ...), with
                the type and its path (``value['params'][3]``); nesting deeper
                than ``limits.max_depth``; a header or buffer count beyond
                the limits; a str that is not valid Unicode.
        """
        t = type(obj)
        if t in self._scalars:
            # Nothing to walk or check: a header of a few bytes (an RPC
            # handler's count, flag or None).
            try:
                return _NO_BUFFERS_PREFIX + self._packer.pack(obj), []
            except OverflowError:
                pass  # an int beyond 64 bits: the walk says so
        if (
            (t is dict or t is list or t is tuple)
            and len(obj) <= _FAST_MAX_ITEMS
            # A top-level bytes-like would be packed inline by the fast path,
            # then redone by the walk: skip the copy (e.g. a big blob argument).
            and _BYTES_LIKE.isdisjoint(map(type, obj.values() if t is dict else obj))
        ):
            fast = self._encode_fast(obj)
            if fast is not None:
                return fast
        return self._encode_walk(obj, t)

    def encode_nested(self, obj: list[Any]) -> tuple[bytes, list[Any]]:
        """``encode(obj)`` for a list of a few containers (lists, tuples,
        dicts), as the RPC's ``[args, kwargs]``: the same result and errors,
        without the checks ``encode`` makes first to pick its path.
        """
        fast = self._encode_fast(obj)
        return fast if fast is not None else self._encode_walk(obj, list)

    def _encode_walk(self, obj: Any, t: type) -> tuple[bytes, list[Any]]:
        bufs: list[Any] = []
        try:
            if t in _NATIVE:
                lowered = obj
            else:
                handler = self._handlers.get(t) or self._resolve(t, obj)
                lowered = handler(obj, bufs, 0)
            body = self._packer.pack(lowered)
        except UnsupportedValueError as exc:
            raise EncodeError(f"{exc.message} at {_render_path(exc.path)}") from exc
        except (ValueError, TypeError, OverflowError) as exc:
            raise EncodeError(f"cannot encode value: {exc}") from exc
        nbufs = len(bufs)
        if len(body) + PREFIX_SIZE > self._max_header:
            raise EncodeError(
                f"header of {len(body) + PREFIX_SIZE} bytes exceeds "
                f"limits.max_header_bytes={self._max_header}"
            )
        if nbufs > self._max_buffers:
            raise EncodeError(f"{nbufs} buffers exceed limits.max_buffers={self._max_buffers}")
        if nbufs < _PREFIXED:
            return _PREFIXES[nbufs] + body, bufs
        return PREFIX_STRUCT.pack(PREFIX, nbufs) + body, bufs

    # -- the fast path ----------------------------------------------------------

    def _encode_fast(self, obj: Any) -> tuple[bytes, list[Any]] | None:
        """Pack small values in C, without the Python walk; None: take the walk.

        msgpack's Packer (``strict_types``) walks lists and dicts in C and calls
        ``_fast_default`` only for other types. It differs from the walk only
        for bytes-likes (packed inline as bin whatever their size and type) and
        by not counting depth. Both are detected afterwards on the body: every
        bin starts with a byte 0xc4-0xc6 and every container with a marker byte
        (ext payloads are embedded, so nested tuples are scanned too). A marker
        byte inside other data is a false alarm that only costs the walk.
        """
        bufs: list[Any] = []
        self._fast_bufs = bufs
        try:
            body = self._fast_pack(obj)
        except Exception:  # unsupported or odd value: the walk decides and explains
            self._fast_level = 0
            return None
        finally:
            if bufs:
                self._fast_bufs = []  # keeps no buffer alive
        # Three memchr()s. An int, not bytes: `b"\xc4" in body` tries the
        # int reading first, at the cost of a caught exception.
        if 0xC4 in body or 0xC5 in body or 0xC6 in body:
            return None
        size = len(body)
        if size > self._max_depth and len(body.translate(None, _NOT_CONTAINER)) > self._max_depth:
            return None
        nbufs = len(bufs)
        if size + PREFIX_SIZE > self._max_header or nbufs > self._max_buffers:
            return None
        if nbufs < _PREFIXED:
            return _PREFIXES[nbufs] + body, bufs
        return PREFIX_STRUCT.pack(PREFIX, nbufs) + body, bufs

    def _fast_default(self, obj: Any) -> Any:
        t = type(obj)
        if t is tuple:
            level = self._fast_level + 1
            if level >= _FAST_TUPLE_LEVELS:
                raise _FallbackError
            self._fast_level = level
            try:
                # A busy Packer cannot be re-entered: one per tuple nesting level.
                payload = self._fast_packers[level].pack(list(obj))
            finally:
                self._fast_level = level - 1
            return new_ext((EXT_TUPLE, payload))
        if t is int:
            return self._default(obj)
        handler = self._leaf_handlers.get(t)
        if handler is None:
            raise _FallbackError
        return handler(obj, self._fast_bufs, 0)

    # -- the walk -------------------------------------------------------------

    def _lower(self, obj: Any, bufs: list[Any], depth: int) -> Any:
        t = type(obj)
        if t in _NATIVE:
            return obj
        handler = self._handlers.get(t) or self._resolve(t, obj)
        return handler(obj, bufs, depth)

    def _enc_dict(self, d: dict[Any, Any], bufs: list[Any], depth: int) -> Any:
        if depth >= self._max_depth:
            raise UnsupportedValueError(f"nesting deeper than limits.max_depth={self._max_depth}")
        depth += 1
        out: dict[Any, Any] | None = None
        handlers = self._handlers
        start = len(bufs)
        for k, v in d.items():
            tk = type(k)
            if tk is not str and tk not in _NATIVE_KEYS:
                del bufs[start:]  # start over on the slow path, without duplicates
                return self._enc_dict_keys(d, bufs, depth)
            tv = type(v)
            if tv in _NATIVE:
                continue
            try:
                r = (handlers.get(tv) or self._resolve(tv, v))(v, bufs, depth)
            except UnsupportedValueError as exc:
                exc.path.append(f"[{k!r}]")
                raise
            if out is None:
                out = dict(d)  # copy on write: the caller's dict is never changed
            out[k] = r
        return d if out is None else out

    def _enc_dict_keys(self, d: dict[Any, Any], bufs: list[Any], depth: int) -> Any:
        # Slow path for dicts with keys msgpack cannot pack as they are (tuples).
        out: dict[Any, Any] = {}
        for k, v in d.items():
            tk = type(k)
            if tk is tuple:
                try:
                    key = self._enc_tuple(k, bufs, depth)
                except UnsupportedValueError as exc:
                    exc.path.append(f".keys()[{k!r}]")
                    raise
            elif tk in _NATIVE_KEYS:
                key = k
            else:
                err = UnsupportedValueError(
                    f"unsupported dict key type {tk.__module__}.{tk.__qualname__}"
                )
                err.path.append(f".keys()[{k!r}]")
                raise err
            try:
                out[key] = self._lower(v, bufs, depth)
            except UnsupportedValueError as exc:
                exc.path.append(f"[{k!r}]")
                raise
        return out

    def _enc_list(self, lst: list[Any], bufs: list[Any], depth: int) -> Any:
        if depth >= self._max_depth:
            raise UnsupportedValueError(f"nesting deeper than limits.max_depth={self._max_depth}")
        depth += 1
        out: list[Any] | None = None
        handlers = self._handlers
        for i, v in enumerate(lst):
            tv = type(v)
            if tv in _NATIVE:
                continue
            try:
                r = (handlers.get(tv) or self._resolve(tv, v))(v, bufs, depth)
            except UnsupportedValueError as exc:
                exc.path.append(f"[{i}]")
                raise
            if out is None:
                out = list(lst)
            out[i] = r
        return lst if out is None else out

    def _enc_tuple(self, tup: tuple[Any, ...], bufs: list[Any], depth: int) -> ExtType:
        items = self._enc_list(list(tup), bufs, depth)
        return ExtType(EXT_TUPLE, self._packer.pack(items))

    def _enc_bytes(self, b: bytes, bufs: list[Any], depth: int) -> Any:
        if len(b) < self._threshold:
            return b  # msgpack bin, inline
        ref = len(bufs)
        bufs.append(memoryview(b))
        return ExtType(EXT_BYTES, BUFFER_REF.pack(ref, len(b)))

    def _enc_bytes_like(self, code: int, mv: memoryview, bufs: list[Any]) -> ExtType:
        if not mv.c_contiguous:
            mv = memoryview(mv.tobytes())  # the one copy of a strided memoryview
        elif mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        if mv.nbytes < self._threshold:
            return ExtType(code, bytes((BYTES_INLINE,)) + mv.tobytes())
        ref = len(bufs)
        bufs.append(mv)
        return ExtType(code, bytes((BYTES_OUT_OF_BAND,)) + BUFFER_REF.pack(ref, mv.nbytes))

    def _enc_bytearray(self, b: bytearray, bufs: list[Any], depth: int) -> ExtType:
        return self._enc_bytes_like(EXT_BYTEARRAY, memoryview(b), bufs)

    def _enc_memoryview(self, mv: memoryview, bufs: list[Any], depth: int) -> ExtType:
        return self._enc_bytes_like(EXT_MEMORYVIEW, mv, bufs)

    def _enc_complex(self, c: complex, bufs: list[Any], depth: int) -> ExtType:
        return ExtType(EXT_COMPLEX, COMPLEX.pack(c.real, c.imag))

    def _enc_npscalar(self, value: Any, bufs: list[Any], depth: int) -> ExtType:
        return _numpy.encode_scalar(value, bufs, self._threshold)

    def _default(self, obj: Any) -> Any:
        # Called by the Packer only for what it cannot pack: ints beyond the
        # 64-bit range (the walk has lowered everything else).
        if type(obj) is int:
            size = (obj.bit_length() + 8) // 8  # +1 bit for the sign
            return ExtType(EXT_BIGINT, obj.to_bytes(size, "little", signed=True))
        raise TypeError(f"unexpected {type(obj).__qualname__} in the lowered value")

    def _resolve(self, t: type, obj: Any) -> _Handler:
        """Find (and cache) the handler of a type the dispatch dict lacks."""
        entry = self._registry.for_type(t)
        if entry is not None:
            handler = self._registered_handler(entry)
            self._handlers[t] = handler  # cache: registrations are immutable
            return handler
        module = t.__module__ or ""
        # Lazy libraries: looked at only when such an object is met, so that
        # encoding NumPy values never imports torch or cupy.
        if module.startswith("torch") and "torch" in sys.modules:
            from . import _torch

            if _torch.is_tensor(obj):
                self._handlers[t] = self._leaf_handlers[t] = self._enc_torch
                return self._enc_torch
        if module.startswith("cupy") and "cupy" in sys.modules:
            from . import _cupy

            if _cupy.is_cupy_array(obj):
                self._handlers[t] = self._leaf_handlers[t] = self._enc_cupy
                return self._enc_cupy
        if isinstance(obj, np.generic):  # e.g. ml_dtypes.bfloat16 scalars
            self._handlers[t] = self._leaf_handlers[t] = self._enc_npscalar
            return self._enc_npscalar
        name = f"{module}.{t.__qualname__}"
        if isinstance(obj, np.ndarray):
            why = "ndarray subclasses are not supported; pass np.asarray(x)"
        elif isinstance(obj, (dict, list, tuple, str, int, float, bytes)):
            why = "subclasses of builtins would decode as another type; register it or convert"
        else:
            why = "register it with tensorwire.serde.register()"
        raise UnsupportedValueError(f"unsupported type {name}: {why}")

    def _enc_torch(self, obj: Any, bufs: list[Any], depth: int) -> ExtType:
        from . import _torch

        return _torch.encode_tensor(obj, bufs, self._threshold)

    def _enc_cupy(self, obj: Any, bufs: list[Any], depth: int) -> ExtType:
        from . import _cupy

        return _cupy.encode_cupy(obj, bufs, self._threshold)

    def _registered_handler(self, entry: RegisteredType) -> _Handler:
        name = entry.name
        encode_fn = entry.encode

        def handler(obj: Any, bufs: list[Any], depth: int) -> ExtType:
            if depth >= self._max_depth:
                raise UnsupportedValueError(
                    f"nesting deeper than limits.max_depth={self._max_depth}"
                )
            try:
                inner = encode_fn(obj)
            except Exception as exc:
                raise UnsupportedValueError(
                    f"encode function of registered type {name!r} raised {exc!r}"
                ) from exc
            lowered = self._lower(inner, bufs, depth + 1)
            return ExtType(EXT_REGISTERED, self._packer.pack((name, lowered)))

        return handler
