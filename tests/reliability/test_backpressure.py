"""A client that sends requests and never reads the replies.

Against the server process of ``_server.py`` (its unsent output is bounded
at 16 MiB a connection): the server stops reading that client while its
replies are backed up, so its memory stays within the bound; other clients
are served as usual, and the memory comes back once the client is gone.
And the other way round: a fake server that never reads holds the client's
calls back.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Any

import numpy as np

import tensorwire as tw
from tensorwire import serde
from tensorwire.errors import DeadlineExceeded
from tensorwire.rpc import ClientConfig, protocol
from tensorwire.transports import TransportConfig

from ._server import CONFIG
from .conftest import Server
from .test_hostile import HANDSHAKE, good_client, message, rpc_hello

BOUND = CONFIG.transport.max_unsent_bytes
PAYLOAD = b"x" * 4096


def echo_requests(first_id: int, count: int) -> bytes:
    """``count`` pipelined requests to echo 4 KiB, as stream bytes."""
    header, buffers = serde.encode([[PAYLOAD], {}])
    out = []
    for call_id in range(first_id, first_id + count):
        frames = protocol.encode_request(call_id, "Store.echo", None, -1, [header, *buffers])
        out.append(message([bytes(memoryview(f).cast("B")) for f in frames]))
    return b"".join(out)


def test_a_client_that_never_reads_holds_at_most_the_bound(server: Server) -> None:
    before = server.rss()
    peak = before
    sent = 0
    with good_client(server.address) as failures:
        with socket.create_connection(server.host_port, timeout=5) as sock:
            sock.sendall(HANDSHAKE + rpc_hello())
            sock.settimeout(0.2)
            started = time.monotonic()
            next_id = 1
            while time.monotonic() - started < 3.0:
                chunk = echo_requests(next_id, 256)
                next_id += 256
                try:
                    sock.sendall(chunk)
                    sent += len(chunk)
                except TimeoutError:
                    pass  # the server stopped reading us: as it should
                peak = max(peak, server.rss())
            peak = max(peak, server.rss())
        # Gone: what the server held for it comes back.
        time.sleep(0.5)
        after = server.rss()
    grew = peak - before
    print(f"non-reading client: sent {sent / 2**20:.0f} MiB of requests in 3 s; server RSS "
          f"peak {grew / 2**20:+.1f} MiB (bound {BOUND >> 20} MiB), "
          f"{(after - before) / 2**20:+.1f} MiB after it left")
    assert failures == []
    # The bound, plus a reply being written and one read's worth of requests.
    assert grew < BOUND + (16 << 20), grew
    assert after - before < 16 << 20, after - before


async def test_a_server_that_never_reads_holds_the_clients_calls_back() -> None:
    """The fake server answers the handshake (allowing 10,000 calls in
    flight) and then reads nothing. The client's unsent output stops at its
    bound: calls beyond it wait, and fail at their deadline unsent."""
    stop = asyncio.Event()

    async def never_reads(conn: Any) -> None:
        await conn.recv()  # HELLO
        await conn.send(protocol.encode(protocol.Welcome(0, protocol.RPC_VERSION,
                                                         os.urandom(16), False, 10_000)))
        conn.pause_reading()
        await stop.wait()
        conn.abort()

    config = ClientConfig(timeout=1.0, reconnect_attempts=1, heartbeat_interval=5,
                          heartbeat_timeout=30,
                          transport=TransportConfig(max_unsent_bytes=4 << 20))
    blob = np.zeros(1 << 20, dtype=np.uint8)
    async with await tw.transports.listen("tcp://127.0.0.1:0", never_reads) as listener:
        client = tw.connect(listener.address, config=config)
        await client.connect()
        try:
            outcomes = await asyncio.gather(*(client.call("Store.echo", blob) for _ in range(100)),
                                            return_exceptions=True)
        finally:
            stop.set()
            await client.close()
    assert all(isinstance(o, DeadlineExceeded) for o in outcomes), outcomes
    unsent = [o for o in outcomes if "before the call was sent" in str(o)]
    # 100 MiB of calls; the bound is 4 MiB, the kernel's socket buffers take
    # a few more: most calls were never sent.
    print(f"server that never reads: {len(unsent)} of 100 calls of 1 MiB held back unsent")
    assert len(unsent) >= 50, len(unsent)
