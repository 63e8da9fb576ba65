"""Transports move messages (lists of frames) between two endpoints.

``connect(url)`` and ``listen(url, on_connection)`` pick the transport from
the URL scheme: ``tcp://host:port``, ``ucx://host:port``, ``inproc://name``.
Transports never look inside a frame.
"""

from ._base import Connection, ConnectionHandler, Listener
from ._frames import Allocator, FrameInfo, default_allocator
from ._huge_pages import transparent_huge_pages
from ._pool import BufferPool, PoolStats, buffer_pool
from ._registry import (
    Backend,
    connect,
    format_host_port,
    listen,
    parse_host_port,
    register_transport,
)
from .config import Limits, TransportConfig, UCXOptions

__all__ = (
    "Allocator",
    "Backend",
    "BufferPool",
    "Connection",
    "ConnectionHandler",
    "FrameInfo",
    "Limits",
    "Listener",
    "PoolStats",
    "TransportConfig",
    "UCXOptions",
    "buffer_pool",
    "connect",
    "default_allocator",
    "format_host_port",
    "listen",
    "parse_host_port",
    "register_transport",
    "transparent_huge_pages",
)
