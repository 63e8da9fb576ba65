"""tcp://-specific behaviour: hostile bytes, TLS, backpressure; and the sender's peak
memory while a 1 GiB frame goes out, over tcp:// and ucx://."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import struct
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import trustme

from tensorwire.errors import ConnectionClosedError, ProtocolError, TransportError
from tensorwire.transports import Connection, Listener, TransportConfig, connect, listen
from tensorwire.transports._delivery import READ_BUDGET_MESSAGES
from tensorwire.transports._stream_framing import HANDSHAKE

from .test_conformance import as_bytes, echo, pattern


@contextlib.asynccontextmanager
async def echo_server(config: TransportConfig | None = None) -> AsyncIterator[Listener]:
    listener = await listen("tcp://127.0.0.1:0", echo, config=config)
    try:
        yield listener
    finally:
        await listener.close()


def host_port(address: str) -> tuple[str, int]:
    host, port = address.split("://", 1)[1].rsplit(":", 1)
    return host.strip("[]"), int(port)


async def send_raw(address: str, payload: bytes) -> bytes:
    """Send raw bytes; return what came back before the server hung up."""
    reader, writer = await asyncio.open_connection(*host_port(address))
    writer.write(payload)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def assert_still_serving(address: str) -> None:
    async with await connect(address) as conn:
        await conn.send([b"still serving"])
        assert as_bytes((await conn.recv())[0]) == b"still serving"


def prelude(kind: int, nframes: int) -> bytes:
    return struct.pack("<B3xI", kind, nframes)


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "not a tensorwire endpoint"),
        (b"TWIR\x09\0\0\0", "version 9"),
        (HANDSHAKE + prelude(7, 0), "unknown message kind 7"),
        (HANDSHAKE + b"\0\1\0\0\0\0\0\0", "reserved"),
        (HANDSHAKE + prelude(0, 2**31), "frames exceeds the limit"),
        (HANDSHAKE + prelude(0, 1) + struct.pack("<Q", 2**62) + b"\0" * 8, "exceeds the limit"),
        (HANDSHAKE + prelude(0, 1) + struct.pack("<Q", 5) + b"\3" + b"\0" * 7, "device code 3"),
        (HANDSHAKE + prelude(0, 1) + struct.pack("<Q", 5) + b"\0\1" + b"\0" * 6, "padding"),
    ],
    ids=["http", "version", "kind", "reserved", "frame-count", "frame-size", "device", "padding"],
)
async def test_hostile_bytes_drop_that_connection_only(
    payload: bytes, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="tensorwire.transports.tcp")
    async with echo_server() as listener:
        await send_raw(listener.address, payload)
        await assert_still_serving(listener.address)
    dropped = [r.getMessage() for r in caplog.records if "dropping connection" in r.getMessage()]
    assert len(dropped) == 1
    assert reason in dropped[0]


async def test_absurd_size_is_refused_before_allocation() -> None:
    # 2**40 bytes could never be allocated here: if the listener tried, the
    # test would die with MemoryError instead of seeing the connection close.
    async with echo_server() as listener:
        payload = HANDSHAKE + prelude(0, 1) + struct.pack("<Q", 2**40) + b"\0" * 8
        assert await send_raw(listener.address, payload) == HANDSHAKE
        await assert_still_serving(listener.address)


async def test_silent_peer_is_dropped_after_handshake_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="tensorwire.transports.tcp")
    config = TransportConfig(handshake_timeout=0.2)
    async with echo_server(config) as listener:
        reader, writer = await asyncio.open_connection(*host_port(listener.address))
        try:
            assert await asyncio.wait_for(reader.read(), 10) == HANDSHAKE
        finally:
            writer.close()
        await assert_still_serving(listener.address)
    assert any("handshake" in r.getMessage() for r in caplog.records)


async def test_connecting_to_a_non_tensorwire_server_fails_clearly() -> None:
    async def http_like(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        await writer.drain()
        await reader.read()
        writer.close()

    server = await asyncio.start_server(http_like, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(ProtocolError, match="not a tensorwire endpoint"):
            await connect(f"tcp://127.0.0.1:{port}")
    finally:
        server.close()
        await server.wait_closed()


async def test_connection_refused_is_a_transport_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(TransportError, match="cannot connect"):
        await connect(f"tcp://127.0.0.1:{port}")


async def test_binding_a_port_in_use_is_a_transport_error() -> None:
    async with echo_server() as listener:
        with pytest.raises(TransportError, match="cannot listen"):
            await listen(listener.address, echo)


async def test_slow_consumer_pushes_back_on_its_sender() -> None:
    release = asyncio.Event()
    received: list[int] = []

    async def slow(conn: Connection) -> None:
        await release.wait()
        with contextlib.suppress(ConnectionClosedError):
            while True:
                received.append(len((await conn.recv())[0]))

    config = TransportConfig(socket_sndbuf=1 << 16, socket_rcvbuf=1 << 16)
    listener = await listen("tcp://127.0.0.1:0", slow, config=config)
    try:
        conn = await connect(listener.address, config=config)
        frame = np.zeros(16 << 20, np.uint8)
        sender = asyncio.create_task(conn.send([frame]))
        # The receiver reads nothing, so 16 MiB cannot fit in the socket
        # buffers: the send must still be waiting, not queued in memory.
        done, _ = await asyncio.wait([sender], timeout=0.5)
        assert not done
        release.set()
        await asyncio.wait_for(sender, 30)
        await conn.close()
    finally:
        await listener.close()
    assert received == [16 << 20]


def _tls_configs() -> tuple[TransportConfig, TransportConfig]:
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost", "127.0.0.1").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ca.configure_trust(client_ctx)
    return (
        TransportConfig(ssl_server=server_ctx),
        TransportConfig(ssl_client=client_ctx, ssl_server_hostname="localhost"),
    )


async def test_tls_roundtrip_and_close() -> None:
    server_config, client_config = _tls_configs()
    async with echo_server(server_config) as listener:
        conn = await connect(listener.address, config=client_config)
        for size in (0, 1, 100_000, 5 << 20):
            await conn.send([pattern(size, size), b"tail"])
            body, tail = await conn.recv()
            assert as_bytes(body) == pattern(size, size).tobytes()
            assert as_bytes(tail) == b"tail"
        await conn.close()
        assert conn.closed


async def test_tls_refuses_a_plain_client() -> None:
    server_config, _ = _tls_configs()
    async with echo_server(server_config) as listener:
        with pytest.raises(TransportError):
            await connect(listener.address, config=TransportConfig(connect_timeout=5))


async def test_tls_client_refuses_an_untrusted_server() -> None:
    server_config, _ = _tls_configs()
    _, other_client = _tls_configs()
    async with echo_server(server_config) as listener:
        with pytest.raises(TransportError):
            await connect(listener.address, config=other_client)


_MEMORY_SENDER = """
import asyncio, resource, sys
import numpy as np
from tensorwire.transports import connect

