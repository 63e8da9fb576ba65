"""tensorwire: asyncio RPC for distributed training, moving tensors without copies.

``import tensorwire`` loads only the core (NumPy, msgpack); UCX, CuPy and
torch are imported when an address or a tensor needs them.
"""

from . import _compiled

_compiled.require()

from . import collective, errors, ps, rpc, serde, transports  # noqa: E402
from ._version import __version__  # noqa: E402
from .errors import RemoteError, TensorwireError  # noqa: E402
from .rpc import Client, ClientConfig, Server, ServerConfig, connect  # noqa: E402

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
