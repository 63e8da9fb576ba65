"""tensorwire: asyncio RPC for distributed training, moving tensors without copies.

``import tensorwire`` loads only the core (NumPy, msgpack); UCX, CuPy and
torch are imported when an address or a tensor needs them.
"""

from . import collective, errors, ps, rpc, serde, transports
from ._version import __version__
from .errors import RemoteError, TensorwireError
from .rpc import Client, ClientConfig, Server, ServerConfig, connect

__all__ = (
    "Client",
    "ClientConfig",
    "RemoteError",
    "Server",
    "ServerConfig",
    "TensorwireError",
    "__version__",
    "collective",
    "connect",
    "errors",
    "ps",
    "rpc",
    "serde",
    "transports",
)
