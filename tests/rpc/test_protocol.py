"""The sans-IO RPC protocol, without sockets or an event loop."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest

from tensorwire.errors import ProtocolError, Status, Unauthenticated
from tensorwire.rpc import protocol as p

SECRET = b"a shared secret"


@pytest.mark.parametrize(
    "message",
    [
        p.Hello(0, p.RPC_VERSION, b"n" * 16, "worker-3"),
        p.Welcome(0, p.RPC_VERSION, b"s" * 16, True, 64),
        p.Auth(0, b"x" * 32),
        p.AuthOk(0, b"y" * 32),
        p.Reject(0, int(Status.UNAUTHENTICATED), "no"),
        p.Request(7, "Store.get", 1.5, -1, [b"header", b"buffer"]),
        p.Request(8, "Store.total", None, 0, [b"header"]),
        p.Response(7, [b"header"]),
        p.Error(7, int(Status.NOT_FOUND), "NotFound", "no key", "Traceback ..."),
        p.Cancel(7),
        p.Item(9, [b"h", b"b1", b"b2"]),
        p.End(9),
        p.Credit(9, 16),
        p.Ping(0),
        p.Pong(0),
    ],
    ids=lambda m: type(m).__name__,
)
def test_every_message_round_trips(message: p.Message) -> None:
    assert p.parse(p.encode(message)) == message


#: How a transport may hand over a header frame: bytes, a bytearray copy (a
#: small frame delivered to the RPC layer), an aligned NumPy array.
FRAME_TYPES = {
    "bytes": bytes,
    "bytearray": bytearray,
    "ndarray": lambda data: np.frombuffer(data, np.uint8).copy(),
}


@pytest.mark.parametrize("frame_type", FRAME_TYPES)
@pytest.mark.parametrize("size", [9, 5000], ids=["small", "large"])
def test_binary_messages_parse_alike_from_every_frame_type(frame_type: str, size: int) -> None:
    make = FRAME_TYPES[frame_type]
    value = [b"h" * size, b"buffer"]
    for message in (p.Request(7, "Store.get", 1.5, -1, value), p.Request(8, "S.m", None, 0, value),
                    p.Response(7, value), p.Item(9, value)):
        frames = p.encode(message)
        parsed = p.parse([make(frames[0]), *frames[1:]])
        assert parsed == message
        assert bytes(parsed.value[0]) == b"h" * size  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "empty"),
        ([b"\xc1"], "undecodable"),
        ([msgpack.packb({"kind": 1})], "must be an array"),
        ([msgpack.packb([99, 0])], "unknown RPC message kind 99"),
        ([msgpack.packb([20, -1])], "bad call id"),
        ([msgpack.packb([13, 1, "extra"])], "takes 0 fields, got 1"),
        ([msgpack.packb([16, 1, "many"])], "count must be int"),
        ([msgpack.packb([10, 1, "Store.get", 1.0, -1]), b"h"], "binary header"),
        ([msgpack.packb([11, 1]), b"h"], "binary header"),
        ([msgpack.packb([20, 0]), b"stray"], "carries no value"),
        ([b"\x91" + b"\xc4\xff" + b"x" * 70_000], "exceeds"),
    ],
)
def test_malformed_messages_are_protocol_errors(frames: list[bytes], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        p.parse(frames)


def _request(flags: int = 1, length: int = 9, stream_arg: int = -1, call_id: int = 7,
             timeout: float = 1.5, rest: bytes = b"Store.getTWS") -> bytes:
    return struct.pack("<BBHiQd", 10, flags, length, stream_arg, call_id, timeout) + rest


def test_request_layout_is_the_documented_one() -> None:
    frames = p.encode(p.Request(7, "Store.get", 1.5, 2, [b"TWS-header", b"buffer"]))
    assert frames[1:] == [b"buffer"]
    assert frames[0] == (struct.pack("<BBHiQd", 10, 1, 9, 2, 7, 1.5)
                         + b"Store.get" + b"TWS-header")
    frames = p.encode(p.Request(8, "S.m", None, -1, [b"h"]))
    assert frames == [struct.pack("<BBHiQd", 10, 0, 3, -1, 8, 0.0) + b"S.mh"]


def test_response_and_item_layout_is_the_documented_one() -> None:
    assert p.encode(p.Response(5, [b"head", b"buf"])) == [
        struct.pack("<BBHIQ", 11, 0, 0, 0, 5) + b"head", b"buf"
    ]
    assert p.encode(p.Item(6, [b"head"])) == [struct.pack("<BBHIQ", 14, 0, 0, 0, 6) + b"head"]


@pytest.mark.parametrize("value", [[b"head"], [b"head", b"buf1", b"buf2"]], ids=["one", "three"])
def test_the_hot_paths_encoders_make_what_encode_makes(value: list[bytes]) -> None:
    assert p.encode_request(7, "Store.get", 1.5, 0, value) == p.encode(
        p.Request(7, "Store.get", 1.5, 0, value))
    assert p.encode_request(8, "S.m", None, -1, value) == p.encode(
        p.Request(8, "S.m", None, -1, value))
    assert p.encode_response(9, value) == p.encode(p.Response(9, value))
    assert p.parse(p.encode_response(9, value)) == p.Response(9, value)


def test_binary_messages_parse_from_numpy_frames_as_views() -> None:
    frame = np.frombuffer(p.encode(p.Response(3, [b"head"]))[0], np.uint8).copy()
    message = p.parse([frame, b"buf"])
    assert isinstance(message, p.Response) and message.call_id == 3
    header = message.value[0]
    assert bytes(header) == b"head" and message.value[1:] == [b"buf"]
    frame[-4:] = np.frombuffer(b"HEAD", np.uint8)
    assert bytes(header) == b"HEAD"  # a view of the received frame, not a copy


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (_request()[:23], "cut short"),
        (_request(flags=3), "unknown REQUEST flags"),
        (_request(stream_arg=-2), "stream_arg"),
        (_request(timeout=float("nan")), "finite"),
        (_request(timeout=-1.0), "finite"),
        (_request(timeout=float("inf")), "finite"),
        (_request(flags=0, timeout=2.0), "carry 0.0"),
        (_request(length=12), "without its value"),
        (_request(length=200), "without its value"),
        (_request(rest=b"\xff\xfe.getxyz" + b"TWS"), "UTF-8"),
        (_request(call_id=1 << 63), "bad call id"),
        (struct.pack("<BBHIQ", 11, 0, 0, 0, 1), "without its value"),
        (struct.pack("<BBHIQ", 14, 0, 1, 0, 1) + b"h", "nonzero reserved"),
        (struct.pack("<BBHIQ", 11, 1, 0, 0, 1) + b"h", "nonzero reserved"),
        (struct.pack("<BBHIQ", 11, 0, 0, 1 << 31, 1) + b"h", "nonzero reserved"),
        (struct.pack("<BBHIQ", 11, 0, 0, 0, 1 << 63) + b"h", "bad call id"),
    ],
)
@pytest.mark.parametrize("frame_type", FRAME_TYPES)
def test_malformed_binary_headers_are_protocol_errors(frame: bytes, match: str,
                                                      frame_type: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        p.parse([FRAME_TYPES[frame_type](frame)])


def test_a_method_name_beyond_the_length_field_is_refused() -> None:
    with pytest.raises(ProtocolError, match="65535"):
        p.encode(p.Request(1, "x" * 70_000, None, -1, [b"h"]))


def _run(client: p.ClientHandshake, server: p.ServerHandshake) -> p.Message | None:
    """Play the handshake; returns the server's REJECT, if any."""
    outgoing: p.Message | None = client.start()
    while outgoing is not None:
        reply = server.receive(p.parse(p.encode(outgoing)))
        if isinstance(reply, p.Reject):
            return reply
        outgoing = client.receive(p.parse(p.encode(reply)))
    return None


