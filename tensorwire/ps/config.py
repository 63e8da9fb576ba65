"""Frozen, validated configuration of parameter-server workers and shards."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..rpc import ClientConfig, ServerConfig
from ..timeline import Timeline
from ._compress import LINK_CLASSES, CompressionSpec, compressor_for
from ._consistency import MODES, Mode
from ._optim import Aggregate, Optimizer, optimizer_from_wire

__all__ = ("Job", "PSConfig", "ShardConfig")

MiB = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    """What every worker and shard of one training job agree on.

    The first worker to reach a shard sets its job; a worker with a
    different job is refused (``FailedPrecondition``).

    Attributes:
        num_workers: how many workers push (ranks ``0 .. num_workers - 1``).
        consistency: ``"sync"``, ``"ssp"`` (bounded staleness) or ``"async"``.
        staleness: in ``"ssp"``, how many steps a worker may run ahead of the
            slowest one.
        optimizer: the update the shards apply.
    """

    num_workers: int
    consistency: Mode
    staleness: int
    optimizer: Optimizer

    def __post_init__(self) -> None:
        if not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise ConfigError(f"num_workers must be a positive int, got {self.num_workers!r}")
        if self.consistency not in MODES:
            raise ConfigError(f"consistency must be one of {MODES}, got {self.consistency!r}")
        if not isinstance(self.staleness, int) or self.staleness < 0:
            raise ConfigError(f"staleness must be an int >= 0, got {self.staleness!r}")
        if self.consistency != "ssp" and self.staleness:
            raise ConfigError("staleness applies to consistency='ssp' only")
        if not isinstance(self.optimizer, Optimizer):
            raise ConfigError(f"optimizer must be a ps optimizer, got {self.optimizer!r}")
        if isinstance(self.optimizer, Aggregate) and self.consistency != "sync":
            raise ConfigError("Aggregate (worker-side updates) needs consistency='sync'")

    def to_wire(self) -> dict[str, Any]:
        """A plain dict for the codec and checkpoints."""
        return {"num_workers": self.num_workers, "consistency": self.consistency,
                "staleness": self.staleness, "optimizer": self.optimizer.to_wire()}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Job:
        """Rebuild from :meth:`to_wire`.

        Raises:
            ConfigError: missing or invalid fields.
        """
        try:
            return cls(int(wire["num_workers"]), wire["consistency"], int(wire["staleness"]),
                       optimizer_from_wire(wire["optimizer"]))
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"invalid job description: {exc}") from None


@dataclasses.dataclass(frozen=True, slots=True)
class PSConfig:
    """How a worker talks to the shards.

    Attributes:
        chunk_bytes: largest piece of a tensor placed on one shard.
        message_bytes: most chunk bytes in one message to a shard; a shard's
            chunks beyond it go in further messages, concurrently, so the
            shard updates the first chunks while the rest arrive.
        compression: ``"none"``, ``"fp16"``, ``"bf16"``, ``"int8"``,
            ``"fp8"`` (= ``"fp8_e4m3"``), ``"fp8_e5m2"``, ``"topk"``, a
            :class:`Compressor`, None (no compression), or one of those per
            link class, ``{"local": ..., "remote": ...}`` (``"local"``: a
            shard on the worker's own host, ``"remote"``: on another host; a
            missing class gets none). Gradients only; parameters come back
            uncompressed. A mapping is copied.
        timeout: deadline in seconds of one push, pull or push_pull,
            including the wait for other workers.
        retry_timeout: how long a call keeps retrying a shard that went
            away (restarting from its checkpoint) before ``Unavailable``.
        rpc: the RPC client settings of each shard connection.
        timeline: records every push, pull and push_pull as a span
            (``tensorwire.timeline``).
        priority: send the messages of the tensors the forward pass needs
            first (the order of ``init``'s dict) first, at most ``window``
            in flight per shard; False sends them in the order the
            gradients are given, all at once (FIFO).
        window: messages in flight per shard when ``priority`` is on.
        rebalance_every: worker 0 checks the shards' measured bandwidth
            every this many steps and moves chunks from slow shards to fast
            ones (None: only when :meth:`PSClient.rebalance` is called).
        rebalance_threshold: move when the largest predicted shard time
            (bytes / bandwidth) exceeds the mean by more than this fraction.
    """

    chunk_bytes: int = 4 * MiB
    message_bytes: int = 8 * MiB
    compression: CompressionSpec = "none"
    timeout: float = 60.0
    retry_timeout: float = 30.0
    rpc: ClientConfig = dataclasses.field(default_factory=ClientConfig)
    timeline: Timeline | None = None
    priority: bool = True
    window: int = 4
    rebalance_every: int | None = None
    rebalance_threshold: float = 0.1

    def __post_init__(self) -> None:
        if self.rebalance_every is not None and (
                not isinstance(self.rebalance_every, int) or self.rebalance_every < 1):
            raise ConfigError(f"PSConfig.rebalance_every must be a positive int or None, "
                              f"got {self.rebalance_every!r}")
        if not self.rebalance_threshold >= 0:
            raise ConfigError(f"PSConfig.rebalance_threshold must be at least 0, "
                              f"got {self.rebalance_threshold!r}")
        for name in ("chunk_bytes", "message_bytes", "window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"PSConfig.{name} must be a positive int, got {value!r}")
        if isinstance(self.compression, Mapping):
            # A copy, so that changing the caller's dict later changes no config.
            object.__setattr__(self, "compression", dict(self.compression))
        for link in LINK_CLASSES:
            compressor_for(self.compression, link=link)
        for name in ("timeout", "retry_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"PSConfig.{name} must be positive, got {value!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class ShardConfig:
    """How a shard keeps its state.

    Attributes:
        checkpoint_dir: where checkpoints go; None keeps no checkpoints.
            A restarted shard with the same directory restores the newest.
        checkpoint_interval: seconds between periodic checkpoints (None: none).
        checkpoint_every: also checkpoint every this many applied updates.
        keep_checkpoints: how many checkpoint files to keep.
        rpc: the RPC server settings.
    """

    checkpoint_dir: Path | None = None
    checkpoint_interval: float | None = None
    checkpoint_every: int | None = None
    keep_checkpoints: int = 2
    rpc: ServerConfig = dataclasses.field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        if self.checkpoint_dir is not None:
            object.__setattr__(self, "checkpoint_dir", Path(self.checkpoint_dir))
        periodic = self.checkpoint_interval is not None or self.checkpoint_every is not None
        if periodic and self.checkpoint_dir is None:
            raise ConfigError("periodic checkpoints need a checkpoint_dir")
        if self.checkpoint_interval is not None and not self.checkpoint_interval > 0:
            raise ConfigError("checkpoint_interval must be positive")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ConfigError("checkpoint_every must be at least 1")
        if self.keep_checkpoints < 1:
            raise ConfigError("keep_checkpoints must be at least 1")
