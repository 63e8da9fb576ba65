"""ucx://-specific behaviour: UCX options, process state, dead peers, hostile bytes."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tensorwire.errors import ConfigError, ConnectionClosedError, LimitExceededError
from tensorwire.transports import (
    Connection,
    Limits,
    Listener,
    TransportConfig,
    UCXOptions,
    buffer_pool,
    connect,
    listen,
)
from tensorwire.transports._frames import default_allocator
from tensorwire.transports._stream_framing import HANDSHAKE

from .test_conformance import as_bytes, at_offset, echo, pattern
from .test_tcp import send_raw

# Not importorskip: importing ucxx here would set UCX_* variables in this
# process before ucx:// applies its options.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed"
)

ROOT = Path(__file__).resolve().parents[2]


@contextlib.asynccontextmanager
async def echo_server(config: TransportConfig | None = None) -> AsyncIterator[Listener]:
    listener = await listen("ucx://127.0.0.1:0", echo, config=config)
    try:
        yield listener
    finally:
        await listener.close()


def run_python(code: str, timeout: float = 60) -> str:
    """Run ``code`` in a fresh interpreter; its UCX logs go to stdout, so read it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_importing_transports_does_not_import_ucxx() -> None:
    out = run_python(
        """
        import sys
        import tensorwire.transports
        print("ucxx" in sys.modules, any(k.startswith("UCX_") for k in __import__("os").environ))
        """
    )
    assert out.split() == ["False", "False"]


def test_options_are_applied_before_ucx_starts() -> None:
    out = run_python(
        """
        import asyncio, os
        from tensorwire.transports import TransportConfig, UCXOptions, listen
        from tensorwire.transports import _ucx_runtime

        async def main():
            options = UCXOptions(
                tls=("tcp", "self"), rndv_scheme="get_zcopy",
                environment={"UCX_RNDV_THRESH": "65536"},
            )
            async def nothing(conn):
                pass
            listener = await listen(
                "ucx://127.0.0.1:0", nothing, config=TransportConfig(ucx=options)
            )
            config = _ucx_runtime.active_runtime().context.config
            print("RESULT", config["TLS"], config["RNDV_SCHEME"], config["RNDV_THRESH"],
                  os.environ["UCX_TLS"])
            await listener.close()
            print("RESULT", _ucx_runtime.active_runtime())

        asyncio.run(main())
        """
    )
    results = [line.split()[1:] for line in out.splitlines() if line.startswith("RESULT")]
    assert results[0] == ["tcp,self", "get_zcopy", "intra:64K,inter:64K", "tcp,self"]
    # The last listener took the UCX worker with it.
    assert results[1] == ["None"]


async def test_other_options_later_are_refused() -> None:
    async with echo_server() as listener:
        other = TransportConfig(ucx=UCXOptions(rndv_scheme="get_zcopy"))
        with pytest.raises(ConfigError, match="once per process"):
            await connect(listener.address, config=other)
        with pytest.raises(ConfigError, match="once per process"):
            await listen("ucx://127.0.0.1:0", echo, config=other)
        # The listener is unharmed.
        async with await connect(listener.address) as conn:
            await conn.send([b"fine"])
            assert as_bytes((await conn.recv())[0]) == b"fine"


@pytest.mark.parametrize("mode", ["thread", "thread-polling"])
def test_thread_progress_modes_are_refused_at_construction(mode: str) -> None:
    # Refused when the options are built, not on first use: no UCX needed.
    with pytest.raises(ConfigError, match="progress modes, not"):
        UCXOptions(progress_mode=mode)  # type: ignore[arg-type]


def test_unknown_progress_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown UCX progress mode"):
        UCXOptions(progress_mode="spinning")  # type: ignore[arg-type]


async def test_polling_progress_mode_works() -> None:
    from tensorwire.transports import _ucx_runtime

    if _ucx_runtime.active_runtime() is not None:
        pytest.skip("another ucx:// test left the runtime running")
    config = TransportConfig(ucx=UCXOptions(progress_mode="polling"))
    async with (
        echo_server(config) as listener,
        await connect(listener.address, config=config) as conn,
    ):
        data = pattern(1 << 20)
        await conn.send([b"x", data])
        head, body = await conn.recv()
        assert as_bytes(head) == b"x"
        assert np.array_equal(body, data)


async def test_spin_free_blocking_mode_works_and_is_fixed_while_in_use() -> None:
    from tensorwire.transports import _ucx_runtime

    if _ucx_runtime.active_runtime() is not None:
        pytest.skip("another ucx:// test left the runtime running")
    config = TransportConfig(ucx=UCXOptions(spin=0))
    async with (
        echo_server(config) as listener,
        await connect(listener.address, config=config) as conn,
    ):
        for size in (8, 1 << 20):
            data = pattern(size)
            await conn.send([data])
            (body,) = await conn.recv()
            assert np.array_equal(body, data)
        with pytest.raises(ConfigError, match="spin"):
            await connect(listener.address)  # the default spin differs