async def main():
    frame = np.ones(1 << 30, np.uint8)        # touched: resident before we measure
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    conn = await connect(sys.argv[1])
    await conn.send([frame])
    await conn.recv()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    await conn.close()
    print((after - before) * 1024)

asyncio.run(main())
"""


@pytest.mark.slow
@pytest.mark.parametrize("url", ["tcp://127.0.0.1:0", "ucx://127.0.0.1:0"], ids=["tcp", "ucx"])
async def test_sending_1gib_does_not_grow_peak_memory(url: str) -> None:
    if url.startswith("ucx"):
        pytest.importorskip("ucxx")
    target = np.empty(1 << 30, np.uint8)
    landed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def receive(conn: Connection) -> None:
        (frame,) = await conn.recv(allocator=lambda info: target)
        landed.set_result(frame)
        await conn.send([b"ok"])
        with contextlib.suppress(ConnectionClosedError):
            await conn.recv()

    async with (await listen(url, receive)) as listener:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _MEMORY_SENDER, listener.address, stdout=subprocess.PIPE
        )
        out, _ = await asyncio.wait_for(child.communicate(), 60)
        assert child.returncode == 0
    frame = await landed
    assert frame is target
    assert target[0] == 1 and target[-1] == 1
    growth = int(out.decode())
    assert growth < 64 << 20, f"sender's peak memory grew by {growth} bytes for a 1 GiB frame"


async def test_a_timed_out_connect_leaves_no_socket_behind() -> None:
    hung_up = asyncio.Queue[None]()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # accepts, never answers the handshake
        writer.close()
        await writer.wait_closed()
        hung_up.put_nowait(None)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    quick = TransportConfig(connect_timeout=0.1)
    try:
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(5):
            with pytest.raises(TransportError, match="timed out"):
                await connect(f"tcp://127.0.0.1:{port}", config=quick)
            # The server side sees our end close: the client socket is gone.
            await asyncio.wait_for(hung_up.get(), 10)
        assert len(os.listdir("/proc/self/fd")) <= before
    finally:
        server.close()
        await server.wait_closed()


async def test_a_message_runs_no_python_code_of_the_transport() -> None:
    # Issue 22: writing a message, reading it and handing it to its receiver
    # is compiled (StreamCore); the transport's Python runs per connection
    # and on rare paths only. Fewer messages than one read callback may hand
    # out: past that budget, reading pauses and resumes (fairness, in Python).
    count = READ_BUDGET_MESSAGES // 2
    loop = asyncio.get_running_loop()
    got: list[bytes] = []
    all_there = loop.create_future()
    serving = loop.create_future()
    finished = loop.create_future()

    def receive(frames: list[Any]) -> None:
        got.append(as_bytes(frames[0]))
        if len(got) == count + 1 and not all_there.done():
            all_there.set_result(None)

    async def handler(conn: Connection) -> None:
        # As the RPC layer asks (small frames as bytearrays, no NumPy
        # allocation per message).
        conn.deliver_to(receive, small_as_bytearray=True)
        serving.set_result(None)
        await finished

    listener = await listen("tcp://127.0.0.1:0", handler)
    try:
        async with await connect(listener.address) as conn:
            await conn.send([b"warm-up"])
            await asyncio.wait_for(serving, 30)
            transports = os.path.join("tensorwire", "transports", "")
            called: list[str] = []

            def profile(frame: Any, event: str, arg: Any) -> None:
                code = frame.f_code
                if event == "call" and transports in code.co_filename:
                    called.append(f"{code.co_filename}:{code.co_name}")

            sys.setprofile(profile)
            try:
                for i in range(count):
                    assert conn.send_nowait([[f"m{i}".encode()]]) is None
                await asyncio.wait_for(asyncio.shield(all_there), 30)
            finally:
                sys.setprofile(None)
            finished.set_result(None)
    finally:
        await listener.close()
    assert got == [b"warm-up"] + [f"m{i}".encode() for i in range(count)]
    assert sorted(set(called)) == []


async def _until(condition: Any, what: str, seconds: float = 10.0) -> None:
    """Poll the connection's state (no event tells of it) until ``condition()``."""
    for _ in range(int(seconds / 0.005)):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"no {what} within {seconds} s")


