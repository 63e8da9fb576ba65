"""A tensor store served over RPC: the README's quick start, runnable.

    python examples/store.py
"""

import asyncio

import numpy as np

import tensorwire as tw
from tensorwire import rpc


class Store(rpc.Service):
    def __init__(self):
        self.data = {}

    @rpc.method
    async def put(self, key: str, value) -> None:
        self.data[key] = value

    @rpc.method(idempotent=True)            # retried once after a reconnect
    async def get(self, key: str):
        if key not in self.data:
            raise tw.errors.NotFound(f"no key {key!r}")   # the caller gets NotFound
        return self.data[key]

    @rpc.method
    async def scan(self, prefix: str):      # async generator: a streaming method
        for key in sorted(self.data):
            if key.startswith(prefix):
                yield key

async def main():
    server = tw.Server([Store()])
    await server.start("tcp://127.0.0.1:0")          # any number of tcp://, ucx://, inproc://
    async with tw.connect(server.addresses[0], timeout=10) as client:
        store = client.proxy(Store)                   # typed: editors complete the names
        await store.put("w", np.ones((1024, 1024), np.float32))
        w = await store.get("w")
        print(w.sum(), [k async for k in store.scan("w")])
        print(await client.call("Store.get", "w"))    # by name, without the class
    await server.close()

if __name__ == "__main__":      # `tensorwire serve app:Store` imports this file
    asyncio.run(main())
