"""Test your own services in-process, like grpclib's ``ChannelFor``.

::

    async def test_store():
        async with tensorwire.testing.client_for(Store()) as client:
            store = client.proxy(Store)
            await store.put("w", np.ones(3))
            assert (await store.get("w")).sum() == 3

The server and client talk over ``inproc://`` (no sockets, same event loop),
through the real RPC protocol and codec, so handlers see exactly what a
remote call would give them.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

from .rpc import Client, ClientConfig, Server, ServerConfig, Service

__all__ = ("client_for",)


@contextlib.asynccontextmanager
async def client_for(
    *services: Service,
    server_config: ServerConfig | None = None,
    client_config: ClientConfig | None = None,
) -> AsyncIterator[Client]:
    """Serve ``services`` in-process and yield a connected client."""
    server = Server(services, config=server_config)
    (address,) = await server.start(f"inproc://testing-{uuid.uuid4().hex}")
    try:
        async with Client(address, config=client_config) as client:
            yield client
    finally:
        await server.close(grace=0)
