"""A greedy client, in a process of its own: it pipelines small calls to
``Store.echo`` as fast as the socket takes them and reads every reply.

    python -m tests.reliability._greedy HOST PORT SECONDS   # prints the replies' bytes

Written as an attacker would: a raw socket, requests encoded ahead, no
regard for the server's limit of calls in flight (the handler returns
without awaiting, so none is ever in flight for long).
"""

from __future__ import annotations

import socket
import sys
import threading
import time

from tensorwire import serde
from tensorwire.rpc import protocol

from .test_hostile import HANDSHAKE, message, rpc_hello


def requests(first_id: int, count: int) -> bytes:
    header, _ = serde.encode([[7], {}])
    return b"".join(
        message([protocol.encode_request(call_id, "Store.echo", None, -1, [header])[0]])
        for call_id in range(first_id, first_id + count))


def main(host: str, port: int, seconds: float) -> None:
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
        chunk = requests(1, 4096)
        stop = time.monotonic() + seconds
        while time.monotonic() < stop:
            sock.sendall(chunk)
        sock.shutdown(socket.SHUT_WR)
        reader.join(10)
    print(received, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
