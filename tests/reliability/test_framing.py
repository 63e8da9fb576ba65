"""Framing attacks on a live server, from a raw socket: a huge frame
announced before the RPC hello, and a request with the reserved call id 0."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time

import pytest

import tensorwire as tw
from tensorwire.rpc import ServerConfig
from tensorwire.rpc import protocol as p
from tensorwire.transports import Limits, TransportConfig

from ..rpc.services import Store
from .test_hostile import HANDSHAKE, message, rpc_hello

CONFIG = ServerConfig(
    heartbeat_timeout=3.0,
    transport=TransportConfig(limits=Limits(max_frame_bytes=1 << 20, max_message_bytes=4 << 20),
                              handshake_timeout=3.0),
)
#: A DATA message announcing one frame of 2**40 bytes (and sending none of it).
HUGE = struct.pack("<BBHIQ", 0, 0, 0, 1, 1 << 40) + bytes(8)


async def _closed_after(sock: socket.socket, limit: float) -> float:
    """Seconds until the server closes ``sock`` (reading and dropping what it sends)."""
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    async with asyncio.timeout(limit):
        while await loop.sock_recv(sock, 65536):
            pass
    return time.monotonic() - started


async def test_a_huge_frame_before_the_hello_is_dropped_at_once_every_time(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    loop = asyncio.get_running_loop()
    server = tw.Server([Store()], config=CONFIG)
    (address,) = await server.start("tcp://127.0.0.1:0")
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    took = []
    try:
        for attempt in range(6):
            with socket.socket() as sock:
                sock.setblocking(False)
                await loop.sock_connect(sock, (host, int(port)))
                if attempt % 2:
                    # After the transport handshake, once the server waits for the hello.
                    await loop.sock_sendall(sock, HANDSHAKE)
                    assert await loop.sock_recv(sock, 8) == HANDSHAKE
                    await asyncio.sleep(0.05)
                    await loop.sock_sendall(sock, HUGE)
                else:
                    await loop.sock_sendall(sock, HANDSHAKE + HUGE)
                took.append(await _closed_after(sock, 5.0))
    finally:
        await server.close()
    print(f"2**40-byte frame before the hello: 6 of 6 connections dropped within "
          f"{max(took) * 1e3:.1f} ms")
    # The hello timeout here is 3 s; "at once" is well under it.
    assert max(took) < 1.0, took
    reasons = [r.getMessage() for r in caplog.records if "1099511627776" in r.getMessage()]
    assert len(reasons) == 6, [r.getMessage() for r in caplog.records]
    assert all("exceeds the limit" in reason for reason in reasons), reasons


async def test_a_request_with_call_id_0_is_a_protocol_error(
        caplog: pytest.LogCaptureFixture) -> None:
    store = Store()
    loop = asyncio.get_running_loop()
    async with tw.Server([store], config=CONFIG) as server:
        (address,) = await server.start("tcp://127.0.0.1:0")
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        request = p.encode_request(0, "Store.put", 5.0, -1, [tw.serde.encode([["k", 1], {}])[0]])
        with socket.socket() as sock:
            sock.setblocking(False)
            await loop.sock_connect(sock, (host, int(port)))
            await loop.sock_sendall(sock, HANDSHAKE + rpc_hello())
            await loop.sock_sendall(sock, message([bytes(request[0])]))
            received = b""
            async with asyncio.timeout(5):
                while chunk := await loop.sock_recv(sock, 65536):
                    received += chunk
    # The handshake's 8 bytes and the WELCOME, then the server hung up: no
    # RESPONSE or ERROR for call 0, and the handler never ran.
    assert received.startswith(HANDSHAKE)
    assert len(received) < 100, received
    assert store.calls == 0
    assert any("call id 0" in r.getMessage() for r in caplog.records)
