"""The codec's module-level ``encode`` and ``decode``: one
:class:`~._encoder.Encoder` and one :class:`~._decoder.Decoder` per thread.

The encoder is compiled in ``_encoder.pyx``, the decoder in ``_decoder.pyx``; the
header they share is described in ``_format.py`` and docs/protocol.md.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ._decoder import Decoder
from ._encoder import DEFAULT_INLINE_THRESHOLD, Encoder

__all__ = ("DEFAULT_INLINE_THRESHOLD", "Decoder", "Encoder", "decode", "encode")

# One Encoder/Decoder per thread for the module-level functions: a cache, not
# shared state (an Encoder reuses its output buffer and is not thread-safe).
_local = threading.local()


def encode(obj: Any) -> tuple[bytes, list[Any]]:
    """Encode ``obj`` with a default :class:`Encoder`; see :meth:`Encoder.encode`.

    Raises:
        EncodeError: as :meth:`Encoder.encode`.
    """
    try:
        encoder: Encoder = _local.encoder
    except AttributeError:
        encoder = _local.encoder = Encoder()
    return encoder.encode(obj)


def decode(header: Any, buffers: Sequence[Any] = ()) -> Any:
    """Decode with a default :class:`Decoder`; see :meth:`Decoder.decode`.

    Decoded arrays are views of ``buffers`` and keep them alive.

    Raises:
        DecodeError: as :meth:`Decoder.decode`.
    """
    try:
        decoder: Decoder = _local.decoder
    except AttributeError:
        decoder = _local.decoder = Decoder()
    return decoder.decode(header, buffers)
