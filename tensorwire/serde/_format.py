"""Wire constants of the value header; docs/protocol.md ("Value header") is the spec.

Everything fixed-width is little-endian (``"<"`` in every struct format), so a
big-endian peer reads the same bytes. The numbers below are part of the wire
format: never renumber them, only add.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Final

from msgpack import ExtType

#: Magic bytes that open every header, followed by the format version byte.
MAGIC: Final = b"TWS"
#: 2: an out-of-band BYTES, BYTEARRAY or MEMORYVIEW names its length (1: only
#: its buffer index, so a short buffer decoded silently as shorter bytes).
VERSION: Final = 2
PREFIX: Final = MAGIC + bytes((VERSION,))
#: ``PREFIX`` + ``u32`` number of out-of-band buffers, then the msgpack body.
PREFIX_STRUCT: Final = struct.Struct("<4sI")
PREFIX_SIZE: Final = PREFIX_STRUCT.size  # 8

# msgpack ext type codes.
EXT_TUPLE: Final = 1
EXT_ARRAY: Final = 2
EXT_BYTES: Final = 3
EXT_BYTEARRAY: Final = 4
EXT_MEMORYVIEW: Final = 5
EXT_COMPLEX: Final = 6
EXT_BIGINT: Final = 7
EXT_REGISTERED: Final = 8

# EXT_BYTEARRAY / EXT_MEMORYVIEW: first payload byte.
BYTES_INLINE: Final = 0
BYTES_OUT_OF_BAND: Final = 1

# EXT_ARRAY payload: kind, dtype code, flags, ndim, device ordinal, buffer index;
# then ndim u64 dims, then (BROADCAST) a u64 axis mask, then (INLINE) the data.
ARRAY_HEAD: Final = struct.Struct("<BBBBHI")
ARRAY_HEAD_SIZE: Final = ARRAY_HEAD.size  # 10
U32: Final = struct.Struct("<I")
#: An out-of-band BYTES, BYTEARRAY or MEMORYVIEW: buffer index, byte length.
BUFFER_REF: Final = struct.Struct("<IQ")
U64: Final = struct.Struct("<Q")
COMPLEX: Final = struct.Struct("<dd")

KIND_NDARRAY: Final = 0
KIND_NPSCALAR: Final = 1
KIND_TORCH: Final = 2
KIND_CUPY: Final = 3

FLAG_FORTRAN: Final = 0x01
FLAG_INLINE: Final = 0x02
FLAG_BROADCAST: Final = 0x04
FLAG_REQUIRES_GRAD: Final = 0x08
FLAG_CUDA: Final = 0x10
FLAGS_KNOWN: Final = 0x1F

#: NumPy's own limit (NPY_MAXDIMS in NumPy 2); a header may not claim more.
MAX_NDIM: Final = 64

#: ``DIMS[n]`` packs/unpacks n little-endian u64 dims (precompiled: hot path).
DIMS: Final = tuple(struct.Struct(f"<{n}Q") for n in range(MAX_NDIM + 1))


class UnsupportedValueError(Exception):
    """Internal: a value cannot be encoded; ``path`` grows while the walk unwinds.

    Turned into :class:`tensorwire.errors.EncodeError` at the API boundary,
    with the path rendered like ``value['params'][3]``.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.path: list[str] = []


def new_ext(code_and_data: tuple[int, bytes]) -> ExtType:
    """``ExtType(code, data)`` without its Python-level argument checks (hot path).

    Our callers always pass an int code in range and a bytes payload.
    """
    ext: ExtType = _tuple_new(ExtType, code_and_data)
    return ext


_tuple_new: Any = tuple.__new__

#: ``memoryview`` typed to take Any: NumPy's stubs for Python 3.11 do not
#: declare the buffer protocol (PEP 688 is 3.12+), though arrays export it.
as_memoryview: Callable[[Any], memoryview] = memoryview
