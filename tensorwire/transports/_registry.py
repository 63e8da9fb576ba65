"""Pick a transport from the URL scheme (Dask ``comm/registry.py``).

Backends are named by module path and imported on first use, so that
``import tensorwire`` never imports UCX.
"""

from __future__ import annotations

import abc
import importlib
import urllib.parse
from typing import Any

from ..errors import ConfigError, UnsupportedTransportError
from ._base import Connection, ConnectionHandler, Listener
from ._frames import Allocator
from .config import TransportConfig

__all__ = ("Backend", "connect", "format_host_port", "listen", "parse_host_port",
           "register_transport")


class Backend(abc.ABC):
    """What a transport module provides: ``backend = SomeBackend()``."""

    @abc.abstractmethod
    async def connect(
        self, address: str, config: TransportConfig, allocator: Allocator | None
    ) -> Connection:
        """Open a connection to ``address`` (the URL without its scheme)."""

    @abc.abstractmethod
    async def listen(
        self,
        address: str,
        on_connection: ConnectionHandler,
        config: TransportConfig,
        allocator: Allocator | None,
    ) -> Listener:
        """Listen on ``address`` (the URL without its scheme)."""


_BACKENDS: dict[str, str | Backend] = {
    "tcp": "tensorwire.transports.tcp",
    "ucx": "tensorwire.transports.ucx",
    "inproc": "tensorwire.transports.inproc",
}


def register_transport(scheme: str, backend: str | Backend) -> None:
    """Register a backend (or the module path that defines ``backend``) for a scheme."""
    _BACKENDS[scheme] = backend


def _backend(url: str) -> tuple[Backend, str]:
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ConfigError(f"address {url!r} has no scheme; expected e.g. tcp://host:port")
    try:
        entry = _BACKENDS[scheme]
    except KeyError:
        known = ", ".join(sorted(_BACKENDS))
        raise UnsupportedTransportError(
            f"no transport for scheme {scheme!r} in {url!r} (known: {known})"
        ) from None
    if isinstance(entry, str):
        module: Any = importlib.import_module(entry)
        entry = module.backend
        assert isinstance(entry, Backend)
        # Caching the imported backend is the one piece of module state here.
        _BACKENDS[scheme] = entry
    return entry, rest


async def connect(
    url: str, *, config: TransportConfig | None = None, allocator: Allocator | None = None
) -> Connection:
    """Connect to ``url``; the scheme picks the transport.

    Raises:
        ConfigError: the URL is malformed.
        UnsupportedTransportError: no transport for the scheme, or its library
            is missing.
        TransportError: the peer cannot be reached or the handshake failed.
    """
    backend, address = _backend(url)
    return await backend.connect(address, config or TransportConfig(), allocator)


async def listen(
    url: str,
    on_connection: ConnectionHandler,
    *,
    config: TransportConfig | None = None,
    allocator: Allocator | None = None,
) -> Listener:
    """Listen on ``url`` and run ``on_connection(conn)`` for each peer.

    ``Listener.address`` reports the real address (port 0 gets a free port).

    Raises:
        ConfigError: the URL is malformed.
        UnsupportedTransportError: no transport for the scheme.
        TransportError: the address cannot be bound.
    """
    backend, address = _backend(url)
    return await backend.listen(address, on_connection, config or TransportConfig(), allocator)


def parse_host_port(address: str, scheme: str) -> tuple[str, int]:
    """Split ``host:port`` / ``[v6]:port`` into its parts.

    Raises:
        ConfigError: no port, or a port out of range.
    """
    parsed = urllib.parse.urlsplit(f"{scheme}://{address}")
    try:
        port = parsed.port
    except ValueError as exc:
        raise ConfigError(f"bad port in {scheme}://{address}: {exc}") from None
    if port is None or parsed.hostname is None or parsed.path or parsed.query:
        raise ConfigError(f"expected {scheme}://host:port, got {scheme}://{address}")
    return parsed.hostname, port


def format_host_port(scheme: str, host: str, port: int) -> str:
    """The URL for ``host`` and ``port``, bracketing IPv6 hosts."""
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"