@pytest.mark.parametrize("spin", [-1, 2, "fast", True, float("nan")])
def test_spin_is_validated(spin: object) -> None:
    with pytest.raises(ConfigError, match="spin"):
        UCXOptions(spin=spin)  # type: ignore[arg-type]


async def test_runtime_is_gone_after_the_last_connection() -> None:
    from tensorwire.transports import _ucx_runtime

    async with echo_server() as listener:
        conn = await connect(listener.address)
        await conn.send([b"x"])
        await conn.recv()
        assert _ucx_runtime.active_runtime() is not None
        await conn.close()
    assert _ucx_runtime.active_runtime() is None


def _ucx_workers() -> list[object]:
    return [o for o in gc.get_objects() if type(o).__name__ == "UCXWorker"]


async def test_the_worker_is_destroyed_with_the_runtime_not_by_a_later_collection() -> None:
    # Left to the garbage collector, the worker would be torn down whenever
    # a collection ran: in the middle of starting the next worker, say.
    from tensorwire.transports import _ucx_runtime

    if _ucx_runtime.active_runtime() is not None:
        pytest.skip("another ucx:// test left the runtime running")
    gc.collect()
    gc.disable()
    try:
        async with echo_server() as listener:
            conn = await connect(listener.address)
            await conn.send([b"x"])
            await conn.recv()
            assert len(_ucx_workers()) == 1
            await conn.close()
        assert _ucx_runtime.active_runtime() is None
        assert _ucx_workers() == []
    finally:
        gc.enable()


class _UnfinishedRequest:
    """A UCX request that never completes, as a matched receive of a large
    message does while its sender is stopped: UCX cannot cancel it, and the
    sender may still write into its buffer (CMA, RDMA) whenever it resumes."""

    completed = False


async def test_buffers_of_transfers_unfinished_when_the_worker_stops_are_never_freed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tensorwire.transports import _ucx_runtime

    if _ucx_runtime.active_runtime() is not None:
        pytest.skip("another ucx:// test left the runtime running")
    runtime = _ucx_runtime.acquire(UCXOptions())
    buffer = buffer_pool().empty(2 << 20)
    where, marker = buffer.ctypes.data, id(buffer)
    completions: list[Any] = []
    runtime.watch(_UnfinishedRequest(), buffer, completions.append)
    del buffer
    try:
        with caplog.at_level(logging.WARNING, logger=_ucx_runtime.__name__):
            runtime.release()
        assert not runtime.alive
        assert completions == [None]
        assert "1 transfer(s) unfinished" in caplog.text
        assert id(_ucx_runtime._abandoned[-1]) == marker
        other = buffer_pool().empty(2 << 20)
        assert other.ctypes.data != where
    finally:
        # Nothing can write into this one (no UCX request has it): let it go.
        _ucx_runtime._abandoned[:] = [
            keep for keep in _ucx_runtime._abandoned if id(keep) != marker
        ]


async def test_addresses_are_ucx_urls() -> None:
    async with echo_server() as listener, await connect(listener.address) as conn:
        assert listener.address.startswith("ucx://127.0.0.1:")
        assert conn.peer_address == listener.address
        assert conn.local_address.startswith("ucx://127.0.0.1:")
        assert conn.scheme == "ucx"


async def test_large_frames_land_in_allocator_memory_and_small_ones_too() -> None:
    buffers: list[np.ndarray[Any, np.dtype[np.uint8]]] = []

    def allocator(info: Any) -> np.ndarray[Any, np.dtype[np.uint8]]:
        buffers.append(np.empty(info.nbytes, np.uint8))
        return buffers[-1]

    sent = [pattern(8 << 20, 1), pattern(100, 2), pattern(5000, 3), b"", pattern(3000, 4)]
    async with echo_server() as listener, await connect(listener.address) as conn:
        await conn.send(sent)
        frames = await conn.recv(allocator=allocator)
    assert all(f is b for f, b in zip(frames, buffers, strict=True))
    assert [as_bytes(f) for f in frames] == [as_bytes(s) for s in sent]


async def test_a_large_frame_lands_where_the_senders_lay_past_a_64_byte_boundary() -> None:
    # The receiving buffers (the echo server's and ours) come from the
    # buffer pool at the sender's offset: the shared-memory copy between
    # two buffers whose low address bits differ is the slow one.
    infos: list[Any] = []

    def recording(info: Any) -> Any:
        infos.append(info)
        return default_allocator(info)

    sent = at_offset(pattern(8 << 20, 5), 48)
    hits = buffer_pool().stats().hits + buffer_pool().stats().misses
    async with echo_server() as listener, await connect(listener.address) as conn:
        await conn.send([sent, at_offset(pattern(3 << 20, 6), 0)])
        frames = await conn.recv(allocator=recording)
    assert [(i.nbytes, i.offset) for i in infos] == [(8 << 20, 48), (3 << 20, 0)]
    assert [f.ctypes.data % 64 for f in frames] == [48, 0]
    assert np.array_equal(frames[0], sent)
    # Both ends took their buffers from the pool.
    assert buffer_pool().stats().hits + buffer_pool().stats().misses >= hits + 4


