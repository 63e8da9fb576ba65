"""Test your own services in-process, like grpclib's ``ChannelFor``.

::

    async def test_store():
        async with tensorwire.testing.client_for(Store()) as client:
            store = client.proxy(Store)
            await store.put("w", np.ones(3))
            assert (await store.get("w")).sum() == 3

The server and client talk over ``inproc://`` (no sockets, same event loop),
through the real RPC protocol and codec: handlers get the same values, errors
and statuses a remote call would give them. One difference: inproc:// passes
frames by reference, so an array of at least the codec's inline threshold
arrives as a view of the caller's memory, and a handler that changes it in
place changes the caller's array (over a network it would change a copy).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

from ..rpc import Client, ClientConfig, Server, ServerConfig, Service

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
