# cython: language_level=3, annotation_typing=False
"""Decoder: (header, buffers) -> Python values.

The decoder unpacks the body in one C call; an ``ext_hook`` rebuilds the ext
values, checking every size against the buffers it was given. Nothing in a
header can make it allocate more than the header's own size: every length is
checked against data that is already present.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Final

import msgpack
import numpy as np

from ..errors import DecodeError
from . import _buffers, _dtypes, _numpy
from ._format import (
    ARRAY_HEAD,
    ARRAY_HEAD_SIZE,
    BUFFER_REF,
    BYTES_INLINE,
    BYTES_OUT_OF_BAND,
    COMPLEX,
    DIMS,
    EXT_ARRAY,
    EXT_BIGINT,
    EXT_BYTEARRAY,
    EXT_BYTES,
    EXT_COMPLEX,
    EXT_MEMORYVIEW,
    EXT_REGISTERED,
    EXT_TUPLE,
    FLAG_BROADCAST,
    FLAG_FORTRAN,
    FLAG_INLINE,
    FLAGS_KNOWN,
    KIND_CUPY,
    KIND_NDARRAY,
    KIND_NPSCALAR,
    KIND_TORCH,
    MAX_NDIM,
    PREFIX,
    PREFIX_SIZE,
    PREFIX_STRUCT,
    U64,
    as_memoryview,
)
from ._limits import Limits
from ._registry import TypeRegistry, default_registry

_CONTAINERS: Final = (list, tuple, dict)
_U8: Final = np.dtype(np.uint8)
#: Shared "no buffers" state; never written (every index is out of its range).
_NO_BUFFERS: Final = bytearray()
_FAST_MAX: Final = ARRAY_HEAD_SIZE + 8 * MAX_NDIM
CODE_TO_DTYPE: Final = _dtypes.CODE_TO_DTYPE

#: A header up to this size is sliced (a copy) rather than viewed.
_SMALL_HEADER: Final = 4096
#: The header prefix of a value without buffers (decode()'s first path).
_NO_BUFFERS_PREFIX: Final = PREFIX_STRUCT.pack(PREFIX, 0)


class Decoder:
    """Reusable decoder: ``decode(header, buffers) -> obj``.

    Arrays are views of the given buffers, never copies: writable when the
    buffer is writable, read-only when it is not (``bytes``). A decoded view
    keeps its receive buffer alive for as long as it lives; copy the array to
    let the buffer go. Two documented copies: data inlined in the header
    (small by construction) is copied so that it is writable, and a buffer
    misaligned for its dtype is copied into an aligned allocation (buffers
    from the transports are always aligned). ``bytes`` and ``bytearray``
    values are copies; ``memoryview`` values are views.

    A Decoder is not thread-safe; use one per thread. The module-level
    :func:`decode` keeps one per thread for you.

    Args:
        registry: user types; default: the registry :func:`register` fills.
        limits: bounds on depth, header size, buffers and array size;
            broadcast (zero-stride) arrays are refused unless
            ``limits.broadcast``.
    """

    __slots__ = (
        "_bufs",
        "_depth",
        "_limits",
        "_max_buffers",
        "_max_depth",
        "_max_elements",
        "_max_header",
        "_registry",
        "_small_max",
        "_taken",
        "_used",
    )

    def __init__(
        self, *, registry: TypeRegistry | None = None, limits: Limits | None = None
    ) -> None:
        self._registry = default_registry if registry is None else registry
        self._limits = Limits() if limits is None else limits
        self._max_depth = self._limits.max_depth
        self._max_elements = self._limits.max_array_elements
        self._max_header = self._limits.max_header_bytes
        self._max_buffers = self._limits.max_buffers
        # Headers up to this size without buffers take decode()'s first path.
        self._small_max = min(_SMALL_HEADER, self._max_header)
        self._bufs: Sequence[Any] = ()
        self._used = _NO_BUFFERS  # idle: no call in progress
        self._taken = 0
        self._depth = 0

    @property
    def limits(self) -> Limits:
        """The limits this decoder enforces."""
        return self._limits

    def decode(self, header: Any, buffers: Sequence[Any] = ()) -> Any:
        """Decode a header and its buffers back into a value.

        Args:
            header: bytes, bytearray, memoryview or a 1-D uint8 NumPy array.
            buffers: the out-of-band buffers, in order: objects with the buffer
                protocol (uint8 arrays, bytes, bytearray, memoryview) or device
                buffers exposing ``__cuda_array_interface__``.

        Raises:
            DecodeError: anything wrong with the input, with what was wrong: bad
                magic or version, truncated or garbage msgpack, unknown ext
                code, dtype or registered name, a buffer index out of range or
                used twice, unused buffers, a shape whose byte size does not
                match its data, too many dims, depth or sizes beyond the
                limits, invalid UTF-8, unhashable dict keys.
        """
        kind = type(header)
        if (
            (kind is bytes or kind is bytearray)
            and not buffers
            and header.startswith(_NO_BUFFERS_PREFIX)
            and (size := len(header)) <= self._small_max
            and self._used is _NO_BUFFERS
        ):
            # The small RPC message: the checks below in one (prefix, version
            # and no buffers), and no state to save (see the general case).
            try:
                value = msgpack.unpackb(
                    header[PREFIX_SIZE:], ext_hook=self._ext_hook, strict_map_key=False
                )
            except Exception as exc:  # trust nothing; see below
                raise _as_decode_error(exc) from None
            if size - PREFIX_SIZE > self._max_depth:
                self._check_depth(value, 0)
            return value
        if kind is bytes or kind is bytearray:
            # No memoryview; a slice copy is cheaper for small headers.
            size = len(header)
            body: Any = (header[PREFIX_SIZE:] if size <= _SMALL_HEADER
                         else memoryview(header)[PREFIX_SIZE:])
            view: Any = header
        else:
            try:
                view = memoryview(header)
            except TypeError:
                raise DecodeError(
                    f"header must support the buffer protocol, got {type(header).__qualname__}"
                ) from None
            if view.ndim != 1 or view.itemsize != 1:
                raise DecodeError("header must be a 1-D buffer of bytes")
            size = view.nbytes
            body = view[PREFIX_SIZE:]
        if size < PREFIX_SIZE:
            raise DecodeError(
                f"header of {size} bytes is shorter than its {PREFIX_SIZE}-byte prefix"
            )
        if size > self._max_header:
            raise DecodeError(
                f"header of {size} bytes exceeds limits.max_header_bytes={self._max_header}"
            )
        prefix, nbufs = PREFIX_STRUCT.unpack_from(view)
        if prefix != PREFIX:
            if prefix[:3] != PREFIX[:3]:
                raise DecodeError(f"not a tensorwire header (magic {bytes(prefix[:3])!r})")
            raise DecodeError(
                f"unsupported header version {prefix[3]} (this decoder reads {PREFIX[3]})"
            )
        if nbufs != len(buffers):
            raise DecodeError(f"header announces {nbufs} buffers, {len(buffers)} were given")
        if nbufs > self._max_buffers:
            raise DecodeError(f"{nbufs} buffers exceed limits.max_buffers={self._max_buffers}")
        if not nbufs and self._used is _NO_BUFFERS:
            # No buffers and (at the top level) idle state: nothing to save,
            # and the state is back to idle when unpackb returns (_nested
            # restores the depth). The common small-RPC case.
            try:
                value = msgpack.unpackb(body, ext_hook=self._ext_hook, strict_map_key=False)
            except Exception as exc:  # trust nothing; see below
                raise _as_decode_error(exc) from None
            if size - PREFIX_SIZE > self._max_depth:
                self._check_depth(value, 0)
            return value
        # Save and restore the per-call state: a registered decode function may
        # call this decoder again.
        saved = (self._bufs, self._used, self._taken, self._depth)
        self._bufs = buffers
        self._used = bytearray(nbufs) if nbufs else _NO_BUFFERS
        self._taken = 0
        self._depth = 0
        try:
            try:
                # unpackb bounds every str/bin/array/map/ext length by len(body).
                value = msgpack.unpackb(body, ext_hook=self._ext_hook, strict_map_key=False)
            except Exception as exc:  # msgpack and NumPy raise assorted types; trust nothing
                raise _as_decode_error(exc) from None
            if self._taken != nbufs:
                unused = [i for i in range(nbufs) if not self._used[i]]
                raise DecodeError(f"buffers {unused} are not referenced by the header")
        finally:
            self._bufs, self._used, self._taken, self._depth = saved
        if size - PREFIX_SIZE > self._max_depth:
            # Nesting needs at least a byte per level, so only a header longer
            # than max_depth can be too deep; skip the walk for small ones.
            self._check_depth(value, 0)
        return value

    def _check_depth(self, value: Any, depth: int) -> None:
        if depth > self._max_depth:
            raise DecodeError(f"value nests deeper than limits.max_depth={self._max_depth}")
        t = type(value)
        if t is dict:
            for k, v in value.items():
                if type(k) is tuple:
                    self._check_depth(k, depth + 1)
                if type(v) in _CONTAINERS:
                    self._check_depth(v, depth + 1)
        elif t is list or t is tuple:
            for v in value:
                if type(v) in _CONTAINERS:
                    self._check_depth(v, depth + 1)

    def _take(self, ref: int) -> Any:
        if ref >= len(self._used):
            raise DecodeError(f"buffer index {ref} out of range: {len(self._used)} buffers given")
        if self._used[ref]:
            raise DecodeError(f"buffer {ref} is referenced twice")
        self._used[ref] = 1
        self._taken += 1
        return self._bufs[ref]

    def _ext_hook(self, code: int, data: bytes) -> Any:
        if code == EXT_ARRAY:
            arr = self._array_fast(data)
            return arr if arr is not None else self._decode_array(data)
        if code == EXT_TUPLE:
            return tuple(self._nested(data, "tuple"))
        if code == EXT_BYTES:
            if len(data) != BUFFER_REF.size:
                raise DecodeError("bytes reference must be a 4-byte buffer index and an "
                                  "8-byte length")
            return self._referenced_bytes(data, 0).tobytes()  # immutable: one copy
        if code in (EXT_BYTEARRAY, EXT_MEMORYVIEW):
            return self._decode_bytes_like(code, data)
        if code == EXT_COMPLEX:
            if len(data) != COMPLEX.size:
                raise DecodeError(f"complex must be {COMPLEX.size} bytes, got {len(data)}")
            real, imag = COMPLEX.unpack(data)
            return complex(real, imag)
        if code == EXT_BIGINT:
            if not data:
                raise DecodeError("empty big int")
            return int.from_bytes(data, "little", signed=True)
        if code == EXT_REGISTERED:
            return self._decode_registered(data)
        raise DecodeError(f"unknown ext type code {code}")

    def _array_fast(self, data: bytes) -> Any:
        """The common array, quickly; None: take _decode_array. Handles the
        C-ordered, out-of-band NumPy array in a transport's 1-D uint8 buffer
        and the small inline one; any failed check leaves the general path,
        which does the same checks, to say why."""
        size = len(data)
        if size >= ARRAY_HEAD_SIZE:
            kind, dcode, flags, ndim, _, ref = ARRAY_HEAD.unpack_from(data)
            if (
                kind == KIND_NDARRAY
                and flags == 0
                and size == ARRAY_HEAD_SIZE + 8 * ndim <= _FAST_MAX
            ):
                dtype = CODE_TO_DTYPE[dcode]
                used = self._used
                if dtype is not None and ref < len(used) and not used[ref]:
                    shape = DIMS[ndim].unpack_from(data, ARRAY_HEAD_SIZE)
                    count = shape[0] if ndim == 1 else math.prod(shape)
                    buf = self._bufs[ref]
                    nbytes = count * dtype.itemsize
                    tb = type(buf)
                    arr = None
                    if 0 < count <= self._max_elements:
                        if tb is np.ndarray and buf.dtype is _U8 and buf.shape == (nbytes,):
                            # 1-D uint8 of the right size; view() itself refuses a
                            # non-contiguous one (-> general path, which says why).
                            try:  # (try is free in 3.11; suppress() is not)
                                arr = buf.view(dtype)
                            except ValueError:
                                arr = None
                        elif tb is memoryview and buf.nbytes == nbytes and buf.c_contiguous:
                            arr = np.frombuffer(buf, dtype=dtype)  # e.g. in-process
                    if arr is not None:
                        used[ref] = 1
                        self._taken += 1
                        if not arr.flags.aligned:
                            arr = arr.copy()  # see the class docstring
                        return arr if ndim == 1 else arr.reshape(shape)
            elif kind == KIND_NDARRAY and flags == FLAG_INLINE and ndim <= MAX_NDIM and not ref:
                # Inline fast path: small C-ordered array in the descriptor.
                offset = ARRAY_HEAD_SIZE + 8 * ndim
                dtype = CODE_TO_DTYPE[dcode]
                if dtype is not None and size >= offset:
                    shape = DIMS[ndim].unpack_from(data, ARRAY_HEAD_SIZE)
                    count = shape[0] if ndim == 1 else math.prod(shape)
                    nbytes = count * dtype.itemsize
                    if 0 < count <= self._max_elements and size - offset == nbytes:
                        # A copy: the header's bytes are immutable, and the
                        # result must be writable like any decoded array.
                        arr = np.frombuffer(data, dtype, count, offset).copy()
                        return arr if ndim == 1 else arr.reshape(shape)
        return None

    def _nested(self, data: bytes, what: str) -> Any:
        self._depth += 1
        if self._depth > self._max_depth:
            raise DecodeError(f"value nests deeper than limits.max_depth={self._max_depth}")
        try:
            value = msgpack.unpackb(
                data, ext_hook=self._ext_hook, strict_map_key=False, use_list=True
            )
        except DecodeError:
            raise
        except Exception as exc:
            raise DecodeError(f"malformed {what}: {type(exc).__qualname__}: {exc}") from None
        finally:
            self._depth -= 1
        if what == "tuple" and type(value) is not list:
            raise DecodeError("malformed tuple: payload is not a msgpack array")
        return value

    def _decode_bytes_like(self, code: int, data: bytes) -> Any:
        if not data:
            raise DecodeError("empty bytearray/memoryview payload")
        mode = data[0]
        if mode == BYTES_INLINE:
            raw = bytearray(memoryview(data)[1:])
        elif mode == BYTES_OUT_OF_BAND:
            if len(data) != 1 + BUFFER_REF.size:
                raise DecodeError("bytearray/memoryview reference must be a 4-byte buffer "
                                  "index and an 8-byte length")
            host = self._referenced_bytes(data, 1)
            if code == EXT_MEMORYVIEW:
                return as_memoryview(host)  # a view of the received buffer
            return bytearray(host)  # bytearray owns its memory: one copy
        else:
            raise DecodeError(f"unknown bytes mode {mode}")
        return raw if code == EXT_BYTEARRAY else memoryview(raw)

    def _referenced_bytes(self, data: bytes, offset: int) -> np.ndarray[Any, Any]:
        """The buffer a BUFFER_REF at ``offset`` names, checked against its length."""
        ref, declared = BUFFER_REF.unpack_from(data, offset)
        host, _ = _buffers.host_bytes(self._take(ref), ref)
        if host.nbytes != declared:
            raise DecodeError(f"buffer {ref} has {host.nbytes} bytes, the header declares "
                              f"{declared}")
        return host

    def _decode_registered(self, data: bytes) -> Any:
        item = self._nested(data, "registered value")
        if type(item) is not list or len(item) != 2 or type(item[0]) is not str:
            raise DecodeError("malformed registered value: expected [name, value]")
        name, inner = item
        entry = self._registry.for_name(name)
        if entry is None:
            raise DecodeError(f"unknown registered type name {name!r}")
        self._check_depth(inner, self._depth + 1)
        try:
            return entry.decode(inner)
        except DecodeError:
            raise
        except Exception as exc:
            raise DecodeError(
                f"decode function of registered type {name!r} raised {exc!r}"
            ) from exc

    def _decode_array(self, data: bytes) -> Any:
        size = len(data)
        if size < ARRAY_HEAD_SIZE:
            raise DecodeError(f"array descriptor of {size} bytes is truncated")
        kind, code, flags, ndim, device, ref = ARRAY_HEAD.unpack_from(data)
        if ndim > MAX_NDIM:
            raise DecodeError(f"array claims {ndim} dims, at most {MAX_NDIM} allowed")
        if flags & ~FLAGS_KNOWN:
            raise DecodeError(f"unknown array flags {flags:#x}")
        offset = ARRAY_HEAD_SIZE + 8 * ndim
        if size < offset:
            raise DecodeError(f"array descriptor of {size} bytes is truncated (ndim {ndim})")
        shape: tuple[int, ...] = DIMS[ndim].unpack_from(data, ARRAY_HEAD_SIZE)
        stored_shape = shape
        if flags & FLAG_BROADCAST:
            if not self._limits.broadcast:
                raise DecodeError(
                    f"a broadcast (zero-stride) array of shape {shape} is refused: its few "
                    "bytes claim the whole shape (Limits(broadcast=True) accepts it)")
            if size < offset + 8:
                raise DecodeError("array descriptor is truncated (broadcast mask)")
            mask = U64.unpack_from(data, offset)[0]
            offset += 8
            if not mask or mask >> ndim:
                raise DecodeError(f"broadcast mask {mask:#x} invalid for {ndim} dims")
            stored_shape = tuple(1 if mask >> a & 1 else d for a, d in enumerate(shape))
        # Bound the logical size with Python ints (no overflow) before NumPy
        # sees the shape; zero dims count as one so (0, 2**64-1) is refused too.
        bound = math.prod([d or 1 for d in shape])
        if bound > self._limits.max_array_elements:
            raise DecodeError(
                f"array shape {shape} exceeds limits.max_array_elements="
                f"{self._limits.max_array_elements}"
            )
        count = math.prod(stored_shape)
        inline = bool(flags & FLAG_INLINE)
        if inline:
            if ref:
                raise DecodeError("inline array with a buffer index")
            payload: Any = memoryview(data)[offset:]
        elif size != offset:
            raise DecodeError(f"array descriptor has {size - offset} trailing bytes")
        else:
            payload = self._take(ref)
        if kind in (KIND_NDARRAY, KIND_NPSCALAR):
            why = _numpy.check_flags(kind, flags)
            if why is not None:
                raise DecodeError(why)
            if kind == KIND_NPSCALAR and ndim:
                raise DecodeError("a NumPy scalar has 0 dims")
            dtype = _dtype_or_error(code)
            nbytes = count * dtype.itemsize
            if inline:
                if len(payload) != nbytes:
                    raise DecodeError(
                        f"inline array data has {len(payload)} bytes, shape {shape} of "
                        f"{dtype.str} needs {nbytes}"
                    )
                if kind == KIND_NPSCALAR:
                    return np.frombuffer(payload, dtype=dtype)[0]
                # Copied so it is writable like out-of-band arrays (<threshold).
                host = np.frombuffer(bytearray(payload), dtype=np.uint8)
            else:
                if _buffers.is_device(payload):
                    raise DecodeError(
                        f"buffer {ref} is a device buffer, the header wants a NumPy array"
                    )
                host, _ = _buffers.host_bytes(payload, ref)
                if host.nbytes != nbytes:
                    raise DecodeError(
                        f"buffer {ref} has {host.nbytes} bytes, shape {shape} of "
                        f"{dtype.str} needs {nbytes}"
                    )
            return _numpy.decode_ndarray(dtype, flags, shape, stored_shape, host)
        if kind == KIND_TORCH:
            if flags & (FLAG_BROADCAST | FLAG_FORTRAN):
                raise DecodeError(f"flags {flags:#x} not valid for a torch tensor")
            _lazy("torch", "a torch tensor")
            from . import _torch

            # torch's own table: bfloat16/float8 must not need ml_dtypes here.
            itemsize = _torch.itemsize(code)
            if itemsize is None:
                raise DecodeError(f"unknown torch dtype code {code}")
            nbytes = count * itemsize
            if inline and len(payload) != nbytes:
                raise DecodeError(f"inline tensor data has {len(payload)} bytes, needs {nbytes}")
            try:
                return _torch.decode_tensor(
                    code, flags, device, shape, nbytes, payload, ref, inline
                )
            except DecodeError:
                raise
            except Exception as exc:
                raise DecodeError(f"cannot build torch tensor: {exc}") from None
        if kind == KIND_CUPY:
            _lazy("cupy", "a CuPy array")
            from . import _cupy

            dtype = _dtype_or_error(code)
            try:
                return _cupy.decode_cupy(
                    dtype, flags, device, shape, count * dtype.itemsize, payload, ref, inline
                )
            except DecodeError:
                raise
            except Exception as exc:
                raise DecodeError(f"cannot build CuPy array: {exc}") from None
        raise DecodeError(f"unknown array kind {kind}")


def _as_decode_error(exc: Exception) -> DecodeError:
    """Translate an exception raised while unpacking into a DecodeError that says why."""
    if isinstance(exc, DecodeError):
        return exc
    if isinstance(exc, msgpack.ExtraData):
        return DecodeError("trailing bytes after the value in the header")
    if isinstance(exc, msgpack.StackError | RecursionError):
        return DecodeError("header nests deeper than msgpack allows")
    if isinstance(exc, UnicodeDecodeError):
        return DecodeError(f"invalid UTF-8 in a header string: {exc}")
    if isinstance(exc, ValueError | TypeError):  # TypeError: e.g. an unhashable dict key
        return DecodeError(f"malformed header: {exc}")
    return DecodeError(f"malformed header: {type(exc).__qualname__}: {exc}")


def _dtype_or_error(code: int) -> np.dtype[Any]:
    dtype = _dtypes.dtype_for(code)
    if dtype is None:
        if code in _dtypes.ML_DTYPES_CODES:
            raise DecodeError(
                f"dtype code {code} ({_dtypes.ML_DTYPES_CODES[code]}) needs ml_dtypes, "
                "which is not installed"
            )
        raise DecodeError(f"unknown dtype code {code}")
    return dtype


def _lazy(module: str, what: str) -> ModuleType:
    try:
        return __import__(module)
    except ImportError:
        raise DecodeError(f"header holds {what}, but {module} is not installed") from None
