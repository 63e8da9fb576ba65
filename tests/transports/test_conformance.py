"""One conformance suite, run unchanged over every transport and event loop.

Dask's ``check_client_server`` is the model: the same checks over tcp://
(IPv4 and IPv6), inproc:// and ucx:// (UCX over TCP and shared memory here).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from tensorwire import serde
from tensorwire.errors import (
    ConfigError,
    ConnectionClosedError,
    LimitExceededError,
    TransportError,
    UnsupportedTransportError,
)
from tensorwire.transports import (
    Connection,
    FrameInfo,
    Limits,
    Listener,
    TransportConfig,
    buffer_pool,
    connect,
    listen,
)

Handler = Callable[[Connection], Awaitable[None]]


async def echo(conn: Connection) -> None:
    """Send every message back until the peer goes away."""
    while True:
        try:
            message = await conn.recv()
        except ConnectionClosedError:
            return
        await conn.send(message)


@contextlib.asynccontextmanager
async def serving(
    url: str, handler: Handler = echo, config: TransportConfig | None = None
) -> AsyncIterator[Listener]:
    listener = await listen(url, handler, config=config)
    try:
        yield listener
    finally:
        await listener.close()


def as_bytes(frame: Any) -> bytes:
    return bytes(memoryview(frame).cast("B"))


def pattern(size: int, seed: int = 0) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return ((np.arange(size, dtype=np.uint64) * 2654435761 + seed) % 251).astype(np.uint8)


async def test_listener_reports_real_address(listen_url: str) -> None:
    async with serving(listen_url) as listener:
        assert listener.address.split("://")[0] == listen_url.split("://")[0]
        if not listen_url.startswith("inproc"):
            assert not listener.address.endswith(":0")
            assert int(listener.address.rsplit(":", 1)[1]) > 0
        async with await connect(listener.address) as conn:
            await conn.send([b"ping"])
            assert as_bytes((await conn.recv())[0]) == b"ping"


@pytest.mark.parametrize(
    "size", [0, 1, 2, 3, 1023, 1024, 65535, 65536, 65537, 1 << 20, (1 << 20) + 7, 1 << 26]
)
async def test_roundtrip_sizes(listen_url: str, size: int) -> None:
    data = pattern(size, seed=size)
    async with serving(listen_url) as listener, await connect(listener.address) as conn:
        await conn.send([data])
        (frame,) = await conn.recv()
        assert memoryview(frame).nbytes == size
        assert np.array_equal(np.frombuffer(frame, np.uint8), data)


async def test_connections_count_their_messages_and_bytes(listen_url: str) -> None:
    async with serving(listen_url) as listener, await connect(listener.address) as conn:
        fresh = conn.stats()
        assert fresh["messages_sent"] == fresh["messages_received"] == 0
        assert fresh["bytes_sent"] < 64 and fresh["bytes_received"] < 64  # handshakes at most
        await conn.send([b"abc", pattern(1 << 20)])
        await conn.send_many([[b"x"], [b"yz"]])
        for _ in range(3):
            await conn.recv()
        stats = conn.stats()
    assert stats["messages_sent"] == stats["messages_received"] == 3
    payload = 3 + (1 << 20) + 1 + 2
    # Frames' bytes; a byte stream counts its framing too.
    assert payload <= stats["bytes_sent"] < payload + 512
    assert stats["bytes_received"] == stats["bytes_sent"]
    assert stats["device_bytes_staged"] == 0  # host frames only


async def test_empty_message_and_empty_frames(listen_url: str) -> None:
    async with serving(listen_url) as listener, await connect(listener.address) as conn:
        await conn.send([])
        assert await conn.recv() == []
        await conn.send([b"", b"x", b"", bytearray(b"yz"), b""])
        frames = await conn.recv()
        assert [as_bytes(f) for f in frames] == [b"", b"x", b"", b"yz", b""]


async def test_many_frames(listen_url: str) -> None:
    frames = [pattern(i * 37 % 5000, seed=i) for i in range(1000)]
    async with serving(listen_url) as listener, await connect(listener.address) as conn:
        await conn.send(frames)
        got = await conn.recv()
        assert len(got) == len(frames)
        for sent, received in zip(frames, got, strict=True):
            assert as_bytes(received) == sent.tobytes()


async def test_buffer_kinds_arrive_as_their_bytes(listen_url: str) -> None:
    fortran = np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4))
    frames: list[Any] = [
        b"bytes",
        bytearray(b"bytearray"),
        memoryview(b"memoryview"),
        np.arange(5, dtype=np.int32),
        fortran,
        np.float32(1.5),
    ]
    expected = [
        b"bytes",
        b"bytearray",
        b"memoryview",
        np.arange(5, dtype=np.int32).tobytes(),
        fortran.tobytes(order="F"),
        np.float32(1.5).tobytes(),
    ]
    async with serving(listen_url) as listener, await connect(listener.address) as conn:
        await conn.send(frames)
        assert [as_bytes(f) for f in await conn.recv()] == expected


async def test_non_contiguous_frame_is_refused_and_connection_survives(listen_url: str) -> None:
    async with serving(listen_url) as listener, await connect(listener.address) as conn:
        with pytest.raises(TransportError, match="contiguous"):
            await conn.send([np.arange(10)[::2]])
        await conn.send([b"still here"])
        assert as_bytes((await conn.recv())[0]) == b"still here"


async def test_both_directions_at_once(listen_url: str) -> None:
    count = 200
    received: list[bytes] = []

    async def talker(conn: Connection) -> None:
        async def pump_out() -> None:
            for i in range(count):
                await conn.send([f"server {i}".encode(), pattern(3000, i)])

        sender = asyncio.create_task(pump_out())
        for i in range(count):
            frames = await conn.recv()
            assert as_bytes(frames[0]) == f"client {i}".encode()
        await sender
        await conn.recv()  # wait for the client's goodbye

    async with serving(listen_url, talker) as listener, await connect(listener.address) as conn:

        async def pump_in() -> None:
            for _ in range(count):
                frames = await conn.recv()
                received.append(as_bytes(frames[0]))
                assert as_bytes(frames[1]) == pattern(3000, len(received) - 1).tobytes()

        reader = asyncio.create_task(pump_in())
        for i in range(count):
            await conn.send([f"client {i}".encode()])
        await asyncio.wait_for(reader, 30)
    assert received == [f"server {i}".encode() for i in range(count)]


async def test_concurrent_senders_never_interleave(listen_url: str) -> None:
    senders, per_sender = 16, 40

    async with serving(listen_url) as listener, await connect(listener.address) as conn:

        async def sender(s: int) -> None:
            for i in range(per_sender):
                size = 1 + (s * 7919 + i * 104729) % 200_000
                tag = f"{s}:{i}".encode()
                await conn.send([tag, pattern(size, s), tag])

        tasks = [asyncio.create_task(sender(s)) for s in range(senders)]
        seen: dict[int, int] = {}
        for _ in range(senders * per_sender):
            head, body, tail = await asyncio.wait_for(conn.recv(), 30)
            assert as_bytes(head) == as_bytes(tail)
            s, i = map(int, as_bytes(head).split(b":"))
            assert i == seen.get(s, -1) + 1, "messages of one sender arrived out of order"
            seen[s] = i
            size = 1 + (s * 7919 + i * 104729) % 200_000
            assert as_bytes(body) == pattern(size, s).tobytes()
        await asyncio.gather(*tasks)
    assert seen == dict.fromkeys(range(senders), per_sender - 1)


async def test_many_connections_to_one_listener(listen_url: str) -> None:
    async with serving(listen_url) as listener:

        async def client(c: int) -> None:
            async with await connect(listener.address) as conn:
                for i in range(10):
                    await conn.send([f"{c}/{i}".encode()])
                    assert as_bytes((await conn.recv())[0]) == f"{c}/{i}".encode()

        await asyncio.wait_for(asyncio.gather(*(client(c) for c in range(24))), 60)


async def _peer_sees_end(listen_url: str, end: Callable[[Connection], Awaitable[None]]) -> None:
    outcome: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

    async def watcher(conn: Connection) -> None:
        await conn.send([b"ready"])
        try:
            await conn.recv()
        except ConnectionClosedError as exc:
            outcome.set_result(exc)
        else:
            outcome.set_result(AssertionError("recv() returned after the peer left"))

    async with serving(listen_url, watcher) as listener:
        conn = await connect(listener.address)
        await conn.recv()
        await end(conn)
        assert conn.closed
        result = await asyncio.wait_for(outcome, 10)
        assert isinstance(result, ConnectionClosedError), result
        with pytest.raises(ConnectionClosedError):
            await conn.send([b"after close"])
        with pytest.raises(ConnectionClosedError):
            await conn.recv()


async def test_polite_close_tells_the_peer(listen_url: str) -> None:
    await _peer_sees_end(listen_url, lambda conn: conn.close())


async def test_abort_tells_the_peer_and_is_idempotent(listen_url: str) -> None:
    async def abort_twice(conn: Connection) -> None:
        conn.abort()
        conn.abort()
        await conn.close()

    await _peer_sees_end(listen_url, abort_twice)


async def test_close_delivers_what_was_sent_before(listen_url: str) -> None:
    got: asyncio.Future[list[bytes]] = asyncio.get_running_loop().create_future()

    async def collect(conn: Connection) -> None:
        frames: list[bytes] = []
        with contextlib.suppress(ConnectionClosedError):
            while True:
                frames.append(as_bytes((await conn.recv())[0]))
        got.set_result(frames)

    async with serving(listen_url, collect) as listener:
        conn = await connect(listener.address)
        for i in range(50):
            await conn.send([str(i).encode() * 1000])
        await conn.close()
        assert await asyncio.wait_for(got, 10) == [str(i).encode() * 1000 for i in range(50)]


async def test_receive_into_allocator_memory(listen_url: str) -> None:
    handed_out: list[np.ndarray[Any, np.dtype[np.uint8]]] = []

    def allocator(info: FrameInfo) -> np.ndarray[Any, np.dtype[np.uint8]]:
        assert info.device == "cpu"
        buffer = np.empty(info.nbytes, np.uint8)
        handed_out.append(buffer)
        return buffer

    async with serving(listen_url) as listener, await connect(listener.address) as conn:
        sent = [pattern(1 << 20), pattern(10, 1), pattern(0)]
        await conn.send(sent)
        frames = await conn.recv(allocator=allocator)
        assert [f.ctypes.data for f in frames] == [b.ctypes.data for b in handed_out]
        assert all(f is b for f, b in zip(frames, handed_out, strict=True))
        for a, b in zip(frames, sent, strict=True):
            assert np.array_equal(a, b)


def at_offset(frame: np.ndarray[Any, Any], offset: int) -> np.ndarray[Any, Any]:
    """A copy of ``frame`` whose data starts ``offset`` bytes past a 64-byte boundary."""
    raw = np.empty(frame.nbytes + 64, np.uint8)
    start = (offset - raw.ctypes.data) % 64
    out = raw[start : start + frame.nbytes]
    out[:] = frame
    return out


async def test_default_frames_are_aligned_writable_uint8(listen_url: str) -> None:
    if listen_url.startswith("inproc"):
        pytest.skip("inproc:// passes frames by reference (see its docs)")
    sent = [at_offset(pattern(12345), 0), at_offset(pattern(12345, 1), 16), pattern(3)]
    # ucx:// puts a frame sent on its own where the sender's lay past a
    # 64-byte boundary (a shared-memory copy between them runs at full
    # speed); the small frame travels inline. tcp:// aligns every frame.
    offsets = [0, 16, 0] if listen_url.startswith("ucx") else [0, 0, 0]
    async with serving(listen_url) as listener, await connect(listener.address) as conn:
        await conn.send(sent)
        frames = await conn.recv()
        for frame, offset, original in zip(frames, offsets, sent, strict=True):
            assert isinstance(frame, np.ndarray)
            assert frame.dtype == np.uint8
            assert frame.flags.writeable
            assert frame.ctypes.data % 64 == offset
            assert np.array_equal(frame, original)


async def test_limits_refuse_before_allocating_and_listener_goes_on(listen_url: str) -> None:
    errors: list[BaseException] = []
    limits = Limits(max_frame_bytes=4096, max_frames=8, max_message_bytes=10_000)

    async def guarded(conn: Connection) -> None:
        try:
            await echo(conn)
        except LimitExceededError as exc:
            errors.append(exc)

    config = TransportConfig(limits=limits)
    async with serving(listen_url, guarded, config) as listener:
        for bad in ([pattern(5000)], [b"x"] * 9, [pattern(4000)] * 3):
            conn = await connect(listener.address)
            await conn.send(bad)
            with pytest.raises(ConnectionClosedError):
                await asyncio.wait_for(conn.recv(), 10)
            conn.abort()
        async with await connect(listener.address) as good:
            await good.send([pattern(4000), pattern(4000)])
            assert len(await good.recv()) == 2
    assert len(errors) == 3
    messages = " | ".join(str(e) for e in errors)
    assert "4096" in messages and "8" in messages and "10000" in messages


async def test_refuse_oversized_skips_the_message_and_keeps_the_connection(
    listen_url: str,
) -> None:
    refused: list[LimitExceededError] = []
    limits = Limits(max_frame_bytes=4096, max_frames=8, max_message_bytes=10_000)

    async def guarded(conn: Connection) -> None:
        assert conn.refuse_oversized(refused.append)
        await echo(conn)

    config = TransportConfig(limits=limits)
    big = pattern(1 << 20, seed=3)
    async with (
        serving(listen_url, guarded, config) as listener,
        await connect(listener.address) as conn,
    ):
        await conn.send([b"head-a", pattern(5000)])  # a frame over the limit
        await conn.send([b"one"])
        await conn.send([pattern(4000, seed=1)] * 3)  # the message over the limit
        await conn.send([pattern(5000), b"x"])  # its first frame is too big to keep
        await conn.send([b"", big])
        await conn.send([b"two", pattern(4000, seed=2)])
        assert as_bytes((await asyncio.wait_for(conn.recv(), 10))[0]) == b"one"
        frames = await asyncio.wait_for(conn.recv(), 10)
        assert [as_bytes(f) for f in frames] == [b"two", as_bytes(pattern(4000, seed=2))]
        # More frames than the limit: the frame table itself is not
        # read, so this one still ends the connection.
        await conn.send([b"x"] * 9)
        with pytest.raises(ConnectionClosedError):
            await asyncio.wait_for(conn.recv(), 10)
    heads = [e.head for e in refused]
    assert heads == [b"head-a", as_bytes(pattern(4000, seed=1)), None, b""]
    assert "4096" in str(refused[0]) and "10000" in str(refused[1])


async def test_connect_to_nothing_fails_clearly(listen_url: str) -> None:
    async with serving(listen_url) as listener:
        address = listener.address
    with pytest.raises(TransportError):
        await connect(address, config=TransportConfig(connect_timeout=5))


async def test_bad_urls() -> None:
    with pytest.raises(UnsupportedTransportError, match="carrier-pigeon"):
        await connect("carrier-pigeon://coop:1")
    with pytest.raises(ConfigError):
        await connect("127.0.0.1:80")
    with pytest.raises(ConfigError):
        await connect("tcp://127.0.0.1")
    with pytest.raises(ConfigError):
        await connect("tcp://127.0.0.1:99999")


_KILLABLE_PEER = """
import asyncio, sys
from tensorwire.transports import connect