async def test_a_message_waiting_for_its_recv_leaves_the_drained_socket_registered() -> None:
    # A receiver with its own allocator (the collectives' links) posts its
    # recv() just after the peer's message came: the transport cannot
    # allocate that message before, but once the socket is drained it keeps
    # watching it, instead of a pause and a resume (the loop's watcher
    # removed and added again) per message.
    size = 4096
    async with echo_server() as listener, await connect(listener.address) as conn:
        pauses: list[str] = []

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call" and frame.f_code.co_name == "_pause_reading":
                pauses.append(frame.f_code.co_filename)

        # A first round trip whose recv() gives an allocator: no read-ahead
        # from now on.
        await conn.send([b"start"])
        await asyncio.wait_for(conn.recv(allocator=lambda info: bytearray(info.nbytes)), 10)
        for i in range(5):
            message = pattern(size, i)
            expected = conn.stats()["bytes_received"] + size
            sys.setprofile(profile)
            try:
                await conn.send([message])
                await _until(lambda: conn.stats()["bytes_received"] >= expected,  # noqa: B023
                             "the echo read")
                target = np.empty(size, np.uint8)
                (frame,) = await asyncio.wait_for(
                    conn.recv(allocator=lambda info: target), 10)  # noqa: B023
            finally:
                sys.setprofile(None)
            assert frame is target
            assert np.array_equal(target, message)
        assert pauses == []  # so no resume had to register the socket again


async def test_more_bytes_for_a_message_still_waiting_for_its_recv_pause_reading() -> None:
    # The bound on what a consumer that does not call recv() holds: once
    # the first message waits for its allocation, the next bytes stay in
    # the socket (reading pauses) until recv() asks for it.
    size = 4096
    async with echo_server() as listener, await connect(listener.address) as conn:
        first, second = pattern(size, 1), pattern(size, 2)
        # A first round trip whose recv() gives an allocator: no read-ahead
        # from now on.
        await conn.send([b"start"])
        await asyncio.wait_for(conn.recv(allocator=lambda info: bytearray(info.nbytes)), 10)
        start = conn.stats()["bytes_received"]
        await conn.send([first])
        await _until(lambda: conn.stats()["bytes_received"] >= start + size, "the first echo read")
        read = conn.stats()["bytes_received"]
        await conn.send([second])
        await _until(lambda: not conn._reading, "reading paused")  # type: ignore[attr-defined]
        assert conn.stats()["bytes_received"] == read  # the second is still in the socket
        targets = [np.empty(size, np.uint8), np.empty(size, np.uint8)]
        for target, sent in zip(targets, (first, second), strict=True):
            (frame,) = await asyncio.wait_for(conn.recv(allocator=lambda info: target), 10)  # noqa: B023
            assert frame is target
            assert np.array_equal(target, sent)


async def test_a_batch_of_more_buffers_than_one_sendmsg_takes_arrives_in_order() -> None:
    # 1500 messages are 3000 buffers: more than IOV_MAX (1024) per sendmsg.
    messages = [[f"m{i}".encode()] for i in range(1500)]
    async with echo_server() as listener, await connect(listener.address) as conn:
        await conn.send_many(messages)
        for expected in messages:
            assert as_bytes((await conn.recv())[0]) == expected[0]


def test_write_some_leaves_what_a_full_socket_did_not_take() -> None:
    from tensorwire.transports._stream_writes import write_some

    left, right = socket.socketpair()
    with left, right:
        left.setblocking(False)
        big = bytes(range(256)) * 4096  # 1 MiB: more than the socket buffer
        buffers: list[Any] = [b"head", big, b"tail"]
        sent = write_some(left.fileno(), buffers)
        assert 0 < sent < len(big) + 8
        rest = b"".join(bytes(b) for b in buffers)
        assert len(rest) == len(big) + 8 - sent
        assert rest.endswith(b"tail")
        assert (b"head" + big + b"tail")[sent:] == rest
        right.close()
        # A failed send raises (the peer is gone), as socket.sendmsg would.
        with pytest.raises(BrokenPipeError):
            write_some(left.fileno(), buffers)
