"""Hostile peers against a real RPC server process on loopback.

A fuzzer throws random and mutated bytes, frames and RPC messages at the
server for a bounded number of examples while a well-formed client keeps
calling it; a slow-loris peer trickles its handshake. The server must stay
up, answer the good client throughout, and not grow beyond its limits.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorwire import serde
from tensorwire.errors import TensorwireError
from tensorwire.rpc import ClientConfig, SyncClient, protocol

from .conftest import Server

HANDSHAKE = b"TWIR\x01\x00\x00\x00"


def message(frames: list[bytes]) -> bytes:
    """One DATA message on the tcp:// byte stream (docs/protocol.md)."""
    n = len(frames)
    table = struct.pack(f"<{n}Q", *(len(f) for f in frames)) + bytes(n)
    table += bytes(-len(table) % 8)
    return struct.pack("<BBHI", 0, 0, 0, n) + table + b"".join(frames)


def rpc_hello() -> bytes:
    hello = protocol.encode(protocol.ClientHandshake(secret=None).start())
    return message([bytes(f) for f in hello])


def a_request() -> list[bytes]:
    header, buffers = serde.encode([["k", np.arange(4)], {}])
    request = protocol.Request(1, "Store.put", 5.0, -1, [header, *buffers])
    return [bytes(memoryview(f).cast("B")) for f in protocol.encode(request)]


def mutate(frames: list[bytes], flips: list[tuple[int, int, int]]) -> list[bytes]:
    out = [bytearray(f) for f in frames]
    for which, where, value in flips:
        frame = out[which % len(out)]
        if frame:
            frame[where % len(frame)] = value
    return [bytes(f) for f in out]


payloads = st.one_of(
    st.binary(max_size=600),
    st.binary(max_size=600).map(lambda b: HANDSHAKE + b),
    st.lists(st.binary(max_size=300), max_size=8).map(lambda fs: HANDSHAKE + message(fs)),
    st.lists(st.binary(max_size=200), max_size=6).map(
        lambda fs: HANDSHAKE + rpc_hello() + message(fs)),
    st.lists(st.tuples(st.integers(0, 7), st.integers(0, 1 << 16), st.integers(0, 255)),
             min_size=1, max_size=6).map(
        lambda flips: HANDSHAKE + rpc_hello() + message(mutate(a_request(), flips))),
    # Sizes far beyond the limits: refused before anything is allocated.
    st.integers(1 << 21, 1 << 62).map(
        lambda size: HANDSHAKE + struct.pack("<BBHIQB", 0, 0, 0, 1, size, 0) + bytes(7)),
)


def throw(address: tuple[str, int], payload: bytes) -> None:
    """Send ``payload`` on a fresh connection and read what comes back, briefly."""
    with socket.create_connection(address, timeout=2) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(payload)
        sock.settimeout(0.05)
        with contextlib.suppress(OSError):
            while sock.recv(65536):
                pass


@contextlib.contextmanager
def good_client(address: str) -> Iterator[list[str]]:
    """A well-formed client calling all along; yields the list of its failures."""
    failures: list[str] = []
    stop = threading.Event()
    config = ClientConfig(timeout=10, heartbeat_interval=0.5, heartbeat_timeout=5)

    def run() -> None:
        with SyncClient(address, config=config) as client:
            index = 0
            while not stop.is_set() and index < 100_000:
                try:
                    client.call("Store.put", f"good{index % 10}", np.full(8, index))
                    got = client.call("Store.get", f"good{index % 10}")
                    if not np.array_equal(got, np.full(8, index)):
                        failures.append(f"wrong value at {index}")
                except TensorwireError as exc:
                    failures.append(repr(exc))
                index += 1
                time.sleep(0.01)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield failures
    finally:
        stop.set()
        thread.join(30)


@pytest.mark.slow
def test_fuzzed_input_never_takes_the_server_down(server: Server) -> None:
    before = server.rss()

    @settings(max_examples=300, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(payload=payloads)
    def fuzz(payload: bytes) -> None:
        throw(server.host_port, payload)
        assert server.child.poll() is None, "the server died"

    with good_client(server.address) as failures:
        fuzz()
    assert failures == []
    # The limits (4 MiB a message) bound what hostile peers make it hold.
    grew = server.rss() - before
    assert grew < 64 << 20, (before, server.rss())
    print(f"fuzz: 300 hostile connections, the good client never failed, server RSS "
          f"{grew / 2**20:+.1f} MiB")


def test_a_slow_loris_is_dropped_after_the_handshake_timeout(server: Server) -> None:
    with socket.create_connection(server.host_port, timeout=5) as sock:
        started = time.monotonic()
        closed_after = None
        for byte in HANDSHAKE[:-1]:  # never the last byte
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed_after = time.monotonic() - started
                break
            time.sleep(0.3)
        if closed_after is None:
            sock.settimeout(5)
            with contextlib.suppress(OSError):
                while sock.recv(100):
                    pass
            closed_after = time.monotonic() - started
    # handshake_timeout is 1 s; the trickle would have taken 2.1 s and more.
    assert closed_after < 3.0
    print(f"slow handshake dropped after {closed_after:.2f} s")


def test_a_half_sent_rpc_handshake_is_dropped(server: Server) -> None:
    hello = HANDSHAKE + rpc_hello()
    with socket.create_connection(server.host_port, timeout=10) as sock:
        started = time.monotonic()
        for index, byte in enumerate(hello[:-1]):
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            if index >= len(HANDSHAKE):
                time.sleep(0.2)
        sock.settimeout(10)
        with contextlib.suppress(OSError):
            while sock.recv(100):
                pass
        elapsed = time.monotonic() - started
    # The server's heartbeat timeout (2 s) bounds the RPC handshake.
    assert elapsed < 6.0, elapsed


def test_a_message_trickled_after_the_handshake_is_dropped(server: Server) -> None:
    """A peer that completes the handshakes, then sends a message's prelude
    a byte at a time: bytes keep coming, but no message does."""
    trickle = message([b"x" * 100])
    with socket.create_connection(server.host_port, timeout=10) as sock:
        sock.sendall(HANDSHAKE + rpc_hello())
        sock.settimeout(5)
        assert sock.recv(65536), "the server should answer the handshake"
        started = time.monotonic()
        dropped = False
        for byte in trickle[:40]:
            try:
                sock.sendall(bytes([byte]))
                sock.settimeout(0.25)
                if sock.recv(100) == b"":
                    dropped = True
                    break
            except TimeoutError:
                continue
            except OSError:
                dropped = True
                break
        elapsed = time.monotonic() - started
    assert dropped, f"still connected after trickling for {elapsed:.1f} s"
    assert elapsed < 8.0, elapsed
    print(f"trickled message dropped after {elapsed:.2f} s")
