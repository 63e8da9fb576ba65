"""The RPC protocol, sans-IO: frames in, typed messages out, and back.

No sockets, no event loop (h11's shape). Every RPC message is one transport
message. The kinds that carry a value (REQUEST, RESPONSE, ITEM: the per-call
hot path) start frame 0 with a fixed little-endian binary header, followed
in the same frame by the value's serde header; the value's buffers are the
frames after it. Every other kind's frame 0 is a msgpack array
``[kind, call_id, *fields]``. The layout is in docs/protocol.md ("RPC
messages").
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import hmac
import os
from collections.abc import Sequence
from typing import Any, ClassVar

import msgpack

from ..errors import ProtocolError, Status, Unauthenticated
from ._kinds import Kind

# The binary kinds and their messages are compiled (one implementation: see
# _wire.pyx).
from ._wire import MAX_TIMEOUT as MAX_TIMEOUT
from ._wire import (
    Item,
    Request,
    Response,
    encode_reply,
    encode_request,
    encode_response,
    parse_binary,
)

__all__ = (
    "RPC_VERSION",
    "Auth",
    "AuthOk",
    "Cancel",
    "ClientHandshake",
    "Credit",
    "End",
    "Error",
    "Hello",
    "Item",
    "Kind",
    "Message",
    "Ping",
    "Pong",
    "Reject",
    "Request",
    "Response",
    "ServerHandshake",
    "Welcome",
    "encode",
    "encode_request",
    "encode_response",
    "parse",
)

#: 2: REQUEST, RESPONSE and ITEM with a fixed binary header that shares
#: frame 0 with the value's serde header (1: msgpack header, separate frame).
RPC_VERSION = 2
NONCE_BYTES = 16
#: A msgpack RPC header is a handful of small fields; anything larger is
#: hostile. (A value's serde header has the serde limits.)
MAX_HEADER_BYTES = 64 * 1024
#: ERROR's message and traceback are cut to this many characters each, so
#: that a huge exception text cannot push a header past MAX_HEADER_BYTES.
MAX_ERROR_TEXT = 16 * 1024
#: The most bytes ERROR.details may take, packed; larger details stay behind.
MAX_ERROR_DETAILS = 16 * 1024


@dataclasses.dataclass(slots=True)
class Message(metaclass=abc.ABCMeta):
    """Base of the parsed messages; ``payload`` holds a value's serde frames.
    REQUEST, RESPONSE and ITEM are compiled classes (``_wire``), registered
    as its subclasses."""

    call_id: int

    kind: ClassVar[Kind] = Kind.PING  # set by every subclass
    fields: ClassVar[tuple[str, ...]] = ()

    @property
    def payload(self) -> list[Any]:
        return []


@dataclasses.dataclass(slots=True)
class Hello(Message):
    version: int
    nonce: bytes
    name: str
    kind: ClassVar[Kind] = Kind.HELLO
    fields: ClassVar[tuple[str, ...]] = ("version", "nonce", "name")


@dataclasses.dataclass(slots=True)
class Welcome(Message):
    version: int
    nonce: bytes
    auth: bool
    max_concurrent: int
    kind: ClassVar[Kind] = Kind.WELCOME
    fields: ClassVar[tuple[str, ...]] = ("version", "nonce", "auth", "max_concurrent")


@dataclasses.dataclass(slots=True)
class Auth(Message):
    proof: bytes
    kind: ClassVar[Kind] = Kind.AUTH
    fields: ClassVar[tuple[str, ...]] = ("proof",)


@dataclasses.dataclass(slots=True)
class AuthOk(Message):
    proof: bytes
    kind: ClassVar[Kind] = Kind.AUTH_OK
    fields: ClassVar[tuple[str, ...]] = ("proof",)


@dataclasses.dataclass(slots=True)
class Reject(Message):
    status: int
    message: str
    kind: ClassVar[Kind] = Kind.REJECT
    fields: ClassVar[tuple[str, ...]] = ("status", "message")


@dataclasses.dataclass(slots=True)
class Error(Message):
    status: int
    type_name: str
    message: str
    traceback: str
    #: ``RemoteError.details``: a fifth field, sent only when not empty.
    details: dict[str, Any] | None = None
    kind: ClassVar[Kind] = Kind.ERROR
    fields: ClassVar[tuple[str, ...]] = ("status", "type_name", "message", "traceback")


@dataclasses.dataclass(slots=True)
class Cancel(Message):
    kind: ClassVar[Kind] = Kind.CANCEL


@dataclasses.dataclass(slots=True)
class End(Message):
    kind: ClassVar[Kind] = Kind.END


@dataclasses.dataclass(slots=True)
class Credit(Message):
    count: int
    kind: ClassVar[Kind] = Kind.CREDIT
    fields: ClassVar[tuple[str, ...]] = ("count",)


@dataclasses.dataclass(slots=True)
class Ping(Message):
    kind: ClassVar[Kind] = Kind.PING


@dataclasses.dataclass(slots=True)
class Pong(Message):
    kind: ClassVar[Kind] = Kind.PONG


Message.register(Request)
Message.register(Response)
Message.register(Item)

_CLASSES: dict[int, type[Message]] = {
    cls.kind: cls
    for cls in (
        Hello, Welcome, Auth, AuthOk, Reject, Request, Response, Error, Cancel, Item, End,
        Credit, Ping, Pong,
    )
}
#: The kinds with a binary header and a value (no msgpack header starts with
#: these bytes: a msgpack header is an array).
_BINARY = frozenset({Kind.REQUEST, Kind.RESPONSE, Kind.ITEM})
#: Field name -> the Python types a peer may send for it.
_TYPES: dict[str, tuple[type, ...]] = {
    "version": (int,),
    "nonce": (bytes,),
    "name": (str,),
    "auth": (bool,),
    "max_concurrent": (int,),
    "proof": (bytes,),
    "status": (int,),
    "message": (str,),
    "method": (str,),
    "timeout": (float, int, type(None)),
    "stream_arg": (int,),
    "type_name": (str,),
    "traceback": (str,),
    "count": (int,),
}


def encode(message: Message) -> list[Any]:
    """The transport frames of ``message``."""
    cls = type(message)
    if cls is Response or cls is Item:
        return encode_reply(cls.kind, message.call_id, message.value)  # type: ignore[attr-defined]
    if cls is Request:
        assert isinstance(message, Request)
        return encode_request(message.call_id, message.method, message.timeout,
                              message.stream_arg, message.value)
    head = [int(message.kind), message.call_id]
    head.extend(getattr(message, name) for name in message.fields)
    if cls is Error and message.details:  # type: ignore[attr-defined]
        head.append(message.details)  # type: ignore[attr-defined]
    return [msgpack.packb(head, use_bin_type=True), *message.payload]


def sendable_details(details: dict[str, Any]) -> dict[str, Any] | None:
    """``details`` when they pack as msgpack (plain values) within
    :data:`MAX_ERROR_DETAILS` bytes, else ``None``."""
    try:
        packed = msgpack.packb(details, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return None
    return details if len(packed) <= MAX_ERROR_DETAILS else None


def parse(frames: Sequence[Any]) -> Message:
    """Parse one transport message into an RPC message.

    Raises:
        ProtocolError: no frames, a malformed header, an unknown kind, wrong
            field types, or a value where none belongs.
    """
    if not frames:
        raise ProtocolError("empty RPC message")
    binary = parse_binary(frames)
    if binary is not None:
        return binary
    raw = frames[0]
    size = memoryview(raw).nbytes
    if size > MAX_HEADER_BYTES:
        raise ProtocolError(f"RPC header of {size} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        head = msgpack.unpackb(raw, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable RPC header: {exc}") from None
    if not isinstance(head, list) or len(head) < 2:
        raise ProtocolError("RPC header must be an array [kind, call_id, ...]")
    kind, call_id = head[0], head[1]
    cls = _CLASSES.get(kind) if type(kind) is int else None
    if cls is None:
        raise ProtocolError(f"unknown RPC message kind {kind!r}")
    if type(call_id) is not int or not 0 <= call_id < 1 << 63:
        raise ProtocolError(f"bad call id {call_id!r}")
    values = head[2:]
    details = None
    if cls is Error and len(values) == len(cls.fields) + 1:
        details = values.pop()
        if type(details) is not dict or not all(type(key) is str for key in details):
            raise ProtocolError("ERROR.details must be a map with str keys")
    if len(values) != len(cls.fields):
        raise ProtocolError(
            f"{cls.kind.name} takes {len(cls.fields)} fields, got {len(values)}"
        )
    for name, value in zip(cls.fields, values, strict=True):
        if type(value) not in _TYPES[name]:
            raise ProtocolError(
                f"{cls.kind.name}.{name} must be {_TYPES[name][0].__name__}, "
                f"got {type(value).__name__}"
            )
    if cls.kind in _BINARY:
        raise ProtocolError(f"{cls.kind.name} must have the binary header of RPC version 2")
    if cls is Welcome and values[3] < 1:
        raise ProtocolError(f"WELCOME.max_concurrent must be at least 1, got {values[3]}")
    if len(frames) != 1:
        raise ProtocolError(f"{cls.kind.name} carries no value, got {len(frames) - 1} frames")
    message = cls(call_id, *values)
    if details:
        message.details = details  # type: ignore[attr-defined]
    return message


# --- handshake ---------------------------------------------------------------


def _proof(secret: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    # Both nonces go into every proof, and each side's label differs, so a
    # captured proof is useless on another connection or in the other role.
    return hmac.new(secret, b"tensorwire-auth-v1|" + label + b"|" + first + second,
                    hashlib.sha256).digest()


class ClientHandshake:
    """The client's side: HELLO, then AUTH when the server asks for it."""

    def __init__(self, *, secret: bytes | None, name: str = "") -> None:
        self._secret = secret
        self._nonce = os.urandom(NONCE_BYTES)
        self._name = name
        self._server_nonce = b""
        self.done = False
        self.max_concurrent = 0

    def start(self) -> Message:
        return Hello(0, RPC_VERSION, self._nonce, self._name)

    def receive(self, message: Message) -> Message | None:
        """Feed the server's reply; returns what to send next, if anything.

        Raises:
            ProtocolError: version mismatch or an unexpected message.
            Unauthenticated: the server refused us, or could not prove it
                knows the secret.
        """
        if isinstance(message, Reject):
            raise_reject(message)
        if isinstance(message, Welcome) and not self._server_nonce:
            if message.version != RPC_VERSION:
                raise ProtocolError(
                    f"server speaks RPC protocol version {message.version}, "
                    f"this client {RPC_VERSION}"
                )
            if len(message.nonce) != NONCE_BYTES:
                raise ProtocolError("bad server nonce")
            self._server_nonce = message.nonce
            self.max_concurrent = message.max_concurrent
            if not message.auth:
                if self._secret is not None:
                    # Authentication is mutual: a server that does not ask
                    # for our proof cannot give its own, and may be anyone.
                    raise Unauthenticated(
                        "the server did not prove it knows the shared secret "
                        "(it asked for no authentication)")
                self.done = True
                return None
            if self._secret is None:
                raise Unauthenticated("the server requires a shared secret and none was given")
            return Auth(0, _proof(self._secret, b"client", self._server_nonce, self._nonce))
        if isinstance(message, AuthOk) and self._server_nonce and self._secret is not None:
            expected = _proof(self._secret, b"server", self._nonce, self._server_nonce)
            if not hmac.compare_digest(expected, message.proof):
                raise Unauthenticated("the server could not prove it knows the shared secret")
            self.done = True
            return None
        raise ProtocolError(f"unexpected {message.kind.name} during the handshake")


