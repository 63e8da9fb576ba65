"""A ucx:// echo server in a process of its own, for tests whose point
needs a peer that is not this process's UCX worker (wake-ups, CPU sharing)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_ECHO_SERVER = """
import asyncio, contextlib, os, sys
from tensorwire.errors import ConnectionClosedError
from tensorwire.transports import listen

if len(sys.argv) > 2:
    os.sched_setaffinity(0, {int(sys.argv[2])})

async def main():
    async def echo(conn):
        with contextlib.suppress(ConnectionClosedError):
            while True:
                await conn.send(await conn.recv())
    listener = await listen("ucx://127.0.0.1:0", echo)
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(listener.address)
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    await asyncio.sleep(60)

asyncio.run(main())
"""


@contextlib.asynccontextmanager
async def ucx_echo_process(tmp_path: Path, cpu: int | None = None) -> AsyncIterator[str]:
    """Start the echo server (pinned to ``cpu`` if given); yield its address."""
    address_file = tmp_path / "address"
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    pin = [] if cpu is None else [str(cpu)]
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", textwrap.dedent(_ECHO_SERVER), str(address_file), *pin,
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not address_file.exists():
            assert time.monotonic() < deadline, "server did not start"
            assert child.returncode is None, "server died"
            await asyncio.sleep(0.05)
        yield address_file.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        await child.wait()
