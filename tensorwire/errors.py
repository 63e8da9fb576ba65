"""The one exception tree of tensorwire.

Every error the package raises on purpose derives from :class:`TensorwireError`.
Backend errors (``OSError``, ``ssl.SSLError``, UCX exceptions) are translated
into this tree at the transport boundary, so callers catch one family.

Who broke the rules is part of the name where it matters (h11's
``LocalProtocolError`` / ``RemoteProtocolError``): an :class:`EncodeError`
means the local value cannot be sent, a :class:`DecodeError` means the bytes
that arrived are not a valid message.
"""

from __future__ import annotations

__all__ = (
    "ConfigError",
    "ConnectionClosedError",
    "DeadlineExceeded",
    "DecodeError",
    "EncodeError",
    "LimitExceededError",
    "ProtocolError",
    "RemoteError",
    "SerdeError",
    "TensorwireError",
    "TransportError",
    "UnsupportedTransportError",
)


class TensorwireError(Exception):
    """Root of every error tensorwire raises on purpose."""


class ConfigError(TensorwireError, ValueError):
    """A configuration value is invalid (caught when the config is built)."""


# --- serde -----------------------------------------------------------------


class SerdeError(TensorwireError):
    """The codec could not turn a value into a message or back."""


class EncodeError(SerdeError, TypeError):
    """A local value cannot be encoded (unsupported type, object dtype, limits)."""


class DecodeError(SerdeError, ValueError):
    """A received header or buffer list is not a valid encoded value."""


# --- transports --------------------------------------------------------------


class TransportError(TensorwireError, OSError):
    """Moving frames between two endpoints failed."""


class ConnectionClosedError(TransportError):
    """The connection is closed: by us, by the peer, or because it broke."""


class UnsupportedTransportError(TransportError):
    """No transport is registered for a URL scheme, or its library is missing."""


class LimitExceededError(TransportError):
    """A peer announced a message larger than the configured limits."""


# --- rpc ---------------------------------------------------------------------


class ProtocolError(TensorwireError):
    """The peer broke the wire protocol (bad prefix, version, framing)."""


class DeadlineExceeded(TensorwireError, TimeoutError):
    """An operation did not finish before its deadline."""


class RemoteError(TensorwireError):
    """A remote handler raised; carries the remote type, message and traceback."""

    def __init__(self, type_name: str, message: str, traceback: str = "") -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message
        self.remote_traceback = traceback
