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
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .._counters import Metrics, record_call
from ..errors import (
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    PlacementMoved,
)
from . import _rebalance, _reshard
from ._arrays import array_module
from ._arrivals import Arrivals
from ._compress import CompressionSpec, LinkFeedback, Payload, compressor_for
from ._consistency import Mode
from ._links import ShardLinks
from ._optim import Optimizer
from ._placement import (
    Chunk,
    Placement,
    TensorSpec,
    chunk_tensors,
    join_chunks,
    place,
)
from ._step import Step
from .config import Job, PSConfig
from .server import Shard, nbytes

__all__ = ("Arrivals", "PSClient", "connect")

logger = logging.getLogger(__name__)

Array = np.ndarray[Any, Any]


async def connect(
    addresses: Sequence[str],
    *,
    worker: int,
    num_workers: int,
    optimizer: Optimizer,
    consistency: Mode = "sync",
    staleness: int = 0,
    compression: CompressionSpec = None,
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
    #: Its place in the send order: the smallest rank of its tensors.
    rank: int


def _batches(placement: Placement, message_bytes: int, rank: Mapping[str, int],
             keys: set[str] | None = None) -> list[_Batch]:
    """Each shard's chunks (those in ``keys``, or all), in ``rank`` order, cut
    into messages of at most ``message_bytes`` (at least one chunk each):
    small tensors share a message, and a shard updates the first message's
    chunks while the next arrive."""
    out: list[_Batch] = []
    for shard in range(placement.num_shards):
        group: list[Chunk] = []
        size = 0
        chunks = [c for c in placement.on_shard(shard) if keys is None or c.key in keys]
        chunks.sort(key=lambda c: (rank[c.name], c.index))
        for chunk in chunks:
            if group and size + chunk.nbytes > message_bytes:
                out.append(_batch(shard, group, rank))
                group, size = [], 0
            group.append(chunk)
            size += chunk.nbytes
        if group:
            out.append(_batch(shard, group, rank))
    return out


def _batch(shard: int, group: list[Chunk], rank: Mapping[str, int]) -> _Batch:
    return _Batch(shard, tuple(group), [c.key for c in group], min(rank[c.name] for c in group))


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
        if len(set(addresses)) != len(addresses):
            raise ConfigError("a shard address is listed twice")
        if not 0 <= worker < job.num_workers:
            raise ConfigError(f"worker must be in 0..{job.num_workers - 1}, got {worker}")
        self._shards = ShardLinks(addresses, worker=worker, config=config)
        # Shards of earlier placements that left: they may still hold chunks
        # of a change that did not finish.
        self._retired: list[str] = []
        self.worker = worker
        self.job = job
        self.config = config
        #: The compressor for shards on other hosts.
        self.compressor = compressor_for(config.compression, link="remote")
        self._feedback = LinkFeedback(config.compression)
        self._host = socket.gethostname()
        self._specs: dict[str, TensorSpec] = {}
        self._rank: dict[str, int] = {}
        self._chunks: tuple[Chunk, ...] = ()
        self._chunks_of: dict[str, list[Chunk]] = {}
        self._placement: Placement | None = None
        self._batches: list[_Batch] = []
        #: Batches of the parts of steps (begin_step), by their chunk keys:
        #: DDP hands the same buckets every step.
        self._part_batches: dict[frozenset[str], list[_Batch]] = {}
        #: The placement version every call carries (0: computed by init).
        self.version = 0
        self._refreshing = asyncio.Lock()
        #: Steps this worker has pushed (the clock of its next push).
        self.clock = 0
        #: The step being pushed in parts (begin_step), until it is complete.
        self._step: Step | None = None
        self._running = 0  # operations in flight
        self._metrics = Metrics()

    # -- lifetime -------------------------------------------------------------------

    async def connect(self) -> PSClient:
        """Connect to every shard and learn its host.

        Raises:
            Unavailable: a shard cannot be reached.
        """
        await asyncio.gather(*(self._shards.hello(a) for a in self.addresses))
        return self

    async def close(self) -> None:
        """Close the shard connections (the shards keep their state); calls in
        flight fail with ``Unavailable``."""
        await self._shards.close()

    async def __aenter__(self) -> PSClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- placement ------------------------------------------------------------------

    @property
    def addresses(self) -> list[str]:
        """The shards of the current placement, in its order."""
        return self._shards.addresses

    @property
    def placement(self) -> Placement:
        """Where each chunk lives (after :meth:`init`): shard ``i`` is
        ``addresses[i]``.

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

    def link_class(self, shard: int) -> str:
        """``"local"`` when shard ``shard`` runs on this worker's host, else
        ``"remote"``: which of ``config.compression``'s compressors it gets."""
        host = self._shards.link(self.addresses[shard]).host
        return "local" if host == self._host else "remote"

    def _use(self, addresses: list[str], placement: Placement, version: int) -> None:
        """Switch to a placement: batches, and each moving chunk's residual."""
        if self._placement is not None:
            before = [self.link_class(s) for s in range(self._placement.num_shards)]
            old = {k: before[s] for k, s in self._placement.shard_of.items()}
        else:
            old = {}
        self._retired = [a for a in dict.fromkeys([*self._retired, *self.addresses])
                         if a not in addresses]
        self._shards.addresses, self._placement, self.version = addresses, placement, version
        self._batches = _batches(placement, self.config.message_bytes, self._rank)
        self._part_batches.clear()
        after = [self.link_class(s) for s in range(placement.num_shards)]
        for key, shard in placement.shard_of.items():
            was = old.get(key)
            if was is not None:
                self._feedback.moved(key, was, after[shard])

    # -- operations -------------------------------------------------------------------

    async def init(self, params: Mapping[str, Array]) -> dict[str, Array]:
        """Place ``params`` and initialize the shards with worker 0's values.

        The order of ``params`` is the order the forward pass needs them
        (first: most urgent); pass the same order on every worker. Worker 0
        sends its values to chunks that have none yet (a shard restored from
        a checkpoint keeps its own); the other workers send only the layout
        and wait, up to ``config.timeout``, for worker 0. Returns the
        parameters the shards hold, so every worker starts from the same
        ones. (Per-chunk "first arrival wins" would mix workers' values when
        different workers reach different shards first.) Shards that moved
        to another placement (:meth:`reshard`) hand it over.

        Raises:
            InvalidArgument: a tensor that is not floating point, or shards
                holding another model under the same names.
            FailedPrecondition: a shard serves a job with other settings.
            Unavailable: a shard stayed unreachable.
        """
        # CuPy parameters stay on the GPU: their chunks go device to device
        # over ucx://, and the shards keep and update them there.
        arrays = {name: array_module(value).ascontiguousarray(value)
                  for name, value in params.items()}
        for name, array in arrays.items():
            if array.dtype.kind != "f":
                raise InvalidArgument(f"{name!r}: parameters must be floating point, "
                                      f"got {array.dtype}")
        self._specs = {name: TensorSpec.of(name, array) for name, array in arrays.items()}
        self._rank = {name: i for i, name in enumerate(self._specs)}
        self._chunks = tuple(chunk_tensors(self._specs.values(), self.config.chunk_bytes))
        self._chunks_of = {name: [] for name in self._specs}
        for chunk in self._chunks:
            self._chunks_of[chunk.name].append(chunk)
        self._placement = None
        self._step = None  # a step begun under the old layout
        self._use(self.addresses, place(self._chunks, len(self.addresses)), 0)
        self._shards.seen.clear()
        self._shards.pushed.clear()
        # Residuals of the compressors belong to the old layout.
        self._feedback.clear()
        logger.info("placed %d tensors as %d chunks on %d shards, imbalance %.3f",
                    len(arrays), len(self._chunks), len(self.addresses), self.imbalance)
        flat = {name: array.reshape(-1) for name, array in arrays.items()}
        got = await self._run("init", 0, flat)
        for chunk in self._chunks:
            value = got[chunk.key]
            wanted = np.dtype(self._specs[chunk.name].dtype)
            if value.dtype != wanted:
                raise InvalidArgument(
                    f"{chunk.name!r}: the shards hold {value.dtype}, worker "
                    f"{self.worker} has {wanted}: the workers disagree on the model")
        return {name: join_chunks(spec, self._chunks_of[name], got)
                for name, spec in self._specs.items()}

    def push(self, grads: Mapping[str, Array]) -> asyncio.Task[None]:
        """Send this step's gradients; the task finishes when every shard took them.

        In sync mode the task waits while the shards still collect an
        earlier step of the other workers.

        Raises:
            FailedPrecondition: before :meth:`init`, or while a step begun
                with :meth:`begin_step` is incomplete.
            InvalidArgument: unknown names or wrong shapes.
            DeadlineExceeded: (from the task) the wait outlasted ``config.timeout``.
        """
        self._check_between_steps("push")
        clock, payloads, order = self._prepare(grads)

        async def push() -> None:
            with self._operation("push", clock):
                await self._run("push", clock, payloads, order=order)

        return asyncio.get_running_loop().create_task(push())

    def pull(self) -> asyncio.Task[dict[str, Array]]:
        """The parameters once this worker may read them at its clock.

        sync: after every worker's last pushed step was applied; ssp: when
        the slowest worker is at most ``staleness`` steps behind; async: now.
        A tensor held as one chunk arrives as a view of the received buffer.

        Raises:
            FailedPrecondition: before :meth:`init`, or while a step begun
                with :meth:`begin_step` is incomplete.
            DeadlineExceeded: (from the task) the wait outlasted
                ``config.timeout``; the message names the workers behind.
        """
        return self.pull_each().task  # type: ignore[return-value]

    def push_pull(self, grads: Mapping[str, Array]) -> asyncio.Task[dict[str, Array]]:
        """``push`` then ``pull`` in one round trip per shard message.

        Raises:
            What :meth:`push` and :meth:`pull` raise.
        """
        return self.push_pull_each(grads).task  # type: ignore[return-value]

    def pull_each(self) -> Arrivals:
        """:meth:`pull`, handing back each tensor as soon as it arrived.

        Raises:
            FailedPrecondition: before :meth:`init`, or while a step begun
                with :meth:`begin_step` is incomplete.
        """
        self._check_between_steps("pull")
        return self._arrivals("pull", self.clock, {}, None)

    def push_pull_each(self, grads: Mapping[str, Array]) -> Arrivals:
        """:meth:`push_pull`, handing back each tensor as soon as it arrived::

            arrivals = client.push_pull_each(grads)
            async for name, value in arrivals:   # forward order with priority
                ...

        Raises:
            What :meth:`push` and :meth:`pull` raise.
        """
        self._check_between_steps("push_pull")
        clock, payloads, order = self._prepare(grads)
        return self._arrivals("push_pull", clock, payloads, order)

    def begin_step(self) -> Step:
        """Begin a step whose gradients are pushed in parts, as they become
        ready (a DDP hook pushes each bucket as the backward pass hands it
        over)::

            step = client.begin_step()
            first = step.push_pull({"fc2.weight": g2, "fc2.bias": b2})
            rest = step.push_pull({"fc1.weight": g1, "fc1.bias": b1})

        Every part carries the step's clock; the step is complete once each
        tensor was pushed in exactly one part. The shards keep clocks and
        sums per chunk, so a step pushed in parts leaves them exactly where
        one :meth:`push` of the same gradients would (in every consistency
        mode, with compression and its error feedback too). Until the step
        is complete, :meth:`push`, :meth:`pull`, :meth:`push_pull` and the
        next ``begin_step`` are refused.

        Raises:
            FailedPrecondition: before :meth:`init`, or the previous step is
                incomplete (the error names the tensors it lacks).
        """
        self.placement  # noqa: B018 - raises before init()
        self._check_between_steps("begin_step")
        step = self._step = Step(self, self.clock, list(self._specs))
        self.clock += 1
        return step

    def _check_between_steps(self, what: str) -> None:
        step = self._step
        if step is not None and not step.complete:
            missing = step.missing
            raise FailedPrecondition(
                f"{what}() while step {step.clock} is incomplete: no gradient was pushed "
                f"for {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                f"({len(missing)} tensors)")

    def _arrivals(self, method: str, clock: int, payloads: Mapping[str, Any],
                  order: Mapping[str, int] | None, names: Sequence[str] | None = None,
                  first: bool = True) -> Arrivals:
        """The tensors ``names`` (default: all) of ``method`` at ``clock``
        as they arrive; ``first``: the operation opens its step (a
        rebalancing check may run before it)."""
        self.placement  # noqa: B018 - raises before init()
        names = list(self._specs) if names is None else list(names)
        arrivals = Arrivals(names)
        left = {name: len(self._chunks_of[name]) for name in names}
        part = (None if len(names) == len(self._specs)
                else {c.key for name in names for c in self._chunks_of[name]})
        got: dict[str, Any] = {}

        def arrived(keys: Sequence[str], values: Sequence[Any]) -> None:
            for key, value in zip(keys, values, strict=True):
                got[key] = value
                name = key.rpartition("#")[0]
                left[name] -= 1
                if left[name] == 0:
                    arrivals._deliver(name, join_chunks(self._specs[name],
                                                        self._chunks_of[name], got))

        async def run() -> dict[str, Array]:
            with self._operation(method, clock):
                try:
                    await self._run(method, clock, payloads, order=order, arrived=arrived,
                                    keys=part, first=first)
                except BaseException as exc:
                    arrivals._fail(exc)
                    raise
            return {name: arrivals[name].result() for name in names}

        arrivals.task = asyncio.get_running_loop().create_task(run())
        # Whoever reads only some tensors saw the error there already.
        arrivals.task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return arrivals

    async def checkpoint(self) -> list[str]:
        """Ask every shard to write a checkpoint now; returns their paths.

        Raises:
            FailedPrecondition: a shard has no checkpoint directory or no job.
        """
        paths: list[str] = await asyncio.gather(
            *(self._shards.call(a, Shard.checkpoint) for a in self.addresses))
        return paths

    async def status(self) -> list[dict[str, Any]]:
        """Each shard's clocks, chunk count, bytes, update count, placement
        version and host."""
        result: list[dict[str, Any]] = await asyncio.gather(
            *(self._shards.call(a, Shard.status) for a in self.addresses))
        return result

    # -- placement changes ------------------------------------------------------------

    async def reshard(self, addresses: Sequence[str], *,
                      placement: Placement | None = None) -> dict[str, Any]:
        """Move the parameters to another set of shards while training runs.

        One worker calls it, between two of its steps; the others learn the
        new placement when a shard redirects their next call. ``addresses``
        lists the shards of the new placement (new ones are started with
        ``tensorwire ps serve`` and hold nothing yet; ones left out give their
        chunks away and can then be stopped). Unless ``placement`` (over
        ``addresses``) is given, chunks stay where they are as far as the
        balance allows (:func:`relocate`): adding a shard to ``k`` moves about
        ``1/(k+1)`` of the bytes.

        Every shard switches to a new placement version; calls made with the
        old one are redirected, so no push lands on a shard that gave its
        chunk away. Each moving chunk travels through this worker with its
        value, optimizer state, clocks and any partly collected sync step,
        so no update is lost or applied twice. Returns ``{"version",
        "bytes_moved"`` (all the state that travelled), ``"parameter_bytes_moved"``
        (the moving chunks' own bytes), ``"chunks_moved", "seconds",
        "imbalance"}``.

        A change that did not finish (this call failed part-way, or the
        worker making it died) leaves the shards waiting for chunks, and
        calls to those chunks wait with them. The next ``reshard``, from
        this worker or any other, first finishes it: the chunks still on
        their way are taken from whichever known shard holds them, and the
        shards drop what they gave away. Then it makes the change asked for,
        if that is another one.

        Raises:
            FailedPrecondition: before :meth:`init`; another worker changed
                the placement at the same time; a change left unfinished
                cannot be finished because a chunk is on no shard that can
                be reached (one that left was stopped first).
            InvalidArgument: ``placement`` does not fit ``addresses``.
            Unavailable: a shard stayed unreachable (chunks already sent
                are kept on both sides; call again to finish).
        """
        return await _reshard.reshard(self, addresses, placement=placement)

    # -- bandwidth-aware balancing ------------------------------------------------------

    async def bandwidth(self) -> list[float | None]:
        """Per shard of the current placement: its effective bandwidth in
        bytes/s since the last call, from what the shard says it received and
        sent for this worker over the time this worker had calls to it in
        flight, less the time the shard says those calls waited for other
        workers. None where no bytes moved.
        """
        return await _rebalance.bandwidth(self)

    async def rebalance(self, *, threshold: float | None = None,
                        bandwidth: Sequence[float] | None = None) -> dict[str, Any]:
        """Move chunks from slow shards to fast ones when the predicted step
        time is uneven.

        The predicted time of a shard is its bytes over its effective
        bandwidth (:meth:`bandwidth`, measured since the previous call, or
        ``bandwidth`` given). When the largest is more than ``1 +
        threshold`` (``config.rebalance_threshold``) times the mean,
        :func:`balance` plans a placement that evens it out and, if that
        cuts the largest predicted time by more than the same fraction,
        :meth:`reshard` moves the chunks. Each shard's estimate is the mean
        of its last two measurements. Call it from one worker between
        steps. Returns ``{"bandwidth", "predicted", "imbalance",
        "rebalanced"}`` plus, when it moved chunks, :meth:`reshard`'s report
        and the new ``"predicted_after"``.

        Raises:
            What :meth:`reshard` raises.
        """
        return await _rebalance.rebalance(self, threshold=threshold, bandwidth=bandwidth)

    # -- internals --------------------------------------------------------------------

    def _prepare(self, grads: Mapping[str, Array]
                 ) -> tuple[int, dict[str, Payload], dict[str, int] | None]:
        """Check and compress the gradients and take a clock, all before any await."""
        self.placement  # noqa: B018 - raises before init()
        if set(grads) != set(self._specs):
            raise InvalidArgument(
                f"push() needs a gradient for each tensor: unknown "
                f"{sorted(set(grads) - set(self._specs))}, missing "
                f"{sorted(set(self._specs) - set(grads))}")
        payloads = self._compress(grads)
        clock = self.clock
        self.clock += 1
        # Without priorities messages go in the order the gradients came
        # (FIFO, as produced by the backward pass).
        order = None if self.config.priority else {name: i for i, name in enumerate(grads)}
        return clock, payloads, order

    def _compress(self, grads: Mapping[str, Array]) -> dict[str, Payload]:
        """The payload of each chunk of ``grads`` (known names), each through
        the error feedback of its shard's link class.

        Raises:
            InvalidArgument: a wrong shape; compression of a device array.
        """
        placement = self.placement
        flat: dict[str, Array] = {}
        for name, grad in grads.items():
            spec = self._specs[name]
            xp = array_module(grad)
            array = xp.asarray(grad)
            if array.shape != spec.shape:
                raise InvalidArgument(f"{name!r}: gradient shape {array.shape}, "
                                      f"parameter shape {spec.shape}")
            flat[name] = xp.ascontiguousarray(array, dtype=np.dtype(spec.dtype)).reshape(-1)
        links = [self.link_class(s) for s in range(placement.num_shards)]
        payloads: dict[str, Payload] = {}
        for chunk in (c for name in flat for c in self._chunks_of[name]):
            grad = flat[chunk.name][chunk.start:chunk.stop]
            link = links[placement.shard_of[chunk.key]]
            compressor = self._feedback.of(link).compressor
            if compressor.name != "none" and array_module(grad) is not np:
                raise InvalidArgument(
                    f"{chunk.name!r}: gradient compression ({compressor.name}) "
                    "runs on host arrays; push CuPy gradients uncompressed")
            payloads[chunk.key] = self._feedback.compress(chunk.key, grad, link)
        return payloads

    @contextlib.contextmanager
    def _operation(self, name: str, clock: int) -> Iterator[None]:
        """Count one operation in the metrics, and on the timeline if there is one."""
        timeline = self.config.timeline
        started = time.perf_counter()
        error = True
        self._running += 1
        try:
            yield
            error = False
        finally:
            self._running -= 1
            record_call(self._metrics[name], timeline, name, "ps", started, error,
                        {"worker": self.worker, "clock": clock})

    def metrics(self) -> dict[str, dict[str, Any]]:
        """Per operation (push, pull, push_pull): calls, errors, bytes out and
        in (compressed, as sent), latency p50/p90/p99 (s)."""
        return self._metrics.snapshot()

    async def _run(self, method: str, clock: int, data: Mapping[str, Any], *,
                   order: Mapping[str, int] | None = None,
                   arrived: Callable[[Sequence[str], Sequence[Any]], None] | None = None,
                   keys: set[str] | None = None, first: bool = True,
                   ) -> dict[str, Any]:
        """``method`` for every chunk (of ``keys``, default all), a message
        per batch, each through its shard's window; a batch redirected to a
        new placement is sent again under it. ``data``: per chunk key the
        payload (push, push_pull), per tensor name the flat values (init).
        ``first``: this opens its step, so a rebalancing check may run (a
        later part of a step does not check again). Returns the results per
        chunk."""
        if method in ("push", "push_pull") and first:
            await _rebalance.maybe_rebalance(self, clock)
        results: dict[str, Any] = {}
        while True:
            version = self.version
            if not results and order is None:
                batches = self._batches if keys is None else self._batches_of(keys)
            else:
                left = ({c.key for c in self._chunks} if keys is None else keys) - set(results)
                batches = _batches(self.placement, self.config.message_bytes,
                                   order or self._rank, left)
            tasks = [asyncio.ensure_future(self._send(b, method, clock, data, version,
                                                      order is not None))
                     for b in batches]
            moved: int | None = None
            try:
                for next_done in asyncio.as_completed(tasks):
                    try:
                        batch, result = await next_done
                    except PlacementMoved as exc:
                        # Sent again under the placement the shards moved on to.
                        moved = max(moved or 0, exc.version)
                        continue
                    values = result if isinstance(result, list) else [None] * len(batch.keys)
                    results.update(zip(batch.keys, values, strict=True))
                    if arrived is not None:
                        arrived(batch.keys, values)
            except BaseException:
                for task in tasks:
                    task.cancel()
                raise
            if moved is None:
                return results
            await _reshard.refresh(self, moved)

    def _batches_of(self, keys: set[str]) -> list[_Batch]:
        """The batches of the chunks ``keys`` (a part of a step), cached."""
        frozen = frozenset(keys)
        found = self._part_batches.get(frozen)
        if found is None:
            found = self._part_batches[frozen] = _batches(
                self.placement, self.config.message_bytes, self._rank, keys)
        return found

    async def _send(self, batch: _Batch, method: str, clock: int, data: Mapping[str, Any],
                    version: int, fifo: bool) -> tuple[_Batch, Any]:
        address = self.addresses[batch.shard] if version == self.version else None
        if address is None:
            raise PlacementMoved(f"worker {self.worker} moved on from placement version "
                                 f"{version} to {self.version}", version=self.version)
        shards = self._shards
        link = shards.link(address)
        wait = self.config.timeout
        keys = batch.keys
        seen = min((shards.seen.get(k, 0) for k in keys), default=0)
        items: list[Payload] = []
        if method in ("push", "push_pull"):
            items = [data[k] for k in keys]
            for key, item in zip(keys, items, strict=True):
                shards.pushed[key] = (clock, item)
        async with link.window.slot((clock,) if fifo else (clock, batch.rank)):
            if items:
                self._metrics[method].bytes_out += nbytes(items)
            with link.timing():
                result: Any
                if method == "init":
                    values = ([data[c.name][c.start:c.stop] for c in batch.chunks]
                              if self.worker == 0 else [])
                    result = await shards.call(
                        address, Shard.init, self.job.to_wire(), self.worker, keys, values,
                        [c.size for c in batch.chunks], wait, version=version)
                elif method == "pull":
                    result = await shards.read(address, (keys, clock), Shard.pull,
                                               self.worker, clock, keys, wait,
                                               version=version)
                elif method == "push":
                    result = await shards.call(address, Shard.push, self.worker, clock,
                                               keys, items, seen, wait, version=version)
                else:
                    result = await shards.read(address, (keys, clock), Shard.push_pull,
                                               self.worker, clock, keys, items, seen, wait,
                                               version=version)
        if method in ("pull", "push_pull"):
            self._metrics[method].bytes_in += nbytes(result)
            read_at = clock if method == "pull" else clock + 1
            for key in keys:
                shards.seen[key] = max(shards.seen.get(key, 0), read_at)
        return batch, result
