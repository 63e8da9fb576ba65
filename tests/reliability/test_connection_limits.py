"""Caps on a listener's connections: open ones, and ones not yet past the
handshake (slow-loris peers), refused beyond the cap with a clear log line,
over tcp:// and over ucx:// (whose peers come in through its tcp:// control
listener); and what slow-loris connections held comes back once they are
dropped."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import socket
import time

import pytest

import tensorwire as tw
from tensorwire.errors import TensorwireError
from tensorwire.rpc import ServerConfig
from tensorwire.transports import TransportConfig

from ..rpc.services import Store
from .conftest import Server
from .test_hostile import HANDSHAKE, rpc_hello

CONFIG = ServerConfig(transport=TransportConfig(
    handshake_timeout=1.0, max_pending_connections=8, max_connections=12))


async def _idle_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    loop = asyncio.get_running_loop()
    out = []
    for _ in range(count):
        sock = socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, port))
        out.append(sock)
    return out


async def _refused_at_once(sock: socket.socket) -> bool:
    """True when the server closed ``sock`` without its handshake."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(0.5):
            return await loop.sock_recv(sock, 8) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("scheme", [
    "tcp",
    pytest.param("ucx", marks=pytest.mark.skipif(
        importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed")),
])
async def test_connections_beyond_the_caps_are_refused_with_a_log_line(
        scheme: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    async with tw.Server([Store()], config=CONFIG) as server:
        (address,) = await server.start(f"{scheme}://127.0.0.1:0")
        host, port = address.split("://", 1)[1].rsplit(":", 1)
        # 20 peers that never send their handshake: 8 wait for it, 12 go at once.
        idle = await _idle_sockets(host, int(port), 20)
        try:
            refused = await asyncio.gather(*(_refused_at_once(s) for s in idle))
        finally:
            for sock in idle:
                sock.close()
        assert refused.count(False) == 8, refused
        assert any("max_pending_connections=8" in r.getMessage() for r in caplog.records)
        await asyncio.sleep(1.2)  # the 8 are past their handshake timeout
        # 12 clients fit; the 13th is refused, and fits once one has left.
        clients = [tw.connect(address, reconnect_attempts=1) for _ in range(12)]
        try:
            for client in clients:
                assert await client.call("Store.echo", 1) == 1
            with pytest.raises(TensorwireError):
                await tw.connect(address, reconnect_attempts=1, connect_timeout=2)
            assert any("max_connections=12" in r.getMessage() for r in caplog.records)
            await clients.pop().close()
            await asyncio.sleep(0.1)
            async with tw.connect(address, reconnect_attempts=1) as late:
                assert await late.call("Store.echo", 2) == 2
        finally:
            await asyncio.gather(*(c.close() for c in clients))


async def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """True when the server closes ``sock`` within ``seconds`` (whatever it
    sent before)."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(seconds):
            while await loop.sock_recv(sock, 1 << 16):
                pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed")
async def test_ucx_peers_stalled_in_the_ucx_hello_count_against_max_connections(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    # Past the control channel's transport handshake a ucx:// peer owes its
    # ucx:// hello (worker address, connection id): until then it is no
    # longer pending for the tcp:// listener, but still open.
    config = ServerConfig(transport=TransportConfig(
        handshake_timeout=1.0, max_pending_connections=8, max_connections=4))
    async with tw.Server([Store()], config=config) as server:
        (address,) = await server.start("ucx://127.0.0.1:0")
        host, port = address.removeprefix("ucx://").rsplit(":", 1)
        stalled = await _idle_sockets(host, int(port), 6)
        try:
            for sock in stalled:
                await asyncio.get_running_loop().sock_sendall(sock, HANDSHAKE)
            closed = await asyncio.gather(*(_closed_within(s, 0.5) for s in stalled))
            assert closed.count(False) == 4, closed  # held until the ucx:// hello's timeout
            with pytest.raises(TensorwireError):
                await tw.connect(address, reconnect_attempts=1, connect_timeout=2)
            assert any("max_connections=4" in r.getMessage() for r in caplog.records)
            assert all(await asyncio.gather(*(_closed_within(s, 2.0) for s in stalled)))
        finally:
            for sock in stalled:
                sock.close()
        await asyncio.sleep(0.1)
        async with tw.connect(address, reconnect_attempts=1) as client:
            assert await client.call("Store.echo", 3) == 3


def test_slow_loris_connections_leave_no_memory_behind(gc_off_server: Server) -> None:
    server = gc_off_server
    before = server.rss()
    socks = []
    try:
        for index in range(300):
            sock = socket.create_connection(server.host_port, timeout=5)
            # Half never finish the transport handshake, half the RPC hello.
            sock.sendall(b"T" if index % 2 else HANDSHAKE + rpc_hello()[:20])
            socks.append(sock)
        # The server's handshake timeout is 1 s, its hello timeout 2 s.
        time.sleep(3.0)
        after = server.rss()
    finally:
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.close()
    grew = after - before
    print(f"300 slow-loris connections dropped, cycle collector off: server RSS "
          f"{grew / 2**20:+.1f} MiB")
    assert grew < 16 << 20, grew