def test_handshake_without_a_secret() -> None:
    client, server = p.ClientHandshake(secret=None), p.ServerHandshake(secret=None,
                                                                       max_concurrent=8)
    assert _run(client, server) is None
    assert client.done and server.done
    assert client.max_concurrent == 8


def test_handshake_with_the_right_secret_is_mutual() -> None:
    client = p.ClientHandshake(secret=SECRET)
    server = p.ServerHandshake(secret=SECRET, max_concurrent=8)
    assert _run(client, server) is None
    assert client.done and server.done


def test_wrong_secret_is_rejected() -> None:
    client = p.ClientHandshake(secret=b"not the secret")
    server = p.ServerHandshake(secret=SECRET, max_concurrent=8)
    reply = _run(client, server)
    assert isinstance(reply, p.Reject)
    assert reply.status == Status.UNAUTHENTICATED
    assert not server.done


def test_client_without_a_secret_gets_a_clear_error() -> None:
    client = p.ClientHandshake(secret=None)
    server = p.ServerHandshake(secret=SECRET, max_concurrent=8)
    welcome = server.receive(client.start())
    with pytest.raises(Unauthenticated, match="requires a shared secret"):
        client.receive(welcome)


def test_a_server_that_does_not_know_the_secret_is_caught() -> None:
    client = p.ClientHandshake(secret=SECRET)
    impostor = p.ServerHandshake(secret=b"impostor's guess", max_concurrent=8)
    auth = client.receive(impostor.receive(client.start()))
    assert isinstance(auth, p.Auth)
    # The impostor cannot check the proof, so it answers with a made-up one.
    with pytest.raises(Unauthenticated, match="could not prove"):
        client.receive(p.AuthOk(0, b"\0" * 32))


