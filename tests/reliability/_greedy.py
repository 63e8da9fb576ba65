"""A greedy client, in a process of its own: it pipelines small calls to
``Store.echo`` as fast as the server takes them and reads every reply.

    python -m tests.reliability._greedy URL SECONDS   # prints the replies' bytes

Written as an attacker would, with no regard for the server's limit of calls
in flight (the handler returns without awaiting, so none is ever in flight
for long): over tcp:// a raw socket with requests encoded ahead; over ucx://,
where there is no byte stream to write into, a transport connection (on
uvloop) that sends RPC messages encoded ahead, thousands in flight, and
takes the replies by callback, without the RPC client.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time
from typing import Any

import uvloop

from tensorwire import serde, transports
from tensorwire.rpc import protocol

from .test_hostile import HANDSHAKE, message, rpc_hello

#: Calls the ucx:// client keeps in flight, sent 512 at a time: enough that a
#: server reading them all in one callback starves the others (without the
#: read budget the good client's p99 was 627 ms here, a new client 1.8 s).
UCX_IN_FLIGHT = 32768
UCX_BATCH = 512


def request_frames(first_id: int, count: int) -> list[list[Any]]:
    header, _ = serde.encode([[7], {}])
    return [protocol.encode_request(call_id, "Store.echo", None, -1, [header])
            for call_id in range(first_id, first_id + count)]


def greedy_tcp(host: str, port: int, seconds: float) -> int:
    received = 0

    def drain(sock: socket.socket) -> None:
        nonlocal received
        while chunk := sock.recv(1 << 20):
            received += len(chunk)

    with socket.create_connection((host, port)) as sock:
        sock.sendall(HANDSHAKE + rpc_hello())
        reader = threading.Thread(target=drain, args=(sock,), daemon=True)
        reader.start()
        # Call ids are reused chunk after chunk: every call has ended long
        # before its id comes round again.
        chunk = b"".join(message([frames[0]]) for frames in request_frames(1, 4096))
        stop = time.monotonic() + seconds
        while time.monotonic() < stop:
            sock.sendall(chunk)
        sock.shutdown(socket.SHUT_WR)
        reader.join(10)
    return received


async def greedy_ucx(url: str, seconds: float) -> int:
    received = replies = 0
    progress = asyncio.Event()

    def on_reply(frames: list[Any]) -> None:
        # Replies by callback on the loop (deliver_to), not a recv() and a
        # task wake-up each: the fastest reader this transport offers, so
        # the attacker is held back by the server, not by its own reading.
        nonlocal received, replies
        received += sum(memoryview(f).nbytes for f in frames)
        replies += 1
        progress.set()

    # Twice as many call ids as are ever in flight: an id comes round again
    # only after its call has been answered.
    batches = [request_frames(first, UCX_BATCH)
               for first in range(1, 2 * UCX_IN_FLIGHT + 1, UCX_BATCH)]
    conn = await transports.connect(url)
    try:
        if not conn.deliver_to(on_reply):
            raise RuntimeError("ucx:// connections deliver by callback")
        await conn.send(protocol.encode(protocol.ClientHandshake(secret=None).start()))
        sent = 0
        stop = time.monotonic() + seconds
        while time.monotonic() < stop:
            while sent - replies >= UCX_IN_FLIGHT and time.monotonic() < stop:
                progress.clear()
                await asyncio.wait_for(progress.wait(), 10)
            await conn.send_many(batches[(sent // UCX_BATCH) % len(batches)])
            sent += UCX_BATCH
        # Every reply read (the WELCOME and one a call), then hang up.
        async with asyncio.timeout(10):
            while replies < sent + 1:
                progress.clear()
                await progress.wait()
    finally:
        await conn.close()
    return received


def main(url: str, seconds: float) -> None:
    scheme, address = url.split("://", 1)
    if scheme == "ucx":
        received = uvloop.run(greedy_ucx(url, seconds))
    else:
        host, port = address.rsplit(":", 1)
        received = greedy_tcp(host, int(port), seconds)
    print(received, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
