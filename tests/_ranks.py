"""Ranks of a group as child processes around a rendezvous served by the test.

The test process serves the rendezvous on a port the kernel gave, starts one
child per rank, and collects what each printed and how it exited; children
still running at the timeout, or when the test fails, are killed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from tensorwire.collective import serve_rendezvous

#: Starts rank ``rank`` given the rendezvous address.
Spawn = Callable[[int, str], Awaitable[asyncio.subprocess.Process]]


async def run_ranks(world: int, spawn: Spawn, timeout: float
                    ) -> tuple[list[tuple[bytes, bytes]], list[int]]:
    """Each rank's ``(stdout, stderr)`` and exit code (-1: it was killed)."""
    server, master = await serve_rendezvous("tcp://127.0.0.1:0", world)
    children = []
    try:
        for rank in range(world):
            children.append(await spawn(rank, master))
        outputs = await asyncio.wait_for(
            asyncio.gather(*(child.communicate() for child in children)), timeout)
    finally:
        for child in children:
            if child.returncode is None:
                child.kill()
                await child.wait()
        await server.close(grace=0)
    codes = [child.returncode if child.returncode is not None else -1 for child in children]
    return [(out or b"", err or b"") for out, err in outputs], codes
