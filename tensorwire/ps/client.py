"""The worker side of the parameter server: chunking, placement, push and pull.

::

    client = await ps.connect(["tcp://h1:7000", "tcp://h2:7000"], worker=rank,
                              num_workers=n, optimizer=ps.Adam(lr=1e-3))
    params = await client.init(initial_params)   # worker 0's values win
    for batch in data:
        params = await client.push_pull(grads(params, batch))
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .. import rpc
from .._metrics import Metrics
from ..errors import (
    ConfigError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
)
from ._compress import Compressor, ErrorFeedback, Payload, compressor_for
from ._consistency import Mode
from ._optim import Optimizer
from ._placement import Chunk, Placement, TensorSpec, chunk_tensors, place
from .config import Job, PSConfig
from .server import LATE

__all__ = ("PSClient", "connect")

logger = logging.getLogger(__name__)

Array = np.ndarray[Any, Any]
_SHARD = "tensorwire.ps.Shard."
# How long after the server-side wait the RPC deadline falls, so the shard's
# DeadlineExceeded (which names the workers behind) arrives first.
_MARGIN = 5.0


async def connect(
    addresses: Sequence[str],
    *,
    worker: int,
    num_workers: int,
    optimizer: Optimizer,
    consistency: Mode = "sync",
    staleness: int = 0,
    compression: str | Compressor | None = None,
    config: PSConfig | None = None,
) -> PSClient:
    """Connect worker ``worker`` of ``num_workers`` to the shards at ``addresses``.

    Every worker must pass the same addresses in the same order, the same
    job settings and (in :meth:`PSClient.init`) the same tensor names,
    shapes and dtypes: the placement is computed, not negotiated.

    Args:
        addresses: one URL per shard (``tcp://``, ``ucx://``, ``inproc://``).
        worker: this worker's rank, ``0 <= worker < num_workers``.
        num_workers: how many workers push.
        optimizer: the shards' update (:class:`SGD`, :class:`Adam`,
            :class:`Adagrad`, or :class:`Aggregate` for worker-side updates).
        consistency: ``"sync"``, ``"ssp"`` or ``"async"``.
        staleness: for ``"ssp"``, how many steps ahead of the slowest worker
            this one may run.
        compression: overrides ``config.compression``.
        config: chunk size, deadlines, RPC settings.

    Raises:
        ConfigError: invalid settings.
        Unavailable: a shard cannot be reached.
    """
    config = config or PSConfig()
    if compression is not None:
        config = dataclasses.replace(config, compression=compression)
    job = Job(num_workers, consistency, staleness, optimizer)
    client = PSClient(addresses, worker=worker, job=job, config=config)
    try:
        await client.connect()
    except BaseException:
        await client.close()
        raise
    return client


@dataclasses.dataclass(frozen=True, slots=True)
class _Batch:
    """Chunks of one shard that travel in one message."""

    shard: int
    chunks: tuple[Chunk, ...]
    keys: list[str]


def _batches(placement: Placement, message_bytes: int) -> list[_Batch]:
    """Each shard's chunks, in tensor order, cut into messages of at most
    ``message_bytes`` (at least one chunk each): small tensors share a
    message, and a shard updates the first message's chunks while the next
    arrive."""
    out: list[_Batch] = []
    for shard in range(placement.num_shards):
        group: list[Chunk] = []
        size = 0
        for chunk in placement.on_shard(shard):
            if group and size + chunk.nbytes > message_bytes:
                out.append(_Batch(shard, tuple(group), [c.key for c in group]))
                group, size = [], 0
            group.append(chunk)
            size += chunk.nbytes
        if group:
            out.append(_Batch(shard, tuple(group), [c.key for c in group]))
    return out


class PSClient:
    """One worker's connection to every shard. Make it with :func:`connect`.

    ``push``, ``pull`` and ``push_pull`` take their clock when called and
    return tasks, so ``pending = client.push(grads)`` overlaps the transfer
    with computation and a later ``client.pull()`` still reads after it.
    Don't write into arrays passed to ``push`` until the next push: they are
    sent without a copy and resent if a shard reconnects.
    """

    def __init__(self, addresses: Sequence[str], *, worker: int, job: Job,
                 config: PSConfig) -> None:
        if not addresses:
            raise ConfigError("need at least one shard address")
        if not 0 <= worker < job.num_workers:
            raise ConfigError(f"worker must be in 0..{job.num_workers - 1}, got {worker}")
        self.addresses = list(addresses)
        self.worker = worker
        self.job = job
        self.config = config
        self.compressor = compressor_for(config.compression)
        self._feedback = ErrorFeedback(self.compressor)
        self._clients = [rpc.Client(address, config=config.rpc) for address in addresses]
        self._specs: dict[str, TensorSpec] = {}
        self._placement: Placement | None = None
        self._batches: list[_Batch] = []
        #: Steps this worker has pushed (the clock of its next push).
        self.clock = 0
        #: Per batch: the arguments of the latest push, resent after a reconnect.
        self._last_push: dict[int, tuple[Any, ...]] = {}
        #: Per batch: the clock of this worker's latest read of its chunks.
        self._seen: list[int] = []
        self._closed = False
        # Set by close(): wakes calls waiting out a reconnection backoff.
        self._closing = asyncio.Event()
        self._metrics = Metrics()

    # -- lifetime -------------------------------------------------------------------

    async def connect(self) -> PSClient:
        """Connect to every shard.

        Raises:
            Unavailable: a shard cannot be reached.
        """
        await asyncio.gather(*(client.connect() for client in self._clients))
        return self

    async def close(self) -> None:
        """Close the shard connections (the shards keep their state); calls in
        flight fail with ``Unavailable``."""
        self._closed = True
        self._closing.set()
        await asyncio.gather(*(client.close() for client in self._clients),
                             return_exceptions=True)

    async def __aenter__(self) -> PSClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- placement ------------------------------------------------------------------

    @property
    def placement(self) -> Placement:
        """Where each chunk lives (after :meth:`init`).

        Raises:
            FailedPrecondition: before :meth:`init`.
        """
        if self._placement is None:
            raise FailedPrecondition("call init() first")
        return self._placement

    @property
    def imbalance(self) -> float:
        """Largest shard's bytes over the mean shard's (1.0 is perfect)."""
        return self.placement.imbalance

    # -- operations -------------------------------------------------------------------

    async def init(self, params: Mapping[str, Array]) -> dict[str, Array]:
        """Place ``params`` and initialize the shards with worker 0's values.

        Worker 0 sends its values to chunks that have none yet (a shard
        restored from a checkpoint keeps its own); the other workers send
        only the layout and wait, up to ``config.timeout``, for worker 0.
        Returns the parameters the shards hold, so every worker starts from
        the same ones. (Per-chunk "first arrival wins" would mix workers'
        values when different workers reach different shards first.)

        Raises:
            InvalidArgument: a tensor that is not floating point, or shards
                holding another model under the same names.
            FailedPrecondition: a shard serves a job with other settings.
            Unavailable: a shard stayed unreachable.
        """
        arrays = {name: np.ascontiguousarray(value) for name, value in params.items()}
        for name, array in arrays.items():
            if array.dtype.kind != "f":
                raise InvalidArgument(f"{name!r}: parameters must be floating point, "
                                      f"got {array.dtype}")
        self._specs = {name: TensorSpec.of(name, array) for name, array in arrays.items()}
        chunks = chunk_tensors(self._specs.values(), self.config.chunk_bytes)
        self._placement = place(chunks, len(self._clients))
        self._batches = _batches(self._placement, self.config.message_bytes)
        self._seen = [0] * len(self._batches)
        self._last_push.clear()
        # Residuals of the compressor belong to the old layout.
        self._feedback = ErrorFeedback(self.compressor)
        logger.info("placed %d tensors as %d chunks on %d shards, imbalance %.3f",
                    len(arrays), len(chunks), len(self._clients), self._placement.imbalance)
        flat = {name: array.reshape(-1) for name, array in arrays.items()}
        job = self.job.to_wire()
        leader = self.worker == 0
        replies = await asyncio.gather(*(
            self._call(b.shard, "init", job, self.worker, b.keys,
                       [flat[c.name][c.start:c.stop] for c in b.chunks] if leader else [],
                       [c.size for c in b.chunks], self.config.timeout)
            for b in self._batches
        ))
        for batch, values in zip(self._batches, replies, strict=True):
            for chunk, value in zip(batch.chunks, values, strict=True):
                wanted = np.dtype(self._specs[chunk.name].dtype)
                if np.asarray(value).dtype != wanted:
                    raise InvalidArgument(
                        f"{chunk.name!r}: the shards hold {np.asarray(value).dtype}, worker "
                        f"{self.worker} has {wanted}: the workers disagree on the model")
        return self._assemble(replies)

    def push(self, grads: Mapping[str, Array]) -> asyncio.Task[None]:
        """Send this step's gradients; the task finishes when every shard took them.

        In sync mode the task waits while the shards still collect an
        earlier step of the other workers.

        Raises:
            FailedPrecondition: before :meth:`init`.
            InvalidArgument: unknown names or wrong shapes.
            DeadlineExceeded: (from the task) the wait outlasted ``config.timeout``.
        """
        clock, payloads = self._prepare(grads)
        return asyncio.get_running_loop().create_task(self._push(clock, payloads))

    def pull(self) -> asyncio.Task[dict[str, Array]]:
        """The parameters once this worker may read them at its clock.

        sync: after every worker's last pushed step was applied; ssp: when
        the slowest worker is at most ``staleness`` steps behind; async: now.
        A tensor held as one chunk arrives as a view of the received buffer.

        Raises:
            FailedPrecondition: before :meth:`init`.
            DeadlineExceeded: (from the task) the wait outlasted
                ``config.timeout``; the message names the workers behind.
        """
        self.placement  # noqa: B018 - raises before init()
        return asyncio.get_running_loop().create_task(self._pull(self.clock))

    def push_pull(self, grads: Mapping[str, Array]) -> asyncio.Task[dict[str, Array]]:
        """``push`` then ``pull`` in one round trip per shard message.

        Raises:
            What :meth:`push` and :meth:`pull` raise.
        """
        clock, payloads = self._prepare(grads)
        return asyncio.get_running_loop().create_task(self._push_pull(clock, payloads))

    async def checkpoint(self) -> list[str]:
        """Ask every shard to write a checkpoint now; returns their paths.

        Raises:
            FailedPrecondition: a shard has no checkpoint directory or no job.
        """
        paths: list[str] = await asyncio.gather(
            *(self._call(s, "checkpoint") for s in range(len(self._clients))))
        return paths

    async def status(self) -> list[dict[str, Any]]:
        """Each shard's clocks, chunk count, bytes and update count."""
        result: list[dict[str, Any]] = await asyncio.gather(
            *(self._call(s, "status") for s in range(len(self._clients))))
        return result

    # -- internals --------------------------------------------------------------------

    def _prepare(self, grads: Mapping[str, Array]) -> tuple[int, list[list[Payload]]]:
        """Check and compress the gradients and take a clock, all before any await."""
        self.placement  # noqa: B018 - raises before init()
        if set(grads) != set(self._specs):
            raise InvalidArgument(
                f"push() needs a gradient for each tensor: unknown "
                f"{sorted(set(grads) - set(self._specs))}, missing "
                f"{sorted(set(self._specs) - set(grads))}")
        flat: dict[str, Array] = {}
        for name, grad in grads.items():
            spec = self._specs[name]
            array = np.asarray(grad)
            if array.shape != spec.shape:
                raise InvalidArgument(f"{name!r}: gradient shape {array.shape}, "
                                      f"parameter shape {spec.shape}")
            flat[name] = np.ascontiguousarray(array, dtype=np.dtype(spec.dtype)).reshape(-1)
        payloads = [
            [self._feedback.compress(c.key, flat[c.name][c.start:c.stop]) for c in b.chunks]
            for b in self._batches
        ]
        clock = self.clock
        self.clock += 1
        return clock, payloads

    async def _push(self, clock: int, payloads: list[list[Payload]]) -> None:
        with self._span("push", clock):
            await asyncio.gather(*(self._on_batch(b, "push", clock, items)
                                   for b, items in enumerate(payloads)))

    async def _pull(self, clock: int) -> dict[str, Array]:
        with self._span("pull", clock):
            return self._assemble(await asyncio.gather(*(
                self._on_batch(b, "pull", clock, []) for b in range(len(self._batches)))))

    async def _push_pull(self, clock: int, payloads: list[list[Payload]]) -> dict[str, Array]:
        with self._span("push_pull", clock):
            return self._assemble(await asyncio.gather(*(
                self._on_batch(b, "push_pull", clock, items)
                for b, items in enumerate(payloads))))

    def metrics(self) -> dict[str, dict[str, Any]]:
        """Per operation (push, pull, push_pull): calls, errors, bytes out and
        in (compressed, as sent), latency p50/p90/p99 (s)."""
        return self._metrics.snapshot()

    @contextlib.contextmanager
    def _span(self, name: str, clock: int) -> Iterator[None]:
        """Count one operation in the metrics, and on the timeline if there is one."""
        timeline = self.config.timeline
        started = time.perf_counter()
        error = True
        try:
            yield
            error = False
        finally:
            self._metrics[name].observe(time.perf_counter() - started, error=error)
            if timeline is not None:
                timeline.add_since(name, "ps", started, worker=self.worker, clock=clock,
                                   error=error)

    async def _on_batch(self, index: int, method: str, clock: int,
                        items: list[Payload]) -> Any:
        batch, wait = self._batches[index], self.config.timeout
        if method == "pull":
            args: tuple[Any, ...] = (self.worker, clock, batch.keys, wait)
        else:
            # ``seen`` tells the shard which step this worker saw complete on
            # these chunks: a shard restored from an older checkpoint catches up.
            args = (self.worker, clock, batch.keys, items, self._seen[index], wait)
            self._last_push[index] = args
        metrics = self._metrics[method]
        metrics.bytes_out += _nbytes(items)
        result = await self._call(batch.shard, method, *args, batch=index)
        if method != "push":
            metrics.bytes_in += _nbytes(result)
            read_at = clock if method == "pull" else clock + 1
            self._seen[index] = max(self._seen[index], read_at)
        return result

    async def _call(self, shard: int, method: str, *args: Any, batch: int = -1) -> Any:
        """Call a shard, retrying while it is unreachable (all methods are idempotent).

        A shard that comes back may have restarted from a checkpoint and lost
        this worker's last push, so that push goes again before a retried
        pull (a copy the shard already has is ignored).
        """
        client = self._clients[shard]
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.config.retry_timeout
        timeout = self.config.timeout + _MARGIN
        pause = 0.05
        while True:
            try:
                result = await client.call(_SHARD + method, *args, timeout=timeout,
                                           idempotent=True)
            except Unavailable as exc:
                if self._closed or loop.time() + pause > give_up:
                    raise
                logger.warning("shard %d (%s) unavailable (%s); retrying", shard,
                               client.address, exc)
            else:
                if isinstance(result, dict) and LATE in result:
                    raise DeadlineExceeded(f"shard {shard}: {result[LATE]}")
                return result
            # A backoff between reconnection attempts, cut short by close().
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), pause)
            if self._closed:
                raise Unavailable(f"shard {shard}: the client was closed")
            pause = min(pause * 2, 1.0)
            last = self._last_push.get(batch)
            if method in ("pull", "push_pull") and last is not None and last[1] < args[1]:
                try:
                    await client.call(_SHARD + "push", *last, timeout=timeout, idempotent=True)
                except Unavailable:
                    continue

    def _assemble(self, replies: Sequence[list[Array]]) -> dict[str, Array]:
        """Tensors from the chunk values each shard sent back."""
        placement = self.placement
        got: dict[str, Array] = {}
        for batch, values in zip(self._batches, replies, strict=True):
            for key, value in zip(batch.keys, values, strict=True):
                got[key] = value
        out: dict[str, Array] = {}
        pieces: dict[str, list[Chunk]] = {}
        for chunk in placement.chunks:
            pieces.setdefault(chunk.name, []).append(chunk)
        for name, chunks in pieces.items():
            spec = self._specs[name]
            if len(chunks) == 1:
                out[name] = np.asarray(got[chunks[0].key]).reshape(spec.shape)
                continue
            whole = np.empty(spec.size, np.dtype(spec.dtype))
            for chunk in chunks:
                whole[chunk.start:chunk.stop] = got[chunk.key]
            out[name] = whole.reshape(spec.shape)
        return out


def _nbytes(value: Any) -> int:
    """The array bytes in a payload (arrays inside dicts and lists)."""
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0
