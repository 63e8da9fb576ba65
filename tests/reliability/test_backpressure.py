"""A client that sends requests and never reads the replies.

Against the server process of ``_server.py`` (its unsent output is bounded
at 16 MiB a connection): the server stops reading that client while its
replies are backed up, so its memory stays within the bound; other clients
are served as usual, and the memory comes back once the client is gone.
"""

from __future__ import annotations

import socket
import time

from tensorwire import serde
from tensorwire.rpc import protocol

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
