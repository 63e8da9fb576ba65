"""RPC behaviour that is about processes: a server killed, restarted; a
blocking client in a plain thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

import tensorwire as tw
from tensorwire.errors import FailedPrecondition, NotFound, Unavailable
from tensorwire.rpc import ClientConfig, SyncClient

from .services import Store

ROOT = Path(__file__).resolve().parents[2]
SERVER = """
import asyncio, sys
from tests.rpc.services import serve
asyncio.run(serve(sys.argv[1], lambda address: print(address, flush=True)))
"""


@contextlib.asynccontextmanager
async def server_process(url: str) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SERVER, url, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), 60)
        yield child, line.decode().strip()
    finally:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        await child.wait()


def kill(child: asyncio.subprocess.Process) -> None:
    os.kill(child.pid, signal.SIGKILL)


async def test_server_killed_mid_call_fails_the_call_quickly() -> None:
    async with server_process("tcp://127.0.0.1:0") as (child, address):
        client = await tw.connect(address)
        call = asyncio.create_task(client.call("Store.slow", 30))
        await asyncio.sleep(0.3)
        loop = asyncio.get_running_loop()
        kill(child)
        killed = loop.time()
        with pytest.raises(Unavailable):
            await call
        assert loop.time() - killed < 5
        await client.close()


async def test_client_reconnects_after_a_server_restart() -> None:
    config = ClientConfig(reconnect_attempts=40, reconnect_backoff=0.05,
                          reconnect_backoff_max=0.25)
    async with server_process("tcp://127.0.0.1:0") as (child, address):
        client = await tw.connect(address, config=config)
        await client.call("Store.put", "k", np.arange(3))
        kill(child)
        await child.wait()
        # The connection is gone; the next call fails or reconnects, never hangs.
        with pytest.raises(Unavailable):
            await client.call("Store.put", "k", 1)
        async with server_process(address) as (_, again):
            assert again == address
            # A fresh server: the old key is gone, the client is connected.
            with pytest.raises(NotFound):
                await client.call("Store.get", "k")
            await client.call("Store.put", "k", 2)
            assert await client.call("Store.get", "k") == 2
        await client.close()


async def test_idempotent_calls_are_retried_once_after_reconnect() -> None:
    config = ClientConfig(reconnect_attempts=80, reconnect_backoff=0.05,
                          reconnect_backoff_max=0.1)
    async with server_process("tcp://127.0.0.1:0") as (child, address):
        client = await tw.connect(address, config=config)
        retried = asyncio.create_task(client.call("Store.slow_idempotent", 0.5,
                                                  idempotent=True))
        not_retried = asyncio.create_task(client.call("Store.slow", 0.5))
        await asyncio.sleep(0.2)
        kill(child)
        await child.wait()
        async with server_process(address):
            assert await asyncio.wait_for(retried, 30) == "done"
            with pytest.raises(Unavailable):
                await not_retried
        await client.close()


async def test_proxy_retries_methods_declared_idempotent() -> None:
    config = ClientConfig(reconnect_attempts=80, reconnect_backoff=0.05,
                          reconnect_backoff_max=0.1)
    async with server_process("tcp://127.0.0.1:0") as (child, address):
        client = await tw.connect(address, config=config)
        call = asyncio.create_task(client.proxy(Store).slow_idempotent(0.5))
        await asyncio.sleep(0.2)
        kill(child)
        await child.wait()
        async with server_process(address):
            assert await asyncio.wait_for(call, 30) == "done"
        await client.close()


def test_sync_client_from_a_plain_thread() -> None:
    results: dict[str, object] = {}

    def training_loop(address: str) -> None:
        with SyncClient(address) as client:
            store = client.proxy(Store)
            store.put("w", np.ones((4, 4), np.float32))
            future = client.submit("Store.get", "w")   # overlaps what follows
            results["local"] = float(np.ones(4).sum())
            results["remote"] = float(future.result(timeout=30).sum())
            results["stream"] = list(store.count(5))
            try:
                store.get("missing")
            except NotFound as exc:
                results["error"] = exc.status.name

    async def main() -> None:
        server = tw.Server([Store()])
        (address,) = await server.start("tcp://127.0.0.1:0")
        thread = threading.Thread(target=training_loop, args=(address,))
        thread.start()
        await asyncio.get_running_loop().run_in_executor(None, thread.join, 60)
        await server.close()

    asyncio.run(main())
    assert results == {"local": 4.0, "remote": 16.0, "stream": [0, 1, 2, 3, 4],
                       "error": "NOT_FOUND"}


def test_sync_client_close_while_other_threads_submit_loses_no_future() -> None:
    futures: list[object] = []
    refused: list[BaseException] = []

    def hammer(client: SyncClient, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                futures.append(client.submit("Store.echo", 1))
            except FailedPrecondition as exc:  # closed: refused, not lost
                refused.append(exc)
                return

    async def main() -> None:
        server = tw.Server([Store()])
        (address,) = await server.start("tcp://127.0.0.1:0")
        client = await asyncio.to_thread(lambda: SyncClient(address).connect())
        stop = threading.Event()
        threads = [threading.Thread(target=hammer, args=(client, stop)) for _ in range(3)]
        for thread in threads:
            thread.start()
        await asyncio.sleep(0.2)
        await asyncio.to_thread(client.close)
        stop.set()
        for thread in threads:
            await asyncio.to_thread(thread.join, 10)
        await server.close()

    asyncio.run(main())
    assert futures
    for future in futures:
        assert isinstance(future, concurrent.futures.Future)
        assert future.done(), "a call submitted before close() never finished"
