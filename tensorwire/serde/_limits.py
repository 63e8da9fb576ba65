"""Limits that bound what an encoder emits and what a decoder accepts."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

#: Bounds the recursion of the encoder's and decoder's walks (C stack frames).
_MAX_DEPTH_CAP = 500


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on one encoded value; shared by :class:`Encoder` and :class:`Decoder`.

    Attributes:
        max_depth: deepest container nesting (list, tuple, dict, registered
            type); the top-level value is depth 0.
        max_header_bytes: largest header, prefix included. The header also
            bounds the number of items and containers (every item costs at
            least one byte), bytes carried inline and big integers.
        max_buffers: most out-of-band buffers in one message.
        max_array_elements: most elements one array may claim (its logical
            size, so a broadcast array counts in full).
        broadcast: whether arrays with zero-stride (broadcast) axes travel
            as such. False (the default): the encoder sends them dense, and
            the decoder refuses a BROADCAST array with ``DecodeError``: a
            few bytes on the wire would otherwise claim any logical size,
            and the receiver's first ``a + b`` allocates all of it. True
            on both ends: each broadcast axis is sent once and the decoder
            re-broadcasts it (a read-only view).

    Raises:
        ConfigError: a limit is not a positive int, or ``max_depth`` > 500.
    """

    max_depth: int = 100
    max_header_bytes: int = 64 * 1024 * 1024
    max_buffers: int = 65536
    max_array_elements: int = 1 << 48
    broadcast: bool = False

    def __post_init__(self) -> None:
        for name in ("max_depth", "max_header_bytes", "max_buffers", "max_array_elements"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"Limits.{name} must be a positive int, got {value!r}")
        if type(self.broadcast) is not bool:
            raise ConfigError(f"Limits.broadcast must be a bool, got {self.broadcast!r}")
        if self.max_depth > _MAX_DEPTH_CAP:
            raise ConfigError(f"Limits.max_depth must be <= {_MAX_DEPTH_CAP}")
        if self.max_buffers > 0xFFFFFFFF:
            raise ConfigError("Limits.max_buffers must fit in a u32")
