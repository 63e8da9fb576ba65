"""Frozen, validated configuration for process groups."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from ..errors import ConfigError
from ..rpc import ClientConfig
from ..timeline import Timeline
from ..transports import TransportConfig
from ._hierarchy import hierarchy

__all__ = ("GroupConfig",)

KiB = 1 << 10
MiB = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class GroupConfig:
    """How a group rendezvous and runs its operations.

    Attributes:
        timeout: default deadline of each operation in seconds (per call:
            ``timeout=``); when it passes, the error names the ranks that
            had not reached the operation.
        rendezvous_timeout: seconds ``Group.create`` waits for every rank to
            join and for the connections between them.
        small_bytes: messages up to this size use the latency-optimal
            algorithms (recursive doubling, binomial trees, Bruck); larger ones
            the bandwidth-optimal ring and pipelined chain. Per call:
            ``algorithm="ring"`` or ``"tree"``.
        segment_bytes: large messages travel in segments of at most this many
            bytes, so that a ring or chain step pipelines and the scratch
            memory of a reduction stays at one segment.
        hierarchical_bytes: allreduce, broadcast and allgather of more than
            this many bytes run hierarchically (inside each host first, then
            one leader per host across hosts) when the topology has several
            hosts and more than one rank on some host. ``None``: only when a
            call asks for it (``algorithm="hierarchical"``).
        topology: which ranks share a host, as host name -> ranks (of the
            root group), instead of what the rendezvous learned from host
            names and listen addresses. For clusters whose host names
            mislead, and for tests that emulate several hosts on one.
        heartbeat_interval / heartbeat_timeout: liveness of the control
            connection to rank 0, which reports a dead rank to the others. A
            process that dies closes its connections and is reported at once;
            the timeout is for hosts and links that go silent. Heartbeats run
            on the event loop, so a rank that blocks its loop for longer
            (a long step of synchronous compute) is taken for dead: run such
            work in an executor, or raise the timeout.
        transport: transport settings of the data connections (limits, TLS,
            UCX options).
        timeline: where to record every operation as a span (see
            :mod:`tensorwire.timeline`); ``None`` records nothing.
    """

    timeout: float = 300.0
    rendezvous_timeout: float = 120.0
    small_bytes: int = 64 * KiB
    segment_bytes: int = 4 * MiB
    hierarchical_bytes: int | None = 64 * KiB
    topology: Mapping[str, Sequence[int]] | None = None
    heartbeat_interval: float = 5.0
    heartbeat_timeout: float = 60.0
    transport: TransportConfig = dataclasses.field(default_factory=TransportConfig)
    timeline: Timeline | None = None

    def __post_init__(self) -> None:
        for name in ("timeout", "rendezvous_timeout", "heartbeat_interval", "heartbeat_timeout"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ConfigError(f"GroupConfig.{name} must be positive, got {value!r}")
        for name in ("small_bytes", "segment_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"GroupConfig.{name} must be a non-negative int, got {value!r}")
        value = self.hierarchical_bytes
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 0):
            raise ConfigError(
                f"GroupConfig.hierarchical_bytes must be a non-negative int or None, got {value!r}")
        if self.topology is not None:
            # Checked here, against the world size in Group.create.
            try:
                hierarchy(self.topology)
            except (ValueError, TypeError, AttributeError) as exc:
                raise ConfigError(f"GroupConfig.topology: {exc}") from None
        if self.segment_bytes < 4 * KiB:
            raise ConfigError("GroupConfig.segment_bytes must be at least 4 KiB")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ConfigError("heartbeat_timeout must exceed heartbeat_interval")

    def client_config(self) -> ClientConfig:
        """The RPC client settings of the control connection."""
        return ClientConfig(
            timeout=self.rendezvous_timeout,
            connect_timeout=self.rendezvous_timeout,
            heartbeat_interval=self.heartbeat_interval,
            heartbeat_timeout=self.heartbeat_timeout,
            reconnect_attempts=1,
            transport=self.transport,
            name="tensorwire.collective",
        )
