"""An RPC server for the hostile-peer and load tests, in a process of its own.

    python -m tests.reliability._server [--gc-off] [--listen URL]
        # prints its address; serves until stdin closes

``--listen`` picks the address (``tcp://127.0.0.1:0`` unless given;
``ucx://127.0.0.1:0`` for ucx://).

Small limits and short timeouts, so that what a hostile peer can hold is
small and short-lived. ``--gc-off`` disables the cycle collector, so that
memory comes back by reference counting alone or not at all.
"""

from __future__ import annotations

import asyncio
import gc
import sys

from tensorwire import rpc
from tensorwire.transports import Limits, TransportConfig

from ..rpc.services import Store

CONFIG = rpc.ServerConfig(
    heartbeat_timeout=2.0,
    max_concurrent_per_connection=256,
    transport=TransportConfig(
        limits=Limits(max_frame_bytes=1 << 20, max_frames=64, max_message_bytes=4 << 20),
        handshake_timeout=1.0,
        max_unsent_bytes=16 << 20,
    ),
)


async def main() -> None:
    if "--gc-off" in sys.argv:
        gc.disable()
    args = sys.argv[1:]
    url = args[args.index("--listen") + 1] if "--listen" in args else "tcp://127.0.0.1:0"
    server = rpc.Server([Store()], config=CONFIG)
    (address,) = await server.start(url)
    print(address, flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)
    await server.close(grace=0)


if __name__ == "__main__":
    asyncio.run(main())
