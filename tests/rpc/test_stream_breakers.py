"""Peers that break the stream rules, on a raw TCP socket speaking the wire
format (docs/protocol.md, "Flow control"), against a real server on
loopback: the breaker's connection is dropped, the handler sees no item
beyond what the rules allow, and a well-behaved client on another
connection goes on unaffected."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from typing import Any

import pytest

import tensorwire as tw
from tensorwire import rpc, serde
from tensorwire.errors import Unimplemented
from tensorwire.rpc import ServerConfig, protocol

from ..reliability.test_hostile import HANDSHAKE, message, rpc_hello

WINDOW = 4


class Recorder(rpc.Service):
    def __init__(self) -> None:
        self.seen: list[Any] = []
        self.stopped = asyncio.Event()  # set when a generator of endless() stops

    @rpc.method
    async def collect(self, values: AsyncIterator[Any]) -> int:
        async for value in values:
            self.seen.append(value)
        return len(self.seen)

    @rpc.method
    async def slow(self, seconds: float) -> float:
        await asyncio.sleep(seconds)
        return seconds

    @rpc.method
    async def unary(self, value: int) -> int:
        return value

    @rpc.method
    async def count(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i

    @rpc.method
    async def doubled(self, values: AsyncIterator[int]) -> AsyncIterator[int]:
        self.seen.append("doubling")
        try:
            async for value in values:
                yield 2 * value
        finally:
            self.seen.append("stopped")
            self.stopped.set()

    @rpc.method
    async def endless(self) -> AsyncIterator[int]:
        self.seen.append("started")
        try:
            while True:
                yield 1
                await asyncio.sleep(0)
        finally:
            self.seen.append("stopped")
            self.stopped.set()


def _frames(msg: protocol.Message) -> bytes:
    return message([bytes(memoryview(f).cast("B")) for f in protocol.encode(msg)])


def _request(call_id: int, method: str, args: list[Any], stream_arg: int = -1) -> bytes:
    header, buffers = serde.encode([args, {}])
    return _frames(protocol.Request(call_id, method, 10.0, stream_arg, [header, *buffers]))


def _item(call_id: int, value: Any) -> bytes:
    header, buffers = serde.encode(value)
    return _frames(protocol.Item(call_id, [header, *buffers]))


class Raw:
    """A peer on a raw socket: it writes bytes, reads messages."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, address: str) -> Raw:
        host, port = address.split("://", 1)[1].rsplit(":", 1)
        raw = cls(*await asyncio.open_connection(host, int(port)))
        raw.writer.write(HANDSHAKE + rpc_hello())
        assert await raw.reader.readexactly(8) == HANDSHAKE
        assert isinstance(await raw.read(), protocol.Welcome)
        return raw

    async def read(self) -> protocol.Message | None:
        """The next message, None at the end of the connection."""
        try:
            kind, _, _, n = struct.unpack("<BBHI", await self.reader.readexactly(8))
            if kind == 1:
                return None  # GOODBYE
            table = await self.reader.readexactly(8 * n + -(-n // 8) * 8)
            sizes = struct.unpack(f"<{n}Q", table[:8 * n])
            frames = [await self.reader.readexactly(size) for size in sizes]
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        return protocol.parse(frames)

    async def until(self, kind: type[protocol.Message]) -> protocol.Message:
        while True:
            got = await asyncio.wait_for(self.read(), 10)
            assert got is not None, f"the connection ended before a {kind.__name__}"
            if isinstance(got, kind):
                return got

    async def dropped(self) -> bool:
        """Whether the server ends the connection (within 10 s)."""
        async with asyncio.timeout(10):
            while (got := await self.read()) is not None:
                if isinstance(got, protocol.Response | protocol.Error):
                    return False  # it answered the breach as if it were fine
        return True

    def close(self) -> None:
        self.writer.close()


# Each breaker: what it sends after the REQUEST (and, where it says so,
# after the server's first CREDIT); every one breaks a rule.
BREAKERS: dict[str, tuple[str, list[Any], int, bool, list[bytes]]] = {
    "items beyond the credit": (
        "Recorder.collect", [], 0, True, [_item(1, v) for v in range(WINDOW + 1)]),
    "an item before any credit": (
        "Recorder.collect", [], 0, False, [_item(1, 0)]),
    "an item after END": (
        "Recorder.collect", [], 0, True,
        [_item(1, 0), _frames(protocol.End(1)), _item(1, 99)]),
    "an item on a call without a streamed argument": (
        "Recorder.slow", [0.5], -1, False, [_item(1, 99)]),
    "a credit of 0": (
        "Recorder.count", [3], -1, False, [_frames(protocol.Credit(1, 0))]),
    "a negative credit": (
        "Recorder.count", [3], -1, False, [_frames(protocol.Credit(1, -5))]),
}


@pytest.mark.parametrize("name", list(BREAKERS))
async def test_a_stream_breaker_is_dropped(name: str) -> None:
    method, args, stream_arg, after_credit, breach = BREAKERS[name]
    recorder = Recorder()
    server = tw.Server([recorder], config=ServerConfig(stream_window=WINDOW))
    (address,) = await server.start("tcp://127.0.0.1:0")
    try:
        async with tw.connect(address) as good:
            good_stream = good.stream("Recorder.count", 50)
            first = await anext(good_stream)  # a stream in flight meanwhile
            raw = await Raw.connect(address)
            raw.writer.write(_request(1, method, args, stream_arg))
            if after_credit:
                credit = await raw.until(protocol.Credit)
                assert credit.count == WINDOW  # type: ignore[attr-defined]
            raw.writer.write(b"".join(breach))
            assert await raw.dropped(), f"{name}: the connection was not dropped"
            raw.close()
            # The handler saw nothing beyond the rules.
            assert 99 not in recorder.seen and len(recorder.seen) <= WINDOW
            # The good client never noticed.
            assert [first, *[x async for x in good_stream]] == list(range(50))
            assert await good.call("Recorder.unary", 7) == 7
    finally:
        await server.close(grace=0)


async def test_a_call_id_in_use_is_refused_and_one_that_ended_can_come_again() -> None:
    """A REQUEST whose call id is a running call's breaks the protocol:
    the connection is dropped, the second handler never runs, and another
    client goes on. An id whose call has ended may be used again."""
    recorder = Recorder()
    server = tw.Server([recorder])
    (address,) = await server.start("tcp://127.0.0.1:0")
    try:
        async with tw.connect(address) as good:
            raw = await Raw.connect(address)
            raw.writer.write(_request(5, "Recorder.unary", [1]))
            assert (await raw.until(protocol.Response)).call_id == 5
            raw.writer.write(_request(5, "Recorder.unary", [2]))  # it ended: fine
            assert (await raw.until(protocol.Response)).call_id == 5
            raw.writer.write(_request(2**62, "Recorder.slow", [5.0]))
            raw.writer.write(_request(2**62, "Recorder.collect", [], 0))
            assert await raw.dropped()
            raw.close()
            assert recorder.seen == []  # collect never ran
            assert await good.call("Recorder.unary", 7) == 7
    finally:
        await server.close(grace=0)


async def test_a_credit_for_a_unary_result_is_ignored() -> None:
    server = tw.Server([Recorder()])
    (address,) = await server.start("tcp://127.0.0.1:0")
    try:
        raw = await Raw.connect(address)
        raw.writer.write(_request(1, "Recorder.slow", [0.05])
                         + _frames(protocol.Credit(1, 16)))
        answer = await raw.until(protocol.Response)
        assert answer.call_id == 1
        raw.writer.write(_frames(protocol.Ping(0)))
        await raw.until(protocol.Pong)  # the connection goes on
        raw.close()
    finally:
        await server.close(grace=0)


async def test_a_stream_of_a_unary_method_fails_clearly() -> None:
    server = tw.Server([Recorder()])
    (address,) = await server.start("tcp://127.0.0.1:0")
    try:
        async with tw.connect(address) as client:
            with pytest.raises(Unimplemented, match="call it with call"):
                async with asyncio.timeout(5):  # it never waits for its deadline
                    [x async for x in client.stream("Recorder.unary", 1, timeout=60)]
            assert await client.call("Recorder.unary", 2) == 2  # same connection
            assert len(server.transport_stats()) == 1
    finally:
        await server.close(grace=0)


@pytest.mark.parametrize(("method", "args"), [
    ("Recorder.count", [3]),  # its first ITEM tells the client
    ("Recorder.count", [0]),  # no ITEM: its END tells the client
    ("Recorder.endless", []),
])
async def test_a_unary_call_of_a_streaming_method_fails_clearly(method: str,
                                                                 args: list[Any]) -> None:
    recorder = Recorder()
    server = tw.Server([recorder])
    (address,) = await server.start("tcp://127.0.0.1:0")
    try:
        async with tw.connect(address) as client:
            for _ in range(2):  # each time, not only the first
                with pytest.raises(Unimplemented, match="call it with stream"):
                    async with asyncio.timeout(5):  # it never waits for its deadline
                        await client.call(method, *args, timeout=60)
            # The same connection goes on.
            assert await client.call("Recorder.unary", 2) == 2
            assert [x async for x in client.stream("Recorder.count", 3)] == [0, 1, 2]
            assert len(server.transport_stats()) == 1
            if method == "Recorder.endless":
                # The server heard the call's end (CANCEL): its generator stopped.
                async with asyncio.timeout(5):
                    while recorder.seen.count("stopped") < 2:
                        await recorder.stopped.wait()
                        recorder.stopped.clear()
            assert client.metrics()[method]["errors"] == 2
    finally:
        await server.close(grace=0)


async def numbers(n: int) -> AsyncIterator[int]:
    for i in range(n):
        yield i


async def test_a_unary_call_with_a_streamed_argument_of_a_streaming_method_fails_clearly(
) -> None:
    recorder = Recorder()
    server = tw.Server([recorder])
    (address,) = await server.start("tcp://127.0.0.1:0")
    try:
        async with tw.connect(address) as client:
            for attempt in range(1, 3):  # each time, not only the first
                with pytest.raises(Unimplemented, match="call it with stream"):
                    async with asyncio.timeout(5):  # it never waits for its deadline
                        await client.call("Recorder.doubled", numbers(1000), timeout=60)
                # The server heard the call's end (CANCEL): its generator stopped.
                async with asyncio.timeout(5):
                    while recorder.seen.count("stopped") < attempt:
                        await recorder.stopped.wait()
                        recorder.stopped.clear()
            assert recorder.seen == ["doubling", "stopped"] * 2
            # The same connection goes on, both ways.
            assert [x async for x in client.stream("Recorder.doubled", numbers(3))] == [0, 2, 4]
            assert await client.call("Recorder.unary", 2) == 2
            assert len(server.transport_stats()) == 1
            assert client.metrics()["Recorder.doubled"]["errors"] == 2
    finally:
        await server.close(grace=0)


async def test_a_unary_method_is_asked_for_a_stream_once_per_connection() -> None:
    server = tw.Server([Recorder()])
    (address,) = await server.start("tcp://127.0.0.1:0")
    try:
        async with tw.connect(address) as client:

            async def messages_sent_by(coro: Any) -> int:
                before = client.transport_stats()[address]["messages_sent"]
                await coro
                await asyncio.sleep(0.05)  # what a call posts goes out in its loop turn
                return client.transport_stats()[address]["messages_sent"] - before

            # The first call also grants a CREDIT of 1, which the server drops.
            assert await messages_sent_by(client.call("Recorder.unary", 1)) == 2
            assert await messages_sent_by(client.call("Recorder.unary", 2)) == 1
            assert await messages_sent_by(client.call("Recorder.slow", 0.01)) == 2
            assert await messages_sent_by(client.call("Recorder.slow", 0.01)) == 1
            # So does a call with a streamed argument: REQUEST, two ITEMs, END.
            assert await messages_sent_by(client.call("Recorder.collect", numbers(2))) == 5
            assert await messages_sent_by(client.call("Recorder.collect", numbers(2))) == 4
    finally:
        await server.close(grace=0)
