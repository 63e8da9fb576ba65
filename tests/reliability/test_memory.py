"""Memory that must not outlive its connection.

Clients open a large message, send part of it and hang up. The server
process runs with the cycle collector off (``_server.py --gc-off``), so what
a closed connection held comes back by reference counting alone or never.
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

from .conftest import Server
from .test_hostile import HANDSHAKE, rpc_hello

#: The server's limits: frames of 1 MiB, messages of 4 MiB.
FRAMES = 4
FRAME = 1 << 20


def vm_size(server: Server) -> int:
    status = Path(f"/proc/{server.child.pid}/status").read_text()
    (line,) = [x for x in status.splitlines() if x.startswith("VmSize:")]
    return int(line.split()[1]) * 1024


def announce(server: Server, sent: int) -> socket.socket:
    """A connection that announced a message of FRAMES x FRAME bytes and
    sent ``sent`` bytes of it."""
    table = struct.pack(f"<{FRAMES}Q", *[FRAME] * FRAMES) + bytes(8)
    prelude = struct.pack("<BBHI", 0, 0, 0, FRAMES)
    sock = socket.create_connection(server.host_port, timeout=5)
    sock.sendall(HANDSHAKE + rpc_hello())
    assert sock.recv(65536)  # the server's handshake and WELCOME
    sock.sendall(prelude + table + bytes(sent))
    return sock


def abandon_a_message(server: Server, sent: int) -> None:
    """Announce a message, send ``sent`` bytes of it, hang up."""
    with announce(server, sent):
        # Until the server has read it all, then the hang-up.
        time.sleep(0.02)


def test_abandoned_partial_messages_leave_memory_flat(gc_off_server: Server) -> None:
    server = gc_off_server
    for _ in range(5):  # warm-up: pools and allocator arenas at their steady size
        abandon_a_message(server, 3 * FRAME)
    time.sleep(0.3)
    before = server.rss()
    for _ in range(80):
        abandon_a_message(server, 3 * FRAME)
    time.sleep(0.5)
    grew = server.rss() - before
    print(f"80 abandoned messages of 4 MiB (3 MiB sent), cycle collector off: server RSS "
          f"{grew / 2**20:+.1f} MiB")
    # 80 x 4 MiB would be 320 MiB.
    assert grew < 24 << 20, grew


def test_announced_sizes_reserve_no_address_space(gc_off_server: Server) -> None:
    server = gc_off_server
    abandon_a_message(server, 0)
    time.sleep(0.3)
    before = vm_size(server)
    socks = [announce(server, 0) for _ in range(50)]
    try:
        time.sleep(0.3)
        held = vm_size(server) - before
    finally:
        for sock in socks:
            sock.close()
    time.sleep(0.5)
    after = vm_size(server) - before
    print(f"50 messages of 4 MiB announced, no byte of them sent: server virtual memory "
          f"{held / 2**20:+.1f} MiB while they wait, {after / 2**20:+.1f} MiB after the drop")
    # Eagerly allocated, they would reserve 200 MiB.
    assert held < 24 << 20, held
    assert after < 24 << 20, after