async def test_cancelled_recv_loses_no_message() -> None:
    async with echo_server() as listener, await connect(listener.address) as conn:
        pending = asyncio.create_task(conn.recv())
        await asyncio.sleep(0)
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending

        async def sender() -> None:
            # Sent from a task: a large UCX frame is sent by rendezvous, so
            # the echo's reply send completes only once we receive it.
            for i in range(5):
                await conn.send([f"m{i}".encode(), pattern(200_000, i)])

        sending = asyncio.create_task(sender())
        for i in range(5):
            head, body = await asyncio.wait_for(conn.recv(), 10)
            assert as_bytes(head) == f"m{i}".encode()
            assert as_bytes(body) == pattern(200_000, i).tobytes()
        await sending


async def test_frame_table_beyond_the_header_buffer_is_refused() -> None:
    refused: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

    async def guarded(conn: Connection) -> None:
        try:
            await conn.recv()
        except LimitExceededError as exc:
            refused.set_result(exc)

    config = TransportConfig(limits=Limits(max_frames=8))
    async with contextlib.AsyncExitStack() as stack:
        listener = await listen("ucx://127.0.0.1:0", guarded, config=config)
        stack.push_async_callback(listener.close)
        conn = await connect(listener.address)
        stack.callback(conn.abort)
        # 5000 frames: the frame table alone is larger than what a peer
        # limited to 8 frames posts for a header.
        await conn.send([b"x"] * 5000)
        error = await asyncio.wait_for(refused, 10)
        assert "8 frames" in str(error)
        with pytest.raises(ConnectionClosedError):
            await asyncio.wait_for(conn.recv(), 10)


@pytest.mark.parametrize(
    "payload",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"\0" * 64,
        # A tensorwire peer that sends a message instead of the UCX hello.
        HANDSHAKE
        + bytes([0, 0, 0, 0])
        + (1).to_bytes(4, "little")
        + (3).to_bytes(8, "little")
        + b"\0" * 8
        + b"abc",
    ],
    ids=["http", "zeros", "bad-hello"],
)
async def test_garbage_on_the_control_port_is_dropped(
    payload: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    async with echo_server() as listener:
        await send_raw(listener.address, payload)
        async with await connect(listener.address) as conn:
            await conn.send([b"still serving"])
            assert as_bytes((await conn.recv())[0]) == b"still serving"


async def test_idle_connection_with_receives_posted_uses_no_cpu() -> None:
    async def park(conn: Connection) -> None:
        with contextlib.suppress(ConnectionClosedError):
            await conn.recv()

    async with contextlib.AsyncExitStack() as stack:
        listener = await listen("ucx://127.0.0.1:0", park)
        stack.push_async_callback(listener.close)
        conn = await connect(listener.address)
        stack.push_async_callback(conn.close)
        waiting = asyncio.create_task(conn.recv())
        await asyncio.sleep(0.2)  # let both sides post their receives
        cpu, wall = time.process_time(), time.monotonic()
        await asyncio.sleep(2.0)  # the measurement itself: the process idles
        share = (time.process_time() - cpu) / (time.monotonic() - wall)
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
    assert share < 0.05, f"idle ucx:// connections used {share:.0%} of a core"


_SERVER = """
import asyncio, sys
from tensorwire.transports import listen

async def main():
    async def handler(conn):
        await conn.send([b"hello"])
        await asyncio.sleep(120)
    listener = await listen("ucx://127.0.0.1:0", handler)
    with open(sys.argv[1], "w") as f:
        f.write(listener.address)
    await asyncio.sleep(120)

asyncio.run(main())
"""


async def test_killed_server_process_fails_our_recv_within_seconds(tmp_path: Path) -> None:
    address_file = tmp_path / "address"
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _SERVER,
        str(address_file),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 60
        while not address_file.exists() or not address_file.read_text():
            assert time.monotonic() < deadline, "server did not start"
            assert child.returncode is None, "server died"
            await asyncio.sleep(0.05)
        conn = await connect(address_file.read_text())
        assert as_bytes((await asyncio.wait_for(conn.recv(), 30))[0]) == b"hello"
        pending = asyncio.create_task(conn.recv())
        await asyncio.sleep(0.1)
        os.kill(child.pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(ConnectionClosedError):
            await asyncio.wait_for(pending, 10)
        assert time.monotonic() - killed < 5
        with pytest.raises(ConnectionClosedError):
            await conn.send([b"anyone?"])
        await conn.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        await child.wait()
