"""The RPC connection driver's write path: batching, and messages queued behind a stuck write."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import numpy as np
import pytest

from tensorwire.errors import ConnectionClosedError, TensorwireError, Unavailable
from tensorwire.rpc import protocol
from tensorwire.rpc._connection_driver import BATCH, ConnectionDriver
from tensorwire.transports import Connection, TransportConfig, connect, listen

SMALL_BUFFERS = TransportConfig(socket_sndbuf=1 << 16, socket_rcvbuf=1 << 16)


async def _stuck_pair(peer: Any) -> tuple[Any, Connection]:
    listener = await listen("tcp://127.0.0.1:0", peer, config=SMALL_BUFFERS)
    conn = await connect(listener.address, config=SMALL_BUFFERS)
    return listener, conn


def _channel(conn: Connection, closed: list[TensorwireError]) -> ConnectionDriver:
    channel = ConnectionDriver(conn, lambda message, nbytes: None, closed.append,
                               heartbeat_timeout=60)
    channel.start()
    return channel


async def test_messages_of_one_loop_turn_go_out_in_batches_in_order(url: str) -> None:
    if url.startswith("inproc"):
        pytest.skip("an inproc:// send completes through the event loop, which then "
                    "decides the batches")
    received: list[int] = []
    arrived = asyncio.Event()

    async def reader(conn: Connection) -> None:
        with contextlib.suppress(ConnectionClosedError):
            while True:
                received.append(protocol.parse(await conn.recv()).call_id)
                if len(received) == 2 * BATCH + 7:
                    arrived.set()

    listener = await listen(url, reader)
    conn = await connect(listener.address)
    batches: list[int] = []
    send_nowait = conn.send_nowait

    def counted(messages: Any) -> Any:
        batches.append(len(messages))
        return send_nowait(messages)

    conn.send_nowait = counted  # type: ignore[method-assign]
    channel = _channel(conn, [])
    for call_id in range(2 * BATCH + 6):  # one turn: no await in between
        channel.post(protocol.Response(call_id, [b"value"]))
    # The rest waits for the end of the turn; where a batch costs what one
    # message does (a byte stream), the first message waits too.
    first = [] if conn.coalesces_sends else [1]
    assert batches == [*first, BATCH, BATCH]
    await asyncio.sleep(0)
    rest = [6] if conn.coalesces_sends else [5]
    assert batches == [*first, BATCH, BATCH, *rest]
    channel.post(protocol.Response(2 * BATCH + 6, [b"value"]))
    await asyncio.wait_for(arrived.wait(), 10)
    assert batches == [*first, BATCH, BATCH, *rest, 1]
    assert received == list(range(2 * BATCH + 7))
    await channel.close()
    await listener.close()


async def test_messages_queued_behind_a_stuck_write_all_arrive_in_order() -> None:
    release = asyncio.Event()
    received: list[int] = []

    async def slow_reader(conn: Connection) -> None:
        await release.wait()
        with contextlib.suppress(ConnectionClosedError):
            while True:
                received.append(protocol.parse(await conn.recv()).call_id)

    listener, conn = await _stuck_pair(slow_reader)
    closed: list[TensorwireError] = []
    channel = _channel(conn, closed)
    payload = [b"header", np.ones(4 << 20, np.uint8)]
    sends = [asyncio.create_task(channel.send(protocol.Item(i, payload))) for i in range(8)]
    done, _ = await asyncio.wait(sends, timeout=0.3)
    assert not done, "4 MiB messages cannot all fit in 64 KiB socket buffers"
    release.set()
    await asyncio.wait_for(asyncio.gather(*sends), 30)
    await channel.close()
    await listener.close()
    assert received == list(range(8))


async def test_queued_senders_fail_when_the_stuck_write_does() -> None:
    peer_conn: asyncio.Future[Connection] = asyncio.get_running_loop().create_future()

    async def never_reads(conn: Connection) -> None:
        peer_conn.set_result(conn)
        await asyncio.sleep(60)

    listener, conn = await _stuck_pair(never_reads)
    closed: list[TensorwireError] = []
    channel = _channel(conn, closed)
    payload = [b"header", np.ones(4 << 20, np.uint8)]
    sends = [asyncio.create_task(channel.send(protocol.Item(i, payload))) for i in range(8)]
    await asyncio.sleep(0.2)
    (await peer_conn).abort()
    results = await asyncio.wait_for(asyncio.gather(*sends, return_exceptions=True), 10)
    assert all(isinstance(r, Unavailable) for r in results), results
    assert closed
    await channel.close()
    await listener.close()


async def test_send_on_a_closed_channel_is_unavailable() -> None:
    async def echo(conn: Connection) -> None:
        with contextlib.suppress(ConnectionClosedError):
            while True:
                await conn.send(await conn.recv())

    listener = await listen("tcp://127.0.0.1:0", echo)
    channel = _channel(await connect(listener.address), [])
    await channel.close()
    with pytest.raises(Unavailable):
        await channel.send(protocol.Ping(0))
    await listener.close()