def test_skipping_auth_is_refused() -> None:
    server = p.ServerHandshake(secret=SECRET, max_concurrent=8)
    server.receive(p.ClientHandshake(secret=None).start())
    reply = server.receive(p.Request(1, "Store.get", None, -1, [b"h"]))
    assert isinstance(reply, p.Reject)
    assert reply.status == Status.UNAUTHENTICATED
    assert not server.done


def test_version_mismatch_both_ways() -> None:
    server = p.ServerHandshake(secret=None, max_concurrent=8)
    reply = server.receive(p.Hello(0, p.RPC_VERSION + 1, b"n" * 16, ""))
    assert isinstance(reply, p.Reject)
    assert f"version {p.RPC_VERSION + 1}" in reply.message
    client = p.ClientHandshake(secret=None)
    client.start()
    with pytest.raises(ProtocolError, match=f"version {p.RPC_VERSION + 1}"):
        client.receive(p.Welcome(0, p.RPC_VERSION + 1, b"s" * 16, False, 8))


def test_messages_before_the_handshake_are_refused() -> None:
    server = p.ServerHandshake(secret=None, max_concurrent=8)
    reply = server.receive(p.Ping(0))
    assert isinstance(reply, p.Reject)
    client = p.ClientHandshake(secret=None)
    client.start()
    with pytest.raises(ProtocolError, match="unexpected PONG"):
        client.receive(p.Pong(0))


def test_compiled_messages_read_as_the_others() -> None:
    # REQUEST, RESPONSE and ITEM are compiled classes (rpc/_wire.pyx), the
    # other kinds dataclasses: both read alike.
    request = p.Request(7, "Store.get", 1.5, -1, [b"h"])
    assert repr(request) == ("Request(call_id=7, method='Store.get', timeout=1.5, "
                             "stream_arg=-1, value=[b'h'])")
    assert repr(p.Item(9, [b"h"])) == "Item(call_id=9, value=[b'h'])"
    for message in (request, p.Response(7, [b"h"]), p.Item(7, [b"h"]), p.Ping(0)):
        assert isinstance(message, p.Message)
        assert p.parse(p.encode(message)) == message
    assert request.kind is p.Kind.REQUEST and p.Response.kind is p.Kind.RESPONSE
    assert request.fields == ("method", "timeout", "stream_arg")
    assert request.payload is request.value
    assert p.Response(7, [b"h"]) != p.Item(7, [b"h"])  # same fields, another kind
    assert request != p.Request(7, "Store.get", None, -1, [b"h"])
    request.timeout = None  # fields can be set, as a dataclass's
    assert request == p.Request(7, "Store.get", None, -1, [b"h"])
    with pytest.raises(TypeError):
        hash(request)  # unhashable, as a dataclass with eq
