"""tcp://'s spin window (``TransportConfig.tcp_spin``, ``_spin_gate.SpinGate``):
after a read that looks like a ping-pong (exactly one message), a plain
tcp:// connection keeps its event loop polling for the next message while
the window is open, instead of letting the process sleep; by default, but
not after a batch or part of a large message, not once the peer is quiet,
never over TLS, and never with ``tcp_spin=0``. What it buys is latency
between processes (bench/rpc.py); here, on real sockets in one process,
what it does and when it stops."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

import pytest

from tensorwire.errors import ConfigError
from tensorwire.transports import Connection, TransportConfig, connect, listen

from .test_conformance import as_bytes, echo
from .test_tcp import _tls_configs

SPIN = TransportConfig()
NO_SPIN = TransportConfig(tcp_spin=0)
QUIET = 0.05  # seconds: many times the window


@contextlib.asynccontextmanager
async def pair(
    server_config: TransportConfig | None = None,
    client_config: TransportConfig | None = None,
) -> AsyncIterator[tuple[Connection, Connection]]:
    """A client connection and the server's end of it, which echoes."""
    served: asyncio.Future[Connection] = asyncio.get_running_loop().create_future()

    async def handler(conn: Connection) -> None:
        served.set_result(conn)
        await echo(conn)

    listener = await listen("tcp://127.0.0.1:0", handler, config=server_config)
    try:
        client = await connect(listener.address, config=client_config)
        try:
            yield client, await asyncio.wait_for(served, 10)
        finally:
            await client.close()
    finally:
        await listener.close()


async def ping_pong(conn: Connection, rounds: int) -> None:
    for i in range(rounds):
        await conn.send([i.to_bytes(4, "little")])
        assert as_bytes((await conn.recv())[0]) == i.to_bytes(4, "little")


async def test_a_ping_pong_polls_on_both_ends_and_stops_when_the_peer_is_quiet() -> None:
    async with pair(SPIN, SPIN) as (client, server):
        for end in (client, server):
            assert end._spin_gate is not None
            assert end._spin_gate.window == 200e-6
        await asyncio.sleep(QUIET)
        before = client.spin_polls, server.spin_polls
        await ping_pong(client, 200)
        # Every answer reopened the window, and the loop polled on.
        assert client.spin_polls - before[0] >= 200
        assert server.spin_polls - before[1] >= 200
        await asyncio.sleep(QUIET)
        # The peer is quiet: the windows closed, nothing polls any more.
        assert not client._spinning and not server._spinning
        quiet = client.spin_polls, server.spin_polls
        failed = client._spin_gate.failed
        await asyncio.sleep(QUIET)
        assert (client.spin_polls, server.spin_polls) == quiet
        assert client._spin_gate.failed == failed


async def test_a_batch_is_not_followed_by_polling() -> None:
    async with pair(SPIN, SPIN) as (client, server):
        await ping_pong(client, 3)
        await asyncio.sleep(QUIET)
        polls = server.spin_polls
        # 20 messages in one write: the server takes them in one read.
        await client.send_many([[n.to_bytes(4, "little")] for n in range(20)])
        for n in range(20):
            assert as_bytes((await client.recv())[0]) == n.to_bytes(4, "little")
        assert not server._spin_wanted
        assert server.spin_polls == polls


async def test_part_of_a_large_message_is_not_followed_by_polling() -> None:
    """32 MiB arrive in many reads, none but the last completing a message:
    those reads poll nothing (the rest of a large message comes as the
    socket's window lets it, not sooner for polling)."""
    received: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()

    async def handler(conn: Connection) -> None:
        await echo_n(conn, 3)
        await asyncio.sleep(QUIET)  # the windows of the ping-pong close
        polls = conn.spin_polls
        message = await conn.recv()
        # The read that completed the message scheduled its poll after
        # handing the message out: only the partial reads could have polled.
        received.set_result((polls, conn.spin_polls))
        await conn.send(message)

    big = bytes(range(256)) * (128 * 1024)
    listener = await listen("tcp://127.0.0.1:0", handler, config=SPIN)
    try:
        client = await connect(listener.address, config=SPIN)
        try:
            await ping_pong(client, 3)
            await asyncio.sleep(QUIET)
            await client.send([big])
            before, after = await asyncio.wait_for(received, 10)
            assert as_bytes((await client.recv())[0]) == big
        finally:
            await client.close()
    finally:
        await listener.close()
    assert after == before


async def echo_n(conn: Connection, count: int) -> None:
    for _ in range(count):
        await conn.send(await conn.recv())


@pytest.mark.parametrize("which", ["server", "client"])
async def test_tcp_spin_zero_never_polls(which: str) -> None:
    assert TransportConfig().tcp_spin == 200e-6  # on by default
    configs = (NO_SPIN, SPIN) if which == "server" else (SPIN, NO_SPIN)
    async with pair(*configs) as (client, server):
        quiet_end = server if which == "server" else client
        await ping_pong(client, 50)
        assert quiet_end._spin_gate is None
        assert quiet_end.spin_polls == 0
        assert not quiet_end._spinning


async def test_tls_connections_do_not_poll() -> None:
    server_config, client_config = _tls_configs()
    server_config = dataclasses.replace(server_config, tcp_spin=200e-6)
    client_config = dataclasses.replace(client_config, tcp_spin=200e-6)
    async with pair(server_config, client_config) as (client, server):
        await ping_pong(client, 20)
        for end in (client, server):
            assert end._spin_gate is None and end.spin_polls == 0


@pytest.mark.parametrize("spin", [-1e-6, 1.5, float("nan"), "0.0002", None, True])
def test_tcp_spin_must_be_0_to_1_seconds(spin: object) -> None:
    with pytest.raises(ConfigError, match="tcp_spin must be 0 to 1 seconds"):
        TransportConfig(tcp_spin=spin)  # type: ignore[arg-type]