def raise_reject(message: Reject) -> None:
    """Raise the error a REJECT stands for."""
    from ..errors import RemoteError

    if message.status == Status.UNAUTHENTICATED:
        raise Unauthenticated(message.message)
    if message.status == Status.FAILED_PRECONDITION:
        raise ProtocolError(message.message)
    raise RemoteError.for_status(message.status)(message.message)


class ServerHandshake:
    """The server's side: WELCOME, then check AUTH when a secret is set."""

    def __init__(self, *, secret: bytes | None, max_concurrent: int) -> None:
        self._secret = secret
        self._nonce = os.urandom(NONCE_BYTES)
        self._max_concurrent = max_concurrent
        self._client_nonce = b""
        self.done = False
        self.client_name = ""

    def receive(self, message: Message) -> Message:
        """Feed the client's message; returns the reply to send.

        A REJECT reply means the connection is to be closed after sending it.
        """
        if isinstance(message, Hello) and not self._client_nonce:
            if message.version != RPC_VERSION:
                return Reject(
                    0,
                    Status.FAILED_PRECONDITION,
                    f"client speaks RPC protocol version {message.version}, "
                    f"this server {RPC_VERSION}",
                )
            if len(message.nonce) != NONCE_BYTES:
                return Reject(0, Status.INVALID_ARGUMENT, "bad client nonce")
            self._client_nonce = message.nonce
            self.client_name = message.name
            if self._secret is None:
                self.done = True
            return Welcome(0, RPC_VERSION, self._nonce, self._secret is not None,
                           self._max_concurrent)
        if isinstance(message, Auth) and self._client_nonce and self._secret is not None:
            expected = _proof(self._secret, b"client", self._nonce, self._client_nonce)
            if not hmac.compare_digest(expected, message.proof):
                return Reject(0, Status.UNAUTHENTICATED, "wrong shared secret")
            self.done = True
            return AuthOk(0, _proof(self._secret, b"server", self._client_nonce, self._nonce))
        if self._secret is not None and self._client_nonce:
            return Reject(0, Status.UNAUTHENTICATED, "authentication required")
        return Reject(0, Status.FAILED_PRECONDITION,
                      f"expected the handshake, got {message.kind.name}")