async def main():
    conn = await connect(sys.argv[1])
    await conn.send([b"connected"])
    await asyncio.sleep(120)

asyncio.run(main())
"""


async def test_peer_killed_with_sigkill_is_noticed_within_seconds(listen_url: str) -> None:
    if listen_url.startswith("inproc"):
        pytest.skip("inproc:// has no peer process")
    hello: asyncio.Future[Connection] = asyncio.get_running_loop().create_future()
    result: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    async def handler(conn: Connection) -> None:
        await conn.recv()
        hello.set_result(conn)
        try:
            await conn.recv()
        except ConnectionClosedError as exc:
            result.set_result(exc)
        else:
            result.set_result(None)

    async with serving(listen_url, handler) as listener:
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _KILLABLE_PEER,
            listener.address,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            await asyncio.wait_for(hello, 60)
            os.kill(child.pid, signal.SIGKILL)
            loop = asyncio.get_running_loop()
            killed_at = loop.time()
            error = await asyncio.wait_for(result, 10)
            assert isinstance(error, ConnectionClosedError)
            assert loop.time() - killed_at < 10
        finally:
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            await child.wait()


async def test_send_many_keeps_order_and_message_boundaries(listen_url: str) -> None:
    messages = [[f"m{i}".encode(), pattern(i * 1000, i)] for i in range(50)] + [[]]
    async with serving(listen_url) as listener, await connect(listener.address) as conn:
        # Receive while sending: the echo's replies need a reader (over UCX a
        # large reply completes only when it is received).
        sender = asyncio.create_task(conn.send_many(messages))
        for i in range(50):
            head, body = await asyncio.wait_for(conn.recv(), 30)
            assert as_bytes(head) == f"m{i}".encode()
            assert as_bytes(body) == pattern(i * 1000, i).tobytes()
        assert await conn.recv() == []
        await sender


async def test_a_cancelled_recv_loses_no_message(listen_url: str) -> None:
    got: list[bytes] = []
    async with serving(listen_url) as listener, await connect(listener.address) as conn:
        for i in range(20):
            await conn.send([f"n{i}".encode()])
            # A deadline that may pass in the same loop turn as the data.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0):
                    got.append(as_bytes((await conn.recv())[0]))
        with contextlib.suppress(TimeoutError):
            while len(got) < 20:
                async with asyncio.timeout(5):
                    got.append(as_bytes((await conn.recv())[0]))
    # Every echo arrives exactly once, in order: none was lost to a recv()
    # that was cancelled after its message had been handed to it.
    assert got == [f"n{i}".encode() for i in range(20)]


async def test_a_cancelled_send_finishes_its_message_and_the_connection_lives(
    listen_url: str,
) -> None:
    if listen_url.startswith("inproc"):
        pytest.skip("an inproc:// send never stops half-way")
    release = asyncio.Event()
    received: list[int] = []
    done = asyncio.Event()

    async def slow(conn: Connection) -> None:
        await release.wait()
        with contextlib.suppress(ConnectionClosedError):
            while True:
                received.append(memoryview((await conn.recv())[0]).nbytes)
                if len(received) == 2:
                    done.set()

    small = TransportConfig(socket_sndbuf=1 << 16, socket_rcvbuf=1 << 16)
    async with serving(listen_url, slow, small) as listener:
        conn = await connect(listener.address, config=small)
        sender = asyncio.create_task(conn.send([np.zeros(16 << 20, np.uint8)]))
        finished, _ = await asyncio.wait([sender], timeout=0.3)
        assert not finished, "16 MiB cannot be out while the peer reads nothing"
        sender.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sender
        # Half a message was out: it is finished in the background, so the
        # connection is still good and the next message follows it.
        assert not conn.closed
        after = asyncio.create_task(conn.send([b"after"]))
        release.set()
        await asyncio.wait_for(after, 30)
        await asyncio.wait_for(done.wait(), 30)
        await conn.close()
    assert received == [16 << 20, 5]


async def test_send_nowait_keeps_order_with_sends_and_reports_when_done(listen_url: str) -> None:
    release = asyncio.Event()
    received: list[bytes] = []
    done = asyncio.Event()

    async def slow(conn: Connection) -> None:
        await release.wait()
        with contextlib.suppress(ConnectionClosedError):
            while True:
                frames = await conn.recv()
                received.append(as_bytes(frames[0])[:8])
                if len(received) == 5:
                    done.set()

    small = TransportConfig(socket_sndbuf=1 << 16, socket_rcvbuf=1 << 16)
    async with serving(listen_url, slow, small) as listener:
        conn = await connect(listener.address, config=small)
        # Small messages go out at once, or from the background on a
        # transport that cannot write without waiting.
        first = conn.send_nowait([[b"first..."], [b"second.."]])
        if first is not None:
            await asyncio.wait_for(first, 30)
        # 16 MiB does not fit the socket while the peer reads nothing: the
        # rest goes out in the background and the future says when.
        big = conn.send_nowait([[b"big.....", np.zeros(16 << 20, np.uint8)]])
        queued = conn.send_nowait([[b"after..."]])
        last = asyncio.create_task(conn.send([b"last...."]))
        await asyncio.sleep(0.2)
        if not listen_url.startswith("inproc"):  # inproc:// passes frames by reference
            assert big is not None and not big.done()
        release.set()
        pending = [f for f in (big, queued) if f is not None]
        await asyncio.wait_for(asyncio.gather(*pending, last), 30)
        await asyncio.wait_for(done.wait(), 30)
        await conn.close()
    assert received == [b"first...", b"second..", b"big.....", b"after...", b"last...."]


async def test_a_send_started_after_a_queued_send_nowait_goes_after_it(
    listen_url: str,
) -> None:
    # send() is awaited directly (it runs at once, up to the send lock), after
    # a send_nowait() that had to queue behind a write the socket could not
    # take: the queued messages still go first.
    release = asyncio.Event()
    received: list[bytes] = []
    done = asyncio.Event()

    async def slow(conn: Connection) -> None:
        await release.wait()
        with contextlib.suppress(ConnectionClosedError):
            while True:
                frames = await conn.recv()
                received.append(as_bytes(frames[0])[:8])
                if len(received) == 4:
                    done.set()

    small = TransportConfig(socket_sndbuf=1 << 16, socket_rcvbuf=1 << 16)
    async with serving(listen_url, slow, small) as listener:
        conn = await connect(listener.address, config=small)
        big = conn.send_nowait([[b"big.....", np.zeros(16 << 20, np.uint8)]])
        queued = conn.send_nowait([[b"queued1."], [b"queued2."]])
        asyncio.get_running_loop().call_later(0.2, release.set)
        async with asyncio.timeout(30):
            # Not wait_for(), which would start the send from a new task.
            await conn.send([b"last...."])
        pending = [f for f in (big, queued) if f is not None]
        await asyncio.wait_for(asyncio.gather(*pending), 30)
        await asyncio.wait_for(done.wait(), 30)
        await conn.close()
    assert received == [b"big.....", b"queued1.", b"queued2.", b"last...."]


async def test_send_nowait_on_a_closed_connection_raises(listen_url: str) -> None:
    async with serving(listen_url) as listener:
        conn = await connect(listener.address)
        await conn.close()
        with pytest.raises(ConnectionClosedError):
            conn.send_nowait([[b"late"]])


async def test_small_messages_read_ahead_keep_order_and_a_big_one_gets_its_allocator(
    listen_url: str,
) -> None:
    target = np.empty(1 << 20, np.uint8)
    async with serving(listen_url) as listener, await connect(listener.address) as conn:
        await conn.send_many([[f"s{i}".encode()] for i in range(100)] + [[pattern(1 << 20)]])
        for i in range(100):
            (frame,) = await asyncio.wait_for(conn.recv(), 30)
            assert as_bytes(frame) == f"s{i}".encode()
        (frame,) = await asyncio.wait_for(conn.recv(allocator=lambda info: target), 30)
        assert frame is target
        assert np.array_equal(target, pattern(1 << 20))


async def test_deliver_to_hands_over_every_message_in_order(listen_url: str) -> None:
    got: list[bytes] = []
    done = asyncio.Event()

    def receive(frames: list[Any]) -> None:
        got.append(as_bytes(frames[0]))
        if len(got) == 60:
            done.set()

    async with serving(listen_url) as listener, await connect(listener.address) as conn:
        for i in range(20):
            await conn.send([f"a{i}".encode()])
        await asyncio.sleep(0.05)  # some echoes are already queued for recv()
        if not conn.deliver_to(receive):
            pytest.skip("this transport delivers through recv() only")
        await conn.send_many([[f"b{i}".encode()] for i in range(20)])
        await conn.send_many([[f"c{i}".encode(), pattern(100_000, i)] for i in range(20)])
        await asyncio.wait_for(done.wait(), 30)
    assert got == [f"{k}{i}".encode() for k in "abc" for i in range(20)]


async def test_deliver_to_copies_small_frames_into_bytearrays_where_asked(
    listen_url: str,
) -> None:
    got: list[list[Any]] = []
    done = asyncio.Event()
    small = [[f"small{i}".encode() * (i + 1)] for i in range(40)]
    others = [[b"two", b"frames"], [pattern(200_000)], [b""]]

    def receive(frames: list[Any]) -> None:
        got.append(frames)
        if len(got) == len(small) + len(others):
            done.set()

    async with serving(listen_url) as listener, await connect(listener.address) as conn:
        if not conn.deliver_to(receive, small_as_bytearray=True):
            pytest.skip("this transport delivers through recv() only")
        # Several sends: later reads reuse the read-ahead buffer, which must
        # not change the frames handed out before.
        for i in range(0, len(small), 10):
            await conn.send_many(small[i : i + 10])
        await conn.send_many(others)
        await asyncio.wait_for(done.wait(), 30)
    assert [[as_bytes(f) for f in frames] for frames in got] == [
        [as_bytes(f) for f in frames] for frames in small + others
    ]
    assert all(type(frames[0]) is bytearray for frames in got[: len(small)])
    for frames in got[len(small):-1]:  # more than one frame, or a large one
        assert all(type(frame) is np.ndarray for frame in frames)


async def test_a_failing_receiver_aborts_the_connection(listen_url: str) -> None:
    def receive(frames: list[Any]) -> None:
        raise RuntimeError("receiver bug")

    async with serving(listen_url) as listener, await connect(listener.address) as conn:
        if not conn.deliver_to(receive):
            pytest.skip("this transport delivers through recv() only")
        await conn.send([b"x"])
        with pytest.raises(TransportError, match="receiver bug"):
            await asyncio.wait_for(conn.recv(), 30)
        assert conn.closed


async def test_large_frames_land_in_freed_buffers_and_never_in_held_ones(listen_url: str) -> None:
    if listen_url.startswith("inproc"):
        pytest.skip("inproc:// passes frames by reference (see its docs)")
    size = 3 << 20
    pool = buffer_pool()
    if pool.stats().max_bytes < 64 * size:
        pytest.skip("the process's buffer pool is turned off or small here")
    async with serving(listen_url) as listener, await connect(listener.address) as conn:
        # Held: frames themselves, and an array decoded from a message whose
        # frames are dropped (it views its frame).
        held = []
        for seed in range(2):
            await conn.send([pattern(size, seed)])
            held.append((await conn.recv())[0])
        header, buffers = serde.encode(pattern(size, 2))
        await conn.send([header, *buffers])
        frames = await conn.recv()
        held.append(serde.decode(frames[0], frames[1:]))
        del frames
        for seed in range(3, 6):
            await conn.send([pattern(size, seed)])
            del_me = await conn.recv()
            del del_me
        starts = sorted(frame.ctypes.data for frame in held)
        assert all(b - a >= size for a, b in itertools.pairwise(starts))
        for seed, frame in enumerate(held):
            assert np.array_equal(frame, pattern(size, seed))
        held.clear()
        # Both ends' receive buffers now circulate through the pool: after a
        # warm-up, echoes allocate nothing new.
        for seed in range(3):
            await conn.send([pattern(size, seed)])
            del_me = await conn.recv()
            del del_me
        misses = pool.stats().misses
        for seed in range(5):
            await conn.send([pattern(size, seed)])
            (frame,) = await conn.recv()
            assert np.array_equal(frame, pattern(size, seed))
            del frame
        assert pool.stats().misses == misses


async def test_a_transport_that_stamps_messages_moves_last_activity_with_each(
    listen_url: str,
) -> None:
    # The RPC driver leaves the liveness time of each message to such a
    # transport (conn.stamps_messages), small messages included.
    async with serving(listen_url) as listener, await connect(listener.address) as conn:
        if not conn.stamps_messages:
            assert conn.last_activity is None
            return
        loop = asyncio.get_running_loop()
        for _ in range(3):
            before = loop.time()
            await asyncio.sleep(0.01)
            await conn.send([b"x"])
            await conn.recv()
            activity = conn.last_activity
            assert activity is not None and activity > before
