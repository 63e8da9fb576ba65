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

import enum
from collections.abc import Mapping
from typing import Any, ClassVar

__all__ = (
    "Aborted",
    "AlreadyExists",
    "CallCancelled",
    "CollectiveError",
    "CollectiveTimeout",
    "ConfigError",
    "ConnectionClosedError",
    "DataLoss",
    "DeadlineExceeded",
    "DecodeError",
    "EncodeError",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "LimitExceededError",
    "LocalProtocolError",
    "MismatchError",
    "NotFound",
    "OutOfRange",
    "PlacementMoved",
    "PermissionDenied",
    "ProtocolError",
    "RankFailedError",
    "RemoteError",
    "ResourceExhausted",
    "SerdeError",
    "Status",
    "TensorwireError",
    "TransportError",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "UnknownError",
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
    """A peer announced a message larger than the configured limits.

    Attributes:
        head: the refused message's first frame, when a transport skipped
            the message and the frame was small enough to keep (see
            ``Connection.refuse_oversized``); else None.
    """

    head: bytes | None = None


# --- rpc ---------------------------------------------------------------------


class ProtocolError(TensorwireError):
    """The peer broke the wire protocol (bad prefix, version, framing, or
    the rules of a call: an ITEM beyond its credit, anything after END)."""


class LocalProtocolError(ProtocolError):
    """This side tried to send what the wire protocol forbids (a bug in the
    caller, never the peer's doing): an ITEM without credit, a second
    terminal message, anything after the call ended."""


class Status(enum.IntEnum):
    """Why a call failed; the numbers are gRPC's, so they read the same."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class RemoteError(TensorwireError):
    """A call failed; ``status`` says why.

    Raised on the client for every failed call. The subclass matches the
    status (``NotFound``, ``Unavailable``, ...). When the server's handler
    raised, ``type_name`` is the remote exception's type, ``message`` its
    text and ``remote_traceback`` its formatted traceback.

    A handler raises one of these classes itself to choose the status its
    caller sees: ``raise NotFound(f"no key {key!r}")``. Its ``details``
    travel too: structured facts the caller acts on (plain values: str, int,
    float, bool, None, bytes, and lists and str-keyed dicts of them), so a
    result never has to carry a marker value. A subclass defined here with
    the same status as its base (:class:`PlacementMoved`) arrives as itself.
    """

    status: Status = Status.UNKNOWN
    #: Whether a server sends the handler's traceback with this error: not
    #: for an error that is an answer rather than a fault (a redirect).
    sends_traceback: ClassVar[bool] = True

    def __init__(
        self,
        message: str = "",
        *,
        type_name: str | None = None,
        remote_traceback: str = "",
        details: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.type_name = type_name or type(self).__name__
        self.remote_traceback = remote_traceback
        self.details: dict[str, Any] = dict(details) if details else {}

    def __str__(self) -> str:
        text = f"[{self.status.name}] {self.message}"
        if self.type_name != type(self).__name__:
            text += f" (remote {self.type_name})"
        return text

    @staticmethod
    def for_status(status: Status | int, type_name: str | None = None) -> type[RemoteError]:
        """The RemoteError subclass that stands for ``status``, or the error of
        this module named ``type_name`` when it has that status."""
        named = _BY_NAME.get(type_name) if type_name else None
        if named is not None and named.status == status:
            return named
        try:
            return _BY_STATUS[Status(status)]
        except (ValueError, KeyError):
            return UnknownError


class CallCancelled(RemoteError):
    """The call was cancelled (by the caller, or the server shut down)."""

    status = Status.CANCELLED


class UnknownError(RemoteError):
    """The peer reported a status this side does not know."""

    status = Status.UNKNOWN


class InvalidArgument(RemoteError, ValueError):
    """Arguments that do not fit the method, or frames that do not decode."""

    status = Status.INVALID_ARGUMENT


class DeadlineExceeded(RemoteError, TimeoutError):
    """The call's deadline passed before it finished."""

    status = Status.DEADLINE_EXCEEDED


class NotFound(RemoteError, LookupError):
    """Unknown service or method, or a handler's own "no such thing"."""

    status = Status.NOT_FOUND


class AlreadyExists(RemoteError):
    """What the call would create exists already."""

    status = Status.ALREADY_EXISTS


class PermissionDenied(RemoteError):
    """The caller may not do this."""

    status = Status.PERMISSION_DENIED


class ResourceExhausted(RemoteError):
    """A limit was hit: concurrent calls, message size, memory."""

    status = Status.RESOURCE_EXHAUSTED


class FailedPrecondition(RemoteError):
    """The system is not in a state where the call can run."""

    status = Status.FAILED_PRECONDITION


class Aborted(RemoteError):
    """The call was aborted, typically by a concurrency conflict."""

    status = Status.ABORTED


class OutOfRange(RemoteError):
    """An argument is past the valid range."""

    status = Status.OUT_OF_RANGE


class Unimplemented(RemoteError):
    """The method exists but this server does not implement it."""

    status = Status.UNIMPLEMENTED


class Internal(RemoteError):
    """The handler raised something that is not a RemoteError (a bug)."""

    status = Status.INTERNAL


class Unavailable(RemoteError, ConnectionError):
    """The peer cannot be reached, went silent or went away."""

    status = Status.UNAVAILABLE


class DataLoss(RemoteError):
    """Unrecoverable data loss or corruption."""

    status = Status.DATA_LOSS


class Unauthenticated(RemoteError):
    """The peer did not prove it knows the shared secret."""

    status = Status.UNAUTHENTICATED


_BY_STATUS: dict[Status, type[RemoteError]] = {
    cls.status: cls
    for cls in (
        CallCancelled,
        UnknownError,
        InvalidArgument,
        DeadlineExceeded,
        NotFound,
        AlreadyExists,
        PermissionDenied,
        ResourceExhausted,
        FailedPrecondition,
        Aborted,
        OutOfRange,
        Unimplemented,
        Internal,
        Unavailable,
        DataLoss,
        Unauthenticated,
    )
}




class PlacementMoved(Aborted):
    """A parameter-server shard serves a later placement version than the
    call used: the worker adopts placement :attr:`version` and calls again.

    The version travels in ``details["version"]``; no traceback goes with it
    (every worker behind gets one, and a worker with small message limits
    must still read it).
    """

    sends_traceback = False

    def __init__(
        self,
        message: str = "",
        *,
        version: int | None = None,
        type_name: str | None = None,
        remote_traceback: str = "",
        details: Mapping[str, Any] | None = None,
    ) -> None:
        merged = dict(details or {})
        if version is not None:
            merged["version"] = version
        super().__init__(message, type_name=type_name, remote_traceback=remote_traceback,
                         details=merged)

    @property
    def version(self) -> int:
        """The placement version the shard serves (0 when the error does not say)."""
        version = self.details.get("version")
        return version if type(version) is int else 0


#: Errors rebuilt by name: those that share their status with another.
_BY_NAME: dict[str, type[RemoteError]] = {cls.__name__: cls for cls in (PlacementMoved,)}


# --- collectives ---------------------------------------------------------------


class CollectiveError(TensorwireError):
    """A collective operation failed; ``ranks`` names the ranks at fault.

    After one of these the group is broken (as an NCCL communicator is after
    an error): every later operation raises the same error; close the group
    and create a new one.
    """

    def __init__(self, message: str, *, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks


class MismatchError(CollectiveError, ValueError):
    """Ranks called different operations, or one with other shapes or dtypes."""


class RankFailedError(CollectiveError, ConnectionError):
    """A rank died, left, or could not be reached."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """An operation passed its deadline; ``ranks`` did not take part in time."""
