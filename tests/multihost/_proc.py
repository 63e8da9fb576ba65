"""Processes the multi-host tests run inside the emulated hosts.

    python -m tests.multihost._proc rendezvous HOST WORLD   # prints its address
    python -m tests.multihost._proc ledger HOST             # prints its address
    python -m tests.multihost._proc caller ADDRESS SECONDS  # JSON lines, one per call

Servers run until their standard input closes.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from tensorwire import rpc
from tensorwire.collective import serve_rendezvous
from tensorwire.errors import TensorwireError

from ..collective._worker import QUICK_LIVENESS


class Ledger(rpc.Service):
    """Counts how often each key was appended: a duplicate shows as a 2."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    @rpc.method
    async def append(self, key: str) -> int:
        self.counts[key] = self.counts.get(key, 0) + 1
        return len(self.counts)

    @rpc.method(idempotent=True)
    async def tally(self) -> dict[str, int]:
        return self.counts


async def until_stdin_closes() -> None:
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)


async def rendezvous(host: str, world: int) -> None:
    server, address = await serve_rendezvous(f"tcp://{host}:0", world, config=QUICK_LIVENESS)
    print(address, flush=True)
    await until_stdin_closes()
    await server.close(grace=0)


async def ledger(host: str) -> None:
    server = rpc.Server([Ledger()], config=rpc.ServerConfig(heartbeat_timeout=3))
    (address,) = await server.start(f"tcp://{host}:0")
    print(address, flush=True)
    await until_stdin_closes()
    await server.close(grace=0)


async def caller(address: str, seconds: float) -> None:
    """Append unique keys for ``seconds`` (at most 2,000 calls), one at a time."""
    config = rpc.ClientConfig(timeout=1.0, heartbeat_interval=0.3, heartbeat_timeout=1.5,
                              reconnect_attempts=2, reconnect_backoff=0.05,
                              reconnect_backoff_max=0.2)
    client = rpc.Client(address, config=config)
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    index = 0
    while loop.time() < end and index < 2000:
        key = f"k{index}"
        started = time.time()
        try:
            await client.call("Ledger.append", key)
            outcome = "ok"
        except TensorwireError as exc:
            outcome = type(exc).__name__
        print(json.dumps({"key": key, "outcome": outcome, "at": started,
                          "took": time.time() - started}), flush=True)
        index += 1
        await asyncio.sleep(0.02)
    tally = await client.call("Ledger.tally", timeout=10)
    print(json.dumps({"tally": tally}), flush=True)
    await client.close()


def main() -> None:
    mode, *args = sys.argv[1:]
    if mode == "rendezvous":
        asyncio.run(rendezvous(args[0], int(args[1])))
    elif mode == "ledger":
        asyncio.run(ledger(args[0]))
    elif mode == "caller":
        asyncio.run(caller(args[0], float(args[1])))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
