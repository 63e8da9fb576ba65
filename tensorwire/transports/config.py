"""Explicit, frozen transport configuration.

Nothing here reads the environment: UCX settings that UCX itself takes from
environment variables are carried in :class:`UCXOptions` and applied by the
ucx:// transport just before it first initialises UCX.
"""

from __future__ import annotations

import dataclasses
import ssl
from collections.abc import Mapping
from typing import Literal

from ..errors import ConfigError

__all__ = ("Limits", "TransportConfig", "UCXOptions")

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """What a peer may announce before we refuse the message.

    Checked as soon as a message's frame table arrives, before any frame is
    allocated, so a hostile peer cannot make us allocate more than this.
    """

    max_frame_bytes: int = 4 * GiB
    max_frames: int = 16384
    max_message_bytes: int = 8 * GiB

    def __post_init__(self) -> None:
        for name in ("max_frame_bytes", "max_frames", "max_message_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"Limits.{name} must be a positive int, got {value!r}")
        if self.max_frames > 1 << 24:
            raise ConfigError("Limits.max_frames must be at most 2**24")


ProgressMode = Literal["blocking", "polling"]
#: ucxx's own modes that run progress on a second thread: refused, because
#: their completions reach asyncio through that thread and measured 10x the
#: round-trip time here (see ucx.py, "Progress modes").
_THREAD_MODES = ("thread", "thread-polling")


#: The default spin window of ucx:// (``UCXOptions.spin``) and tcp://
#: (``TransportConfig.tcp_spin``), in seconds: a ping-pong's answer between
#: processes on one host usually comes within it.
SPIN_WINDOW = 200e-6


def _seconds_0_to_1(value: object) -> bool:
    """Whether ``value`` is a spin window: a number of seconds from 0 to 1
    (not a bool, which would read as 0 or 1 s)."""
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and 0 <= value <= 1)


@dataclasses.dataclass(frozen=True, slots=True)
class UCXOptions:
    """UCX settings for the ucx:// transport.

    ``tls`` and ``devices`` map to ``UCX_TLS`` and ``UCX_NET_DEVICES``;
    ``None`` lets UCX choose. ``rndv_scheme`` maps to ``UCX_RNDV_SCHEME``.
    ``spin``: in the blocking progress mode, seconds to keep polling after a
    request completes before the worker sleeps on its wake-up descriptor (in
    a ping-pong the answer usually comes within it, and a poll costs far
    less than a wake-up). A window that passes with no answer shuts the
    next ones for a while (the peer most likely shares our CPU, and the
    spinning takes the CPU it needs), so the default suits busy hosts too;
    0 never spins.
    ``environment`` passes any other ``UCX_*`` setting. They are applied to
    the process environment once, before ``ucxx`` is first imported, because
    UCX reads them only then; a later, different setting raises ConfigError.
    """

    tls: tuple[str, ...] | None = None
    devices: tuple[str, ...] | None = None
    progress_mode: ProgressMode = "blocking"
    spin: float = SPIN_WINDOW
    rndv_scheme: str | None = "put_zcopy"
    environment: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.progress_mode in _THREAD_MODES:
            raise ConfigError(
                f"ucx:// drives UCX from the event loop and supports the 'blocking' and "
                f"'polling' progress modes, not {self.progress_mode!r}"
            )
        if self.progress_mode not in ("blocking", "polling"):
            raise ConfigError(f"unknown UCX progress mode {self.progress_mode!r}")
        if not _seconds_0_to_1(self.spin):
            raise ConfigError(f"UCXOptions.spin must be 0 to 1 seconds, got {self.spin!r}")
        for key in self.environment:
            if not key.startswith("UCX_"):
                raise ConfigError(f"UCXOptions.environment keys must start with UCX_, got {key!r}")
        object.__setattr__(self, "environment", dict(self.environment))

    def ucx_environment(self) -> dict[str, str]:
        """The ``UCX_*`` variables these options stand for."""
        env = dict(self.environment)
        if self.tls is not None:
            env["UCX_TLS"] = ",".join(self.tls)
        if self.devices is not None:
            env["UCX_NET_DEVICES"] = ",".join(self.devices)
        if self.rndv_scheme is not None:
            env["UCX_RNDV_SCHEME"] = self.rndv_scheme
        return env


@dataclasses.dataclass(frozen=True, slots=True)
class TransportConfig:
    """Settings shared by every transport; each ignores what does not apply.

    Attributes:
        limits: the largest message a peer may send us.
        connect_timeout: seconds for ``connect()`` to reach the peer and
            finish the handshake.
        handshake_timeout: seconds a listener waits for a new peer's handshake.
        close_timeout: seconds a polite ``close()`` waits for the peer.
        socket_sndbuf / socket_rcvbuf: ``SO_SNDBUF`` / ``SO_RCVBUF`` in bytes
            (``None``: the kernel's autotuning).
        ssl_client / ssl_server: TLS contexts for tcp:// (``None``: plain TCP).
        ssl_server_hostname: the name checked against the server certificate.
        ucx: options for ucx://.
        inproc_queue: messages an inproc:// peer may queue before ``send``
            waits.
        max_unsent_bytes: the most output a connection's consumer (an RPC
            client or server) queues for a peer that does not read it; over
            it, the consumer stops reading that peer's messages (and an RPC
            client's new calls wait, within their deadline) until its
            unsent output is down to a quarter of it. A message larger
            than this still goes out: the bound is then that message.
        max_connections: the most connections a listener keeps open at
            once; one beyond it is closed as soon as accepted, with a log
            line.
        max_pending_connections: the most accepted connections that have
            not yet finished the handshake (a slow-loris peer holds one until
            ``handshake_timeout``); one beyond it is closed at once too.
        tcp_spin: plain tcp:// (not TLS): seconds the event loop keeps
            polling a connection after a read of exactly one message,
            before it may sleep (in a ping-pong the answer usually comes
            within it, and a poll costs far less than a wake-up); not
            after a batch or part of a large message. A window that passes
            with no data shuts the next ones for a while, as
            ``UCXOptions.spin``'s do. 0 never spins: for a host with more
            busy processes than cores, where the polling may take a core
            another process needs (see docs/transports.md, "tcp://").
    """

    limits: Limits = Limits()
    connect_timeout: float = 30.0
    handshake_timeout: float = 10.0
    close_timeout: float = 5.0
    socket_sndbuf: int | None = None
    socket_rcvbuf: int | None = None
    ssl_client: ssl.SSLContext | None = None
    ssl_server: ssl.SSLContext | None = None
    ssl_server_hostname: str | None = None
    ucx: UCXOptions = UCXOptions()
    inproc_queue: int = 64
    max_unsent_bytes: int = 64 * MiB
    max_connections: int = 4096
    max_pending_connections: int = 256
    tcp_spin: float = SPIN_WINDOW

    def __post_init__(self) -> None:
        for name in ("connect_timeout", "handshake_timeout", "close_timeout"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value <= 0:
                raise ConfigError(f"TransportConfig.{name} must be positive, got {value!r}")
        for name in ("socket_sndbuf", "socket_rcvbuf"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"TransportConfig.{name} must be a positive int or None")
        if not _seconds_0_to_1(self.tcp_spin):
            raise ConfigError(f"TransportConfig.tcp_spin must be 0 to 1 seconds, "
                              f"got {self.tcp_spin!r}")
        if self.inproc_queue < 1:
            raise ConfigError("TransportConfig.inproc_queue must be at least 1")
        for name in ("max_unsent_bytes", "max_connections", "max_pending_connections"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"TransportConfig.{name} must be a positive int, "
                                  f"got {value!r}")
