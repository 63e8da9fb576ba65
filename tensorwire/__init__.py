"""tensorwire: asyncio RPC for distributed training, moving tensors without copies.

``import tensorwire`` loads only the core (NumPy, msgpack); UCX, CuPy and
torch are imported when an address or a tensor needs them.
"""

from . import errors, serde, transports
from ._version import __version__
from .errors import TensorwireError

__all__ = ("TensorwireError", "__version__", "errors", "serde", "transports")
