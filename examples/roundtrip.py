"""Round-trip a tensor through tensorwire: encode, send over a transport, decode.

    python examples/roundtrip.py                      # tcp:// on loopback
    python examples/roundtrip.py --url ucx://127.0.0.1:0
    python examples/roundtrip.py --url inproc://demo

A server echoes every message back; the client sends a dict holding a 64 MiB
float32 tensor and checks that what comes back is equal, decoded as a view
of the received buffer (no copy after the socket).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

from tensorwire import serde
from tensorwire.errors import ConnectionClosedError
from tensorwire.transports import Connection, connect, listen


async def echo(conn: Connection) -> None:
    try:
        while True:
            await conn.send(await conn.recv())
    except ConnectionClosedError:
        pass


async def main(url: str, megabytes: int) -> None:
    weights = np.random.default_rng(0).standard_normal(megabytes << 18, dtype=np.float32)
    value = {"step": 1234, "name": "layer3.weight", "tensor": weights.reshape(-1, 1024)}

    async with await listen(url, echo) as listener, await connect(listener.address) as conn:
        start = time.perf_counter()
        header, buffers = serde.encode(value)
        await conn.send([header, *buffers])
        frames = await conn.recv()
        back = serde.decode(frames[0], frames[1:])
        elapsed = time.perf_counter() - start

    tensor = back["tensor"]
    assert back["step"] == 1234 and back["name"] == "layer3.weight"
    assert np.array_equal(tensor, value["tensor"])
    same_memory = np.shares_memory(tensor, frames[1])
    print(f"address   {listener.address}")
    print(f"header    {len(header)} bytes, {len(buffers)} out-of-band buffer(s)")
    print(f"tensor    {tensor.shape} {tensor.dtype}, equal after the round trip")
    print(f"zero-copy decoded tensor views the received frame: {same_memory}")
    print(f"time      {elapsed * 1e3:.1f} ms for {2 * weights.nbytes >> 20} MiB moved")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="tcp://127.0.0.1:0")
    parser.add_argument("--megabytes", type=int, default=64)
    args = parser.parse_args()
    asyncio.run(main(args.url, args.megabytes))
