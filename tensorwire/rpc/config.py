"""Frozen, validated configuration for RPC clients and servers."""

from __future__ import annotations

import dataclasses

from ..errors import ConfigError
from ..timeline import Timeline
from ..transports import TransportConfig

__all__ = ("ClientConfig", "ServerConfig")


def _positive(owner: object, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{type(owner).__name__}.{name} must be positive, got {value!r}")


def _secret(value: bytes | str | None) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = value.encode()
    if not isinstance(value, bytes) or len(value) < 8:
        raise ConfigError("the shared secret must be at least 8 bytes")
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class ClientConfig:
    """How a client calls.

    Attributes:
        timeout: default deadline of each call in seconds (per call:
            ``timeout=``).
        connect_timeout: seconds for connecting and the handshake.
        heartbeat_interval: seconds between pings to the server.
        heartbeat_timeout: a server silent this long is dead; calls in
            flight then fail with ``Unavailable``.
        reconnect_attempts: connection attempts a call makes before it fails
            with ``Unavailable``.
        reconnect_backoff: first pause between attempts, doubled each time.
        reconnect_backoff_max: the longest pause.
        stream_window: stream items the client lets the server send ahead.
        secret: shared secret for challenge-response authentication.
        transport: the transport settings (limits, TLS, UCX).
        name: how this client introduces itself (shows in server logs).
        timeline: records every call as a span (``tensorwire.timeline``).
    """

    timeout: float = 60.0
    connect_timeout: float = 10.0
    heartbeat_interval: float = 2.0
    heartbeat_timeout: float = 10.0
    reconnect_attempts: int = 3
    reconnect_backoff: float = 0.05
    reconnect_backoff_max: float = 2.0
    stream_window: int = 16
    secret: bytes | None = None
    transport: TransportConfig = dataclasses.field(default_factory=TransportConfig)
    name: str = ""
    timeline: Timeline | None = None

    def __post_init__(self) -> None:
        _positive(self, "timeout", "connect_timeout", "heartbeat_interval", "heartbeat_timeout",
                  "reconnect_attempts", "reconnect_backoff", "reconnect_backoff_max",
                  "stream_window")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ConfigError("heartbeat_timeout must exceed heartbeat_interval")
        object.__setattr__(self, "secret", _secret(self.secret))


@dataclasses.dataclass(frozen=True, slots=True)
class ServerConfig:
    """How a server serves.

    Attributes:
        max_concurrent_per_connection: calls one connection may run at once;
            the client is told and queues the rest itself.
        max_concurrent: calls the whole server runs at once; more wait.
        heartbeat_timeout: a client silent this long is dropped and its
            calls cancelled.
        stream_window: stream items the server lets a client send ahead.
        secret: shared secret; when set, clients must prove they know it.
        transport: the transport settings (limits, TLS, UCX).
        shutdown_grace: seconds ``close()`` lets calls in flight finish.
        timeline: records every call as a span (``tensorwire.timeline``).
    """

    max_concurrent_per_connection: int = 256
    max_concurrent: int = 4096
    heartbeat_timeout: float = 10.0
    stream_window: int = 16
    secret: bytes | None = None
    transport: TransportConfig = dataclasses.field(default_factory=TransportConfig)
    shutdown_grace: float = 5.0
    timeline: Timeline | None = None

    def __post_init__(self) -> None:
        _positive(self, "max_concurrent_per_connection", "max_concurrent", "heartbeat_timeout",
                  "stream_window", "shutdown_grace")
        object.__setattr__(self, "secret", _secret(self.secret))
