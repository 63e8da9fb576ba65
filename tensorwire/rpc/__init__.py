"""RPC: services with ``@rpc.method``, a server hosting them, typed client proxies.

::

    class Store(rpc.Service):
        @rpc.method
        async def get(self, key: str) -> np.ndarray: ...

    server = rpc.Server([Store()])
    await server.start("tcp://127.0.0.1:0")
    async with rpc.connect(server.addresses[0]) as client:
        store = client.proxy(Store)
        w = await store.get("w")
"""

from .client import Client, connect
from .config import ClientConfig, ServerConfig
from .server import Server
from .service import MethodInfo, Service, method
from .sync import SyncClient

__all__ = (
    "Client",
    "ClientConfig",
    "MethodInfo",
    "Server",
    "ServerConfig",
    "Service",
    "SyncClient",
    "connect",
    "method",
)
