"""Process groups and their collective operations.

A group's operations run one at a time, in the order they were called, like
the operations on an NCCL stream: every rank must call the same operations
in the same order. Each call returns at once with an awaitable (an
``asyncio.Future``), so communication overlaps computation and several
operations can be queued. Because the order is fixed, every rank knows which
message comes next from each peer, and each receive is allocated straight
into its final place (the caller's array, or one reduction segment of
scratch): no message is copied after it lands.

Every message carries the operation's sequence number and a description of
the call (name, dtype, shape, root, reduction), so ranks that called
different things get a :class:`~tensorwire.errors.MismatchError` naming the
rank, not wrong numbers or a hang. After any failure the group is broken;
later operations raise the same error.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import (
    CollectiveError,
    ConfigError,
    InvalidArgument,
)
from . import _algorithms as algorithms
from . import _hierarchy as hierarchy
from . import _schedule as schedule
from ._algorithms import Algorithm
from ._arrays import Flat, ReduceOp, c_ordered, check_op, flatten, output
from ._environment import env_settings
from ._links import Links
from ._oplog import Op, OpLog
from ._p2p import PointToPoint
from ._runtime import Runtime
from .config import GroupConfig

__all__ = ("Algorithm", "Group")

logger = logging.getLogger(__name__)

def _check_root(root: int, size: int) -> None:
    if not isinstance(root, int) or not 0 <= root < size:
        raise InvalidArgument(f"root must be a rank of the group (0..{size - 1}), got {root!r}")


def _check_ring(algorithm: Algorithm, size: int, world_size: int) -> None:
    """A forced ``"ring"`` needs a block per rank: say so rather than run another algorithm.

    Raises:
        InvalidArgument: ``0 < size < world_size`` with ``algorithm="ring"``.
    """
    if algorithm == "ring" and 0 < size < world_size:
        raise InvalidArgument(
            f"algorithm='ring' needs at least one element per rank ({world_size}), the array "
            f"has {size}: use 'tree' or 'auto'")


class Group:
    """A set of processes (ranks) that run collective operations together.

    Create one with :meth:`create` or :meth:`from_env`; close it with
    :meth:`close` (or ``async with``). Operations take NumPy arrays, CuPy
    arrays or torch tensors (CPU or CUDA), which must be contiguous.

    Attributes:
        rank: this process's rank in the group, ``0 .. world_size - 1``.
        world_size: the number of ranks.
    """

    def __init__(self, runtime: Runtime, group_id: str, members: Sequence[int],
                 config: GroupConfig) -> None:
        self._runtime = runtime
        self.id = group_id
        self._members = tuple(members)
        self.rank = self._members.index(runtime.rank)
        self.world_size = len(self._members)
        self.config = config
        self._log = OpLog(runtime, group_id, self._members, self.rank, config)
        self._links = Links(self._log)
        self._p2p = PointToPoint(self._log, runtime)
        self._subgroups = 0
        self._children: list[Group] = []
        self._hierarchy: hierarchy.Hierarchy | None = None

    @classmethod
    async def create(
        cls,
        *,
        rank: int,
        world_size: int,
        master: str,
        listen: str | None = None,
        host_master: bool | None = None,
        config: GroupConfig | None = None,
    ) -> Group:
        """Join the group whose rendezvous is at ``master``.

        Args:
            rank: this process's rank, ``0 .. world_size - 1``.
            world_size: the number of processes.
            master: ``tcp://host:port`` of rank 0's rendezvous; rank 0 listens
                there, the others connect.
            listen: where this rank accepts data connections; the scheme picks
                the transport (``tcp://0.0.0.0:0``, ``ucx://0.0.0.0:0``). A
                wildcard host is advertised as the address of the interface
                that routes to the master. Default: ``tcp://0.0.0.0:0``.
            host_master: whether this rank serves the rendezvous at ``master``
                (default: rank 0 does). Pass ``False`` on every rank when a
                launcher serves it (:func:`serve_rendezvous`).
            config: timeouts, algorithm thresholds, transport settings.

        Raises:
            ConfigError: a rank or size out of range, or a malformed address.
            TensorwireError: the rendezvous failed (timeout, duplicate rank,
                disagreeing world sizes, unreachable peers).
        """
        config = config or GroupConfig()
        if not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size must be a positive int, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ConfigError(f"rank must be in 0..{world_size - 1}, got {rank!r}")
        if not master.startswith("tcp://"):
            raise ConfigError(f"the master address must be tcp://host:port, got {master!r}")
        placed = None if config.topology is None else hierarchy.hierarchy(config.topology).size
        if placed is not None and placed != world_size:
            raise ConfigError(f"GroupConfig.topology places {placed} ranks, the world has "
                              f"{world_size}")
        if listen is not None and listen.startswith("inproc://"):
            # inproc:// hands the receiver the sender's own buffers, which an
            # in-place operation goes on to change: use tcp:// on loopback.
            raise ConfigError("collectives need tcp:// or ucx:// data connections, not inproc://")
        runtime = Runtime(rank, world_size, config)
        group = cls(runtime, "0", range(world_size), config)
        try:
            await runtime.start(master, listen or "tcp://0.0.0.0:0",
                                rank == 0 if host_master is None else host_master,
                                group._on_event)
            await group._connect()
        except BaseException:
            await group._abandon()
            raise
        logger.info("rank %d of %d joined the group at %s", rank, world_size, master)
        return group

    @classmethod
    async def from_env(
        cls,
        *,
        listen: str | None = None,
        config: GroupConfig | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Group:
        """Join the group described by the launcher's environment.

        Understands torchrun (``RANK``, ``WORLD_SIZE``), Slurm
        (``SLURM_PROCID``, ``SLURM_NTASKS``) and Open MPI
        (``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``); the rendezvous is
        ``MASTER_ADDR:MASTER_PORT`` (see :func:`env_settings` for the details).
        ``TENSORWIRE_LISTEN`` sets ``listen`` when the argument is not given.

        Raises:
            ConfigError: the environment names no rank, world size or master.
        """
        env = os.environ if environ is None else environ
        settings = env_settings(env)
        listen = listen or env.get("TENSORWIRE_LISTEN") or None
        return await cls.create(rank=settings.rank, world_size=settings.world_size,
                                master=settings.master, listen=listen,
                                host_master=settings.host_master, config=config)

    async def _connect(self) -> None:
        self._runtime.track(self.id, self._log.status)
        await self._links.connect(self._runtime)

    async def new_group(self, ranks: Sequence[int]) -> Group | None:
        """A subgroup of the given ranks of this group, in that order.

        Every rank of this group must call it, in the same order relative to
        other ``new_group`` calls (as ``torch.distributed.new_group``). The
        subgroup has its own connections and sequence of operations; ranks
        not in it get ``None``.

        Raises:
            InvalidArgument: a rank repeats or is not in this group.
        """
        members = list(ranks)
        if len(set(members)) != len(members) or not members:
            raise InvalidArgument(f"a subgroup needs distinct ranks, got {members}")
        for r in members:
            if not isinstance(r, int) or not 0 <= r < self.world_size:
                raise InvalidArgument(f"rank {r!r} is not in this group of {self.world_size}")
        self._subgroups += 1
        group_id = f"{self.id}.{self._subgroups}"
        if self.rank not in members:
            return None
        group = Group(self._runtime, group_id, [self._members[r] for r in members], self.config)
        self._children.append(group)
        await group._connect()
        return group

    @property
    def topology(self) -> dict[str, list[int]]:
        """Which ranks share a host: host name -> ranks of this group on it.

        Learned at the rendezvous from each rank's host name and the address
        it listens on (ranks that share a name but not an address are on
        different hosts), unless ``GroupConfig.topology`` says otherwise.
        """
        hosts = self._runtime.hosts()
        out: dict[str, list[int]] = {}
        for rank, member in enumerate(self._members):
            out.setdefault(hosts[member], []).append(rank)
        return out

    def _hier(self) -> hierarchy.Hierarchy:
        if self._hierarchy is None:
            self._hierarchy = hierarchy.hierarchy(self.topology)
        return self._hierarchy

    def metrics(self) -> dict[str, dict[str, Any]]:
        """Per operation: calls, errors, bytes in and out, latency p50/p90/p99 (s)."""
        return self._log.metrics()

    def _on_event(self, event: dict[str, Any]) -> None:
        """News from rank 0 (a rank failed, an operation failed elsewhere)."""
        for group in (self, *self._descendants()):
            group._log.hear(event)

    def _descendants(self) -> list[Group]:
        out = []
        for child in self._children:
            out.append(child)
            out.extend(child._descendants())
        return out

    def _choose(self, nbytes: int, algorithm: Algorithm, *, hierarchical: bool = True
                ) -> tuple[bool, hierarchy.Hierarchy | None]:
        return algorithms.choose(self.config, nbytes, algorithm, self._hier,
                                 hierarchical=hierarchical)

    def allreduce(
        self, x: Any, op: ReduceOp | str = ReduceOp.SUM, *, algorithm: Algorithm = "auto",
        timeout: float | None = None,
    ) -> asyncio.Future[Any]:
        """Reduce ``x`` over all ranks, in place; every rank gets the result.

        Large arrays use the pipelined ring (reduce-scatter, then allgather),
        small ones recursive doubling (see ``GroupConfig.small_bytes``).
        ``ReduceOp.AVG`` needs a floating dtype, ``BAND``/``BOR``/``BXOR``
        an integer one. ``MIN``/``MAX`` propagate NaN (NumPy's rule; gloo
        keeps or drops a NaN depending on which rank holds it). The result
        is ``x`` itself, and bitwise identical on every rank, NaN signs and
        signed zeros included.

        Raises:
            InvalidArgument: ``x`` is not a contiguous, writable array; the
                reduction does not suit its dtype; ``algorithm="ring"`` on
                fewer elements than ranks.
            MismatchError, RankFailedError, CollectiveTimeout: see the module.
        """
        flat = flatten(x)
        reduce = check_op(op, flat)
        _check_ring(algorithm, flat.size, self.world_size)
        large, hier = self._choose(flat.nbytes, algorithm)

        async def body(o: Op) -> Any:
            await algorithms.allreduce_flat(self._links, o, flat, reduce, large, hier)
            return flat.result()

        return self._log.submit(f"allreduce({flat.describe()},{reduce.value}{_mark(hier)})",
                                body, timeout)

    def allreduce_many(
        self, tensors: Sequence[Any], op: ReduceOp | str = ReduceOp.SUM, *,
        priorities: Sequence[float] | None = None, bucket_bytes: int = 4 << 20,
        algorithm: Algorithm = "auto", timeout: float | None = None,
    ) -> list[asyncio.Future[Any]]:
        """Allreduce many arrays (a model's gradients), most urgent first.

        The arrays are taken in order of ``priorities`` (lower is more
        urgent; default: their order in the list, ties too), and consecutive
        ones of one dtype and device are fused into buckets of at most
        ``bucket_bytes``: a bucket is one operation on a scratch array the
        arrays are copied into and back out of (an array of
        ``bucket_bytes`` or more is a bucket of its own and is reduced in
        place, with no copy). The buckets queue in priority order, so with
        gradients listed as the backward pass produces them (last layer
        first) and ``priorities`` the order in which the next forward pass
        needs them, the first layer's gradient is back after one bucket
        rather than after all of them (ByteScheduler: Peng et al., SOSP 2019).

        The order is a pure function of the call, so every rank must pass
        the same shapes, dtypes and priorities (else ``MismatchError``).

        Returns:
            One future per array, in the order given: it resolves to the
            array (reduced in place) as soon as its bucket is done.

        Raises:
            InvalidArgument: an array is not contiguous and writable, or the
                priorities do not match the arrays.
        """
        flats = [flatten(t, name=f"tensors[{i}]") for i, t in enumerate(tensors)]
        reduces = [check_op(op, f) for f in flats]
        reduce = reduces[0] if reduces else ReduceOp(op)
        ranks = list(range(len(flats))) if priorities is None else list(priorities)
        if len(ranks) != len(flats):
            raise InvalidArgument(f"{len(ranks)} priorities for {len(flats)} tensors")
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise InvalidArgument(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        self._choose(0, algorithm)  # validates the name
        buckets = schedule.buckets([(f.dtype.str, f.device, type(f.array)) for f in flats],
                                   [f.nbytes for f in flats], ranks, bucket_bytes)
        for bucket in buckets:  # before anything is queued
            _check_ring(algorithm, sum(flats[i].size for i in bucket), self.world_size)
        loop = asyncio.get_running_loop()
        out: list[asyncio.Future[Any]] = [loop.create_future() for _ in flats]
        for bucket in buckets:
            if len(bucket) == 1:
                (i,) = bucket
                done = self.allreduce(tensors[i], op, algorithm=algorithm, timeout=timeout)
            else:
                done = self._fused_allreduce([flats[i] for i in bucket], reduce, algorithm,
                                             timeout)
            done.add_done_callback(functools.partial(_settle_many, [out[i] for i in bucket],
                                                     [flats[i].result() for i in bucket]))
        return out

    def _fused_allreduce(self, parts: list[Flat], reduce: ReduceOp, algorithm: Algorithm,
                         timeout: float | None) -> asyncio.Future[Any]:
        """One allreduce of ``parts`` copied into one scratch array, and back."""
        first = parts[0]
        total = sum(p.size for p in parts)
        large, hier = self._choose(total * first.itemsize, algorithm)
        sizes = ",".join(str(p.size) for p in parts)
        if len(parts) > 8:  # keep the header short; still tells other splits apart
            sizes = f"{len(parts)}x{total}#{zlib.crc32(sizes.encode()):08x}"
        return self._log.submit(
            f"allreduce_bucket({first.dtype.str}[{sizes}]@{first.device},"
            f"{reduce.value}{_mark(hier)})",
            lambda o: algorithms.run_allreduce_bucket(self._links, o, parts, reduce, large, hier),
            timeout)

    def reduce(self, x: Any, root: int = 0, op: ReduceOp | str = ReduceOp.SUM, *,
               algorithm: Algorithm = "auto", timeout: float | None = None) -> asyncio.Future[Any]:
        """Reduce ``x`` over all ranks into ``x`` on ``root``.

        On the other ranks ``x`` serves as workspace and holds unspecified
        values afterwards (it is not copied). Returns ``x``.

        Raises:
            InvalidArgument: as :meth:`allreduce`.
        """
        flat = flatten(x)
        reduce = check_op(op, flat)
        _check_root(root, self.world_size)
        _check_ring(algorithm, flat.size, self.world_size)
        large, _ = self._choose(flat.nbytes, algorithm, hierarchical=False)
        return self._log.submit(
            f"reduce({flat.describe()},{reduce.value},root={root})",
            lambda o: algorithms.run_reduce(self._links, o, flat, reduce, large, root), timeout)

    def broadcast(self, x: Any, root: int = 0, *, algorithm: Algorithm = "auto",
                  timeout: float | None = None) -> asyncio.Future[Any]:
        """Copy ``x`` from ``root`` into ``x`` on every rank; returns ``x``.

        Small arrays follow a binomial tree, large ones a pipelined chain.
        """
        _check_root(root, self.world_size)
        flat = flatten(x, writable=self.rank != root)
        large, hier = self._choose(flat.nbytes, algorithm)
        return self._log.submit(
            f"broadcast({flat.describe()},root={root}{_mark(hier)})",
            lambda o: algorithms.run_broadcast(self._links, o, flat, large, hier, root), timeout)

    def allgather(self, x: Any, *, out: Any = None, algorithm: Algorithm = "auto",
                  timeout: float | None = None) -> asyncio.Future[Any]:
        """Every rank's ``x``, stacked: ``out[i]`` is rank ``i``'s.

        ``out`` (shape ``(world_size, *x.shape)``, same kind and dtype) is
        allocated when not given; receives land in it directly. Small arrays
        use Bruck's algorithm, large ones the ring.
        """
        flat = c_ordered(flatten(x, writable=False), "allgather")
        n = self.world_size
        shape = (n, *flat.shape)
        target = output(flat, out, shape)
        large, hier = self._choose(flat.nbytes * n, algorithm)
        return self._log.submit(
            f"allgather({flat.describe()}{_mark(hier)})",
            lambda o: algorithms.run_allgather(self._links, o, flat, target, large, hier), timeout)

    def reduce_scatter(self, x: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                       algorithm: Algorithm = "auto",
                       timeout: float | None = None) -> asyncio.Future[Any]:
        """Reduce ``x`` over all ranks; rank ``r`` gets part ``r`` of the result.

        ``x`` is split along its first axis into ``world_size`` nearly equal
        parts (as ``np.array_split``). The result is a view of ``x`` (its
        part); the rest of ``x`` serves as workspace.
        """
        flat = flatten(x)
        reduce = check_op(op, flat)
        if not flat.shape:
            raise InvalidArgument("reduce_scatter needs an array of at least one dimension")
        if flat.order != "C":
            raise InvalidArgument("reduce_scatter needs a C-ordered array")
        n = self.world_size
        rows = schedule.split(flat.shape[0], n)
        row = flat.size // flat.shape[0] if flat.shape[0] else 0
        bounds = [(lo * row, hi * row) for lo, hi in rows]
        large, _ = self._choose(flat.nbytes, algorithm, hierarchical=False)
        return self._log.submit(
            f"reduce_scatter({flat.describe()},{reduce.value})",
            lambda o: algorithms.run_reduce_scatter(self._links, o, flat, reduce, bounds, large,
                                                    rows[self.rank]),
            timeout)

    def gather(self, x: Any, root: int = 0, *, out: Any = None,
               timeout: float | None = None) -> asyncio.Future[Any]:
        """Every rank's ``x`` stacked on ``root`` (``None`` elsewhere)."""
        _check_root(root, self.world_size)
        flat = c_ordered(flatten(x, writable=False), "gather")
        n = self.world_size
        shape = (n, *flat.shape)
        target: Flat | None = None
        if self.rank == root:
            target = output(flat, out, shape)
        return self._log.submit(
            f"gather({flat.describe()},root={root})",
            lambda o: algorithms.run_gather(self._links, o, flat, target, root), timeout)

    def scatter(self, out: Any, parts: Any = None, root: int = 0, *,
                timeout: float | None = None) -> asyncio.Future[Any]:
        """Part ``r`` of ``parts`` (on ``root``, shape ``(world_size, *out.shape)``)
        into ``out`` on rank ``r``; returns ``out``."""
        _check_root(root, self.world_size)
        flat = c_ordered(flatten(out, name="out"), "scatter")
        n = self.world_size
        source: Flat | None = None
        if self.rank == root:
            if parts is None:
                raise InvalidArgument("the root of a scatter must pass parts")
            source = c_ordered(flatten(parts, writable=False, name="parts"), "scatter")
            if source.shape != (n, *flat.shape) or source.dtype != flat.dtype:
                raise InvalidArgument(
                    f"parts must be a {flat.dtype} array of shape {(n, *flat.shape)}")
        return self._log.submit(
            f"scatter({flat.describe()},root={root})",
            lambda o: algorithms.run_scatter(self._links, o, flat, source, root), timeout)

    def alltoall(self, x: Any, *, out: Any = None,
                 timeout: float | None = None) -> asyncio.Future[Any]:
        """``x[j]`` goes to rank ``j``; ``out[i]`` is what rank ``i`` sent here.

        ``x`` has shape ``(world_size, ...)``; ``out`` (allocated when not
        given) has the same shape, and receives land in it directly.
        """
        flat = flatten(x, writable=False)
        n = self.world_size
        if not flat.shape or flat.shape[0] != n or flat.order != "C":
            raise InvalidArgument(f"alltoall needs a C-ordered array of shape ({n}, ...)")
        target = output(flat, out, flat.shape)
        return self._log.submit(
            f"alltoall({flat.describe()})",
            lambda o: algorithms.run_alltoall(self._links, o, flat, target), timeout)

    def barrier(self, *, timeout: float | None = None) -> asyncio.Future[None]:
        """Wait until every rank has reached the barrier (dissemination, log2 rounds)."""
        return self._log.submit(
            "barrier()",
            lambda o: algorithms.run_barrier(self._links, o), timeout)

    async def send(self, x: Any, dst: int, *, tag: int = 0, timeout: float | None = None) -> None:
        """Send ``x`` to rank ``dst``, to be received by its ``recv(…, src=this rank)``.

        Point-to-point messages run outside the collective order and are
        delivered by ``tag``, as torch.distributed delivers them: a pair's
        messages of one tag in the order they were sent, whatever the order
        of the receives of different tags; the array description must match
        the receiver's (else ``MismatchError``). A send that times out once its bytes started to
        go is still delivered (the transport finishes the message, which
        keeps the pair's stream in step); one that had not started is not.
        """
        await self._p2p.send(x, dst, tag=tag, timeout=timeout)

    async def recv(self, out: Any, src: int, *, tag: int = 0,
                   timeout: float | None = None) -> Any:
        """Receive rank ``src``'s next ``send`` straight into ``out``; returns ``out``.

        A receive that times out while its message is arriving leaves that
        message to the next ``recv`` (which gets a copy of it), but ``out``
        may still be written after the timeout.

        Raises:
            MismatchError: the message of this tag has another dtype or shape.
            CollectiveTimeout: nothing arrived in time.
            RankFailedError: ``src`` went away.
        """
        return await self._p2p.recv(out, src, tag=tag, timeout=timeout)

    async def close(self) -> None:
        """Leave the group: pending operations fail, connections close politely.

        Closing the root group closes its subgroups and leaves the rendezvous;
        rank 0 waits (up to ``rendezvous_timeout``) for the others to leave
        before it stops serving it.
        """
        if self._log.closed:
            return
        for child in self._children:
            await child.close()
        error = CollectiveError(f"group {self.id} was closed")
        await self._log.close(error)
        # Our peers should hear why we failed before they see us hang up.
        await self._runtime.flush()
        conns = [*self._links.peers.values(), *self._p2p.connections()]
        failed = self._log.failed
        if failed is not None and failed is not error:
            # A broken group's streams are in no known state, and a send to a
            # dead peer may never finish: nothing is worth a polite goodbye.
            for conn in conns:
                conn.abort()
        else:
            await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
        if self.id == "0":
            await self._runtime.close()

    async def _abandon(self) -> None:
        for conn in self._links.peers.values():
            conn.abort()
        await self._runtime.close()

    async def __aenter__(self) -> Group:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<Group {self.id} rank {self.rank} of {self.world_size}>"


def _mark(hier: hierarchy.Hierarchy | None) -> str:
    """What a hierarchical call adds to its description, so that ranks that
    chose differently are told apart by the first message."""
    return "" if hier is None else ",hierarchical"


def _settle_many(futures: Sequence[asyncio.Future[Any]], results: Sequence[Any],
                 done: asyncio.Future[Any]) -> None:
    """Pass a bucket's outcome on to the futures of its arrays."""
    error = None if done.cancelled() else done.exception()
    for future, result in zip(futures, results, strict=True):
        if future.done():
            continue
        if done.cancelled():
            future.cancel()
        elif error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
