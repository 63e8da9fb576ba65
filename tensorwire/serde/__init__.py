"""The tensor codec: Python values <-> ``(header, buffers)``; pure, no I/O.

``encode(obj)`` returns a small msgpack header (prefixed ``b"TWS"`` + version)
and a list of zero-copy buffers (host memoryviews or CUDA buffers);
``decode(header, buffers)`` rebuilds the value with arrays that view the
buffers. Decoded views keep the receive buffers alive. The wire format is
specified in docs/protocol.md ("Value header (serde)"). The error classes are
re-exported from :mod:`tensorwire.errors` for convenience (as msgspec does).
"""

from __future__ import annotations

from ..errors import DecodeError, EncodeError, SerdeError
from ._codec import DEFAULT_INLINE_THRESHOLD, Decoder, Encoder, decode, encode
from ._limits import Limits
from ._registry import RegisteredType, TypeRegistry, default_registry, register

__all__ = (
    "DEFAULT_INLINE_THRESHOLD",
    "DecodeError",
    "Decoder",
    "EncodeError",
    "Encoder",
    "Limits",
    "RegisteredType",
    "SerdeError",
    "TypeRegistry",
    "decode",
    "default_registry",
    "encode",
    "register",
)
