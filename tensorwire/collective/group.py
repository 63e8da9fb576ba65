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
import contextlib
import dataclasses
import functools
import logging
import os
import struct
import time
import zlib
from collections import deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from .._metrics import Metrics
from ..errors import (
    CollectiveError,
    CollectiveTimeout,
    ConfigError,
    ConnectionClosedError,
    InvalidArgument,
    MismatchError,
    RankFailedError,
    TransportError,
)
from ..transports import Connection, FrameInfo, default_allocator
from . import _hierarchy as hierarchy
from . import _schedule as schedule
from ._arrays import BITWISE, Flat, ReduceOp, flatten
from ._runtime import Runtime
from .config import GroupConfig

__all__ = ("Algorithm", "Group")

logger = logging.getLogger(__name__)

Algorithm = Literal["auto", "ring", "tree", "hierarchical"]
_HEAD = struct.Struct("<QI")
#: Step number of the message that returns a folded rank's result.
_RETURN_STEP = 0xFFFF_FFFF
#: A message this small fits the socket buffers of any peer, so sending it
#: before receiving cannot deadlock and needs no task of its own.
_EAGER_BYTES = 4096
_STATUS_TIMEOUT = 2.0
#: How long a broken connection waits for rank 0's word on why.
_NEWS_GRACE = 1.0


@dataclasses.dataclass(slots=True)
class _Op:
    seq: int
    sig: bytes
    body: Callable[[_Op], Coroutine[Any, Any, Any]]
    timeout: float
    future: asyncio.Future[Any]
    done: bool = False
    bytes_in: int = 0
    bytes_out: int = 0

    @property
    def name(self) -> str:
        return self.sig.partition(b"(")[0].decode()


async def _all(*coros: Coroutine[Any, Any, Any]) -> None:
    """Run ``coros`` concurrently; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        for task in tasks:
            # Whatever the others end with is ours to collect, not asyncio's
            # "exception was never retrieved".
            task.add_done_callback(_collect)
            if not task.done():
                task.cancel()


def _collect(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _check_root(root: int, size: int) -> None:
    if not isinstance(root, int) or not 0 <= root < size:
        raise InvalidArgument(f"root must be a rank of the group (0..{size - 1}), got {root!r}")


def _check_op(op: ReduceOp | str, flat: Flat) -> ReduceOp:
    try:
        op = ReduceOp(op)
    except ValueError:
        raise InvalidArgument(f"unknown reduction {op!r}") from None
    if op is ReduceOp.AVG and flat.dtype.kind not in "fc" and flat.dtype.name != "bfloat16":
        raise InvalidArgument(f"ReduceOp.AVG needs a floating dtype, got {flat.dtype}")
    if op in BITWISE and flat.dtype.kind not in "iub":
        raise InvalidArgument(f"ReduceOp.{op.name} needs an integer or bool dtype, "
                              f"got {flat.dtype}")
    return op


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
        self._peers: dict[int, Connection] = {}
        self._p2p_out: dict[int, Connection] = {}
        self._p2p_in: dict[int, Connection] = {}
        self._p2p_locks: dict[tuple[str, int], asyncio.Lock] = {}
        #: Received messages whose tag no recv asked for yet: peer -> tag -> frames.
        self._p2p_early: dict[int, dict[int, deque[list[Any]]]] = {}
        self._queue: deque[_Op] = deque()
        self._worker: asyncio.Task[None] | None = None
        self._seq = 0
        self._current: _Op | None = None
        self._waiting_on: int | None = None
        self._failed: CollectiveError | None = None
        self._news = asyncio.Event()
        self._closed = False
        self._subgroups = 0
        self._children: list[Group] = []
        self._metrics = Metrics()
        self._hierarchy: hierarchy.Hierarchy | None = None

    # -- creation -------------------------------------------------------------

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
        """Open a data connection to every other rank (the higher rank dials)."""
        async def link(peer: int) -> None:
            if peer < self.rank:
                conn = await self._runtime.dial(self._members[peer], self.id, "coll")
            else:
                conn = await self._runtime.incoming(self.id, self._members[peer], "coll")
            self._peers[peer] = conn

        self._runtime.track(self.id, self._status)
        peers = [p for p in range(self.world_size) if p != self.rank]
        try:
            async with asyncio.timeout(self.config.rendezvous_timeout):
                await _all(*(link(p) for p in peers))
        except TimeoutError:
            missing = sorted(p for p in peers if p not in self._peers)
            raise RankFailedError(
                f"group {self.id}: no data connection with ranks {missing} "
                f"within {self.config.rendezvous_timeout} s", ranks=tuple(missing),
            ) from None
        except TransportError as exc:
            raise RankFailedError(f"group {self.id}: cannot connect the ranks: {exc}") from exc

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

    # -- the operation queue ---------------------------------------------------

    def _submit(self, describe: str, body: Callable[[_Op], Coroutine[Any, Any, Any]],
                timeout: float | None) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if self._closed:
            raise CollectiveError(f"group {self.id} is closed")
        if self._failed is not None:
            raise self._failed
        if timeout is not None and not timeout > 0:
            raise InvalidArgument(f"timeout must be positive, got {timeout!r}")
        op = _Op(self._seq, describe.encode(), body,
                 self.config.timeout if timeout is None else timeout, future)
        self._seq += 1
        self._queue.append(op)
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._drain())
        return future

    async def _drain(self) -> None:
        while self._queue:
            op = self._queue.popleft()
            self._current = op
            started = time.perf_counter()
            try:
                result = await self._run(op)
            except asyncio.CancelledError:
                # Cancelled by news of a failure elsewhere (or by close()).
                error = self._failed or CollectiveError(
                    f"group {self.id}: the operation queue was cancelled")
                self._observe(op, started, error)
                self._fail_all(op, error)
                if self._failed is None:
                    raise
                return
            except CollectiveError as exc:
                self._observe(op, started, exc)
                self._break(exc)
                self._fail_all(op, exc)
                return
            self._observe(op, started, None)
            op.done = True
            if not op.future.done():
                op.future.set_result(result)

    def _observe(self, op: _Op, started: float, error: BaseException | None) -> None:
        """Count ``op`` in the metrics, and on the timeline when there is one."""
        seconds = time.perf_counter() - started
        name = op.name
        metrics = self._metrics[name]
        metrics.bytes_in += op.bytes_in
        metrics.bytes_out += op.bytes_out
        metrics.observe(seconds, error is not None)
        timeline = self.config.timeline
        if timeline is not None:
            args: dict[str, Any] = {"seq": op.seq, "call": op.sig.decode(), "group": self.id,
                                    "rank": self.rank, "bytes_in": op.bytes_in,
                                    "bytes_out": op.bytes_out}
            if error is not None:
                args["error"] = repr(error)
            timeline.add_since(name, "collective", started, **args)

    def metrics(self) -> dict[str, dict[str, Any]]:
        """Per operation: calls, errors, bytes in and out, latency p50/p90/p99 (s)."""
        return self._metrics.snapshot()

    async def _run(self, op: _Op) -> Any:
        """Run ``op`` within its deadline; every failure becomes a CollectiveError."""
        try:
            async with asyncio.timeout(op.timeout):
                return await op.body(op)
        except TimeoutError:
            raise await self._timed_out(op) from None
        except CollectiveError:
            raise
        except Exception as exc:
            raise CollectiveError(f"{op.sig.decode()} #{op.seq} failed: {exc!r}") from exc

    def _fail_all(self, op: _Op, error: CollectiveError) -> None:
        op.done = True
        for each in (op, *self._queue):
            if not each.future.done():
                each.future.set_exception(error)
        self._queue.clear()

    def _break(self, error: CollectiveError) -> None:
        """The group is broken: remember why, and tell the other ranks."""
        if self._failed is not None:
            return
        self._failed = error
        logger.error("group %s on rank %d failed: %s", self.id, self.rank, error)
        self._runtime.report({
            "kind": "abort", "group": self.id, "rank": self._runtime.rank,
            "error": type(error).__name__, "reason": str(error),
            "ranks": [self._members[r] for r in error.ranks],
        })

    def _on_event(self, event: dict[str, Any]) -> None:
        """News from rank 0 (a rank failed, an operation failed elsewhere)."""
        for group in (self, *self._descendants()):
            group._hear(event)

    def _descendants(self) -> list[Group]:
        out = []
        for child in self._children:
            out.append(child)
            out.extend(child._descendants())
        return out

    def _hear(self, event: dict[str, Any]) -> None:
        if self._failed is not None or self._closed:
            return
        world_rank = int(event.get("rank", -1))
        if event.get("kind") == "failed":
            if world_rank not in self._members:
                return
            rank = self._members.index(world_rank)
            reason = event.get("reason") or "its process exited or its link to rank 0 broke"
            error: CollectiveError = RankFailedError(
                f"group {self.id}: rank {rank} failed: {reason}", ranks=(rank,))
        elif event.get("kind") == "abort" and event.get("group") == self.id:
            ranks = tuple(self._members.index(r) for r in event.get("ranks", ())
                          if r in self._members)
            cls: type[CollectiveError] = {
                "MismatchError": MismatchError, "CollectiveTimeout": CollectiveTimeout,
                "RankFailedError": RankFailedError,
            }.get(str(event.get("error")), CollectiveError)
            error = cls(f"rank {self._members.index(world_rank)} reported: {event.get('reason')}",
                        ranks=ranks)
        else:
            return
        self._failed = error
        self._news.set()
        logger.error("group %s on rank %d failed: %s", self.id, self.rank, error)
        if self._worker is not None and not self._worker.done():
            self._worker.cancel()

    def _status(self) -> dict[str, Any]:
        op = self._current
        if op is None:
            return {"seq": -1, "op": "", "done": True}
        return {"seq": op.seq, "op": op.sig.decode(), "done": op.done}

    async def _statuses(self) -> dict[int, dict[str, Any] | None]:
        """Every other rank's :meth:`_status` (``None`` where it does not answer)."""
        peers = [p for p in range(self.world_size) if p != self.rank]
        answers = await asyncio.gather(*(
            self._runtime.peer_status(self._members[p], self.id, _STATUS_TIMEOUT) for p in peers
        ))
        return dict(zip(peers, answers, strict=True))

    async def _timed_out(self, op: _Op) -> CollectiveTimeout:
        """Ask every rank where it is, and name those that had not reached ``op``."""
        behind: list[int] = []
        notes: list[str] = []
        for peer, status in (await self._statuses()).items():
            if status is None:
                behind.append(peer)
                notes.append(f"rank {peer} does not answer")
            elif status["seq"] < op.seq or (status["seq"] == op.seq and status["done"]):
                if status["seq"] < op.seq:
                    behind.append(peer)
                where = f"#{status['seq']} {status['op']}" if status["seq"] >= 0 else "no operation"
                state = "finished" if status["done"] else "running"
                notes.append(f"rank {peer} is at {where} ({state})")
        if not behind and self._waiting_on is not None:
            behind.append(self._waiting_on)
            notes.append(f"rank {self._waiting_on} has not sent what rank {self.rank} waits for")
        detail = "; ".join(notes) or "every rank is in it"
        return CollectiveTimeout(
            f"{op.sig.decode()} #{op.seq} on rank {self.rank} did not finish within "
            f"{op.timeout} s: {detail}", ranks=tuple(sorted(behind)),
        )

    # -- messages --------------------------------------------------------------

    async def _send(self, peer: int, op: _Op, step: int, frames: Sequence[Any]) -> None:
        op.bytes_out += sum(_nbytes(f) for f in frames)
        try:
            await self._peers[peer].send([_HEAD.pack(op.seq, step) + op.sig, *frames])
        except ConnectionClosedError as exc:
            raise await self._lost(peer, exc) from exc

    async def _recv(self, peer: int, op: _Op, step: int, frames: Sequence[Any]) -> None:
        """Receive ``peer``'s message of ``op`` straight into ``frames``."""
        sizes = [_nbytes(f) for f in frames]
        op.bytes_in += sum(sizes)

        def allocate(info: FrameInfo) -> Any:
            index = info.index - 1
            if index < 0:
                return bytearray(info.nbytes)  # the header
            if index < len(frames) and info.nbytes == sizes[index] and (
                (info.device == "cuda") == hasattr(frames[index], "__cuda_array_interface__")
            ):
                return frames[index]
            # Not what we expect: land it aside; the header check below says why.
            return default_allocator(info)

        self._waiting_on = peer
        try:
            got = await self._peers[peer].recv(allocator=allocate)
        except ConnectionClosedError as exc:
            raise await self._lost(peer, exc) from exc
        finally:
            self._waiting_on = None
        header = bytes(got[0])
        if header[_HEAD.size:] != op.sig or _HEAD.unpack_from(header) != (op.seq, step) or [
            _nbytes(f) for f in got[1:]
        ] != sizes:
            raise await self._mismatch(peer, op, header)
        _settle(frames, got[1:])

    async def _lost(self, peer: int, exc: BaseException) -> CollectiveError:
        """The error for a broken connection to ``peer``.

        A rank whose operation failed tells rank 0 and may then close its
        connections; give that news a moment to arrive, so that the error
        names the cause rather than the messenger.
        """
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._news.wait(), _NEWS_GRACE)
        return self._failed or RankFailedError(
            f"group {self.id}: the connection to rank {peer} broke ({exc})", ranks=(peer,))

    async def _mismatch(self, peer: int, op: _Op, header: bytes) -> MismatchError:
        """Name the ranks whose call differs from what most ranks called."""
        try:
            seq, _ = _HEAD.unpack_from(header)
            theirs = f"#{seq} {header[_HEAD.size:].decode()}"
        except (struct.error, UnicodeDecodeError):
            theirs = f"something unreadable ({header[:32]!r})"
        calls = {self.rank: f"#{op.seq} {op.sig.decode()}", peer: theirs}
        for other, status in (await self._statuses()).items():
            if other not in calls and status is not None and status["seq"] >= 0:
                calls[other] = f"#{status['seq']} {status['op']}"
        by_call: dict[str, list[int]] = {}
        for rank in sorted(calls):
            by_call.setdefault(calls[rank], []).append(rank)
        ranked = sorted(by_call.values(), key=len, reverse=True)
        if len(ranked) > 1 and len(ranked[0]) > len(ranked[1]):
            odd = sorted(r for ranks in ranked[1:] for r in ranks)
        else:
            odd = sorted({self.rank, peer})
        detail = "; ".join(
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} called {call}"
            for call, ranks in by_call.items()
        )
        return MismatchError(f"group {self.id}: the ranks called different operations: "
                             f"{detail}", ranks=tuple(odd))

    async def _exchange(self, op: _Op, step: int, dst: int, send: Sequence[Any],
                        src: int, recv: Sequence[Any]) -> None:
        """Send to ``dst`` and receive from ``src`` at the same time."""
        if sum(_nbytes(f) for f in send) <= _EAGER_BYTES:
            await self._send(dst, op, step, send)
            await self._recv(src, op, step, recv)
        else:
            await _all(self._send(dst, op, step, send), self._recv(src, op, step, recv))

    def _per_segment(self, flat: Flat) -> int:
        return max(1, self.config.segment_bytes // max(flat.itemsize, 1))

    def _large(self, nbytes: int, algorithm: Algorithm, *, hierarchical: bool = False) -> bool:
        allowed = ("auto", "ring", "tree", "hierarchical") if hierarchical else (
            "auto", "ring", "tree")
        if algorithm not in allowed:
            raise InvalidArgument(
                f"algorithm must be one of {', '.join(map(repr, allowed))}, got {algorithm!r}")
        if algorithm == "auto":
            return nbytes > self.config.small_bytes
        return algorithm == "ring"

    def _hierarchical(self, nbytes: int, algorithm: Algorithm) -> hierarchy.Hierarchy | None:
        """The hierarchy to run an operation of ``nbytes`` by, or ``None`` for a flat one.

        ``"auto"`` takes it when it moves fewer bytes between hosts (several
        hosts, more than one rank on some) and the message is larger than
        ``GroupConfig.hierarchical_bytes``.
        """
        if algorithm == "hierarchical":
            return self._hier()
        limit = self.config.hierarchical_bytes
        if algorithm != "auto" or limit is None or nbytes <= limit:
            return None
        hier = self._hier()
        return hier if hier.helps else None

    # -- building blocks ---------------------------------------------------------

    def _ring_of(self, ring: Sequence[int] | None) -> tuple[int, int, int, int]:
        """``(position, size, right, left)`` of this rank in ``ring`` (default: all ranks)."""
        if ring is None:
            n = self.world_size
            return self.rank, n, (self.rank + 1) % n, (self.rank - 1) % n
        n, position = len(ring), ring.index(self.rank)
        return position, n, ring[(position + 1) % n], ring[(position - 1) % n]

    async def _ring_reduce_scatter(self, op: _Op, flat: Flat, a: Any,
                                   bounds: list[tuple[int, int]], reduce: ReduceOp,
                                   ring: Sequence[int] | None = None,
                                   first_step: int = 0) -> None:
        """Leave block ``position`` of ``a`` (by ``bounds``) reduced over the
        ranks of ``ring`` (default: all, and position = rank)."""
        position, n, right, left = self._ring_of(ring)
        per = self._per_segment(flat)
        scratch = flat.empty(min(per, max(hi - lo for lo, hi in bounds)))

        for index, plan in enumerate(schedule.ring_reduce_scatter(position, n)):
            step = first_step + index

            async def send(lo: int, hi: int, step: int = step) -> None:
                for s_lo, s_hi in schedule.segments(lo, hi, per):
                    await self._send(right, op, step, [flat.frame(a[s_lo:s_hi])])

            async def receive(lo: int, hi: int, step: int = step) -> None:
                for s_lo, s_hi in schedule.segments(lo, hi, per):
                    part = scratch[: s_hi - s_lo]
                    await self._recv(left, op, step, [flat.frame(part)])
                    flat.reduce_into(reduce, a[s_lo:s_hi], part)
                flat.sync()

            await _all(send(*bounds[plan.send]), receive(*bounds[plan.recv]))

    async def _ring_allgather(self, op: _Op, flat: Flat, a: Any,
                              blocks: Sequence[Sequence[tuple[int, int]]], first_step: int,
                              ring: Sequence[int] | None = None) -> None:
        """Spread block ``i`` of ``a`` from the ``i``-th rank of ``ring``
        (default: rank ``i``) to all of them; receives land in ``a``.

        A block is a list of ``[lo, hi)`` ranges (a host's ranks need not be
        adjacent); each range moves in segments.
        """
        position, n, right, left = self._ring_of(ring)
        per = self._per_segment(flat)
        for index, plan in enumerate(schedule.ring_allgather(position, n)):
            step = first_step + index

            async def send(ranges: Sequence[tuple[int, int]], step: int = step) -> None:
                for lo, hi in ranges:
                    for s_lo, s_hi in schedule.segments(lo, hi, per):
                        await self._send(right, op, step, [flat.frame(a[s_lo:s_hi])])

            async def receive(ranges: Sequence[tuple[int, int]], step: int = step) -> None:
                for lo, hi in ranges:
                    for s_lo, s_hi in schedule.segments(lo, hi, per):
                        await self._recv(left, op, step, [flat.frame(a[s_lo:s_hi])])

            await _all(send(blocks[plan.send]), receive(blocks[plan.recv]))

    async def _doubling_allreduce(self, op: _Op, flat: Flat, a: Any, reduce: ReduceOp) -> None:
        plan = schedule.recursive_doubling(self.rank, self.world_size)
        whole = [flat.frame(a)]
        if plan.fold_to is not None:
            await self._send(plan.fold_to, op, 0, whole)
            await self._recv(plan.fold_to, op, _RETURN_STEP, whole)
            return
        scratch = flat.empty(flat.size)
        if plan.absorb is not None:
            await self._recv(plan.absorb, op, 0, [flat.frame(scratch)])
            flat.reduce_into(reduce, a, scratch)
            flat.sync()
        for step, partner in enumerate(plan.partners, start=1):
            await self._exchange(op, step, partner, whole, partner, [flat.frame(scratch)])
            # The lower rank's partial result first on both sides, so that
            # both get the same bits (NaN signs, signed zeros), as promised.
            flat.reduce_into(reduce, a, scratch, src_first=partner < self.rank)
            flat.sync()
        if reduce is ReduceOp.AVG:
            flat.divide(a, self.world_size)
            flat.sync()
        if plan.give_back is not None:
            await self._send(plan.give_back, op, _RETURN_STEP, whole)

    async def _tree_reduce(self, op: _Op, flat: Flat, a: Any, reduce: ReduceOp,
                           root: int) -> None:
        parent, children = schedule.binomial_tree(self.rank, self.world_size, root)
        if children:
            scratch = flat.empty(flat.size)
            for child in reversed(children):
                await self._recv(child, op, 0, [flat.frame(scratch)])
                flat.reduce_into(reduce, a, scratch)
            flat.sync()
        if parent is not None:
            await self._send(parent, op, 0, [flat.frame(a)])

    async def _tree_broadcast(self, op: _Op, flat: Flat, a: Any, root: int) -> None:
        parent, children = schedule.binomial_tree(self.rank, self.world_size, root)
        if parent is not None:
            await self._recv(parent, op, 0, [flat.frame(a)])
        if children:
            await _all(*(self._send(c, op, 0, [flat.frame(a)]) for c in children))

    async def _chain_broadcast(self, op: _Op, flat: Flat, a: Any, root: int) -> None:
        """Pipelined chain: segment ``k`` moves on while segment ``k + 1`` arrives."""
        previous, following = schedule.chain(self.rank, self.world_size, root)
        await self._fan_chain(op, flat, a, previous, [] if following is None else [following],
                              0, 0, flat.size)

    async def _chain_reduce(self, op: _Op, flat: Flat, a: Any, reduce: ReduceOp,
                            source: int | None, dest: int | None, step: int,
                            lo: int, hi: int) -> None:
        """Pipelined chain reduction of ``a[lo:hi]``: segment by segment, add
        what ``source`` sends into ``a`` (through one segment of scratch) and
        pass the sum on to ``dest``."""
        per = self._per_segment(flat)
        scratch = flat.empty(min(per, hi - lo)) if source is not None else None
        sending: asyncio.Future[None] | None = None
        try:
            for s_lo, s_hi in schedule.segments(lo, hi, per):
                if scratch is not None and source is not None:
                    part = scratch[: s_hi - s_lo]
                    await self._recv(source, op, step, [flat.frame(part)])
                    flat.reduce_into(reduce, a[s_lo:s_hi], part)
                    flat.sync()
                if dest is not None:
                    if sending is not None:
                        await sending
                    sending = asyncio.ensure_future(
                        self._send(dest, op, step, [flat.frame(a[s_lo:s_hi])]))
            if sending is not None:
                await sending
        finally:
            if sending is not None and not sending.done():
                sending.cancel()

    async def _fan_chain(self, op: _Op, flat: Flat, a: Any, previous: int | None,
                         followers: Sequence[int], step: int, lo: int, hi: int) -> None:
        """Pipelined broadcast of ``a[lo:hi]`` along a tree of chains: each
        segment arrives from ``previous`` straight into ``a``, then goes on
        to every follower while the next segment arrives."""
        if previous is None and not followers:
            return
        sending: asyncio.Future[None] | None = None
        try:
            for s_lo, s_hi in schedule.segments(lo, hi, self._per_segment(flat)):
                part = [flat.frame(a[s_lo:s_hi])]
                if previous is not None:
                    await self._recv(previous, op, step, part)
                if followers:
                    if sending is not None:
                        await sending
                    sending = asyncio.ensure_future(
                        _all(*(self._send(f, op, step, part) for f in followers)))
            if sending is not None:
                await sending
        finally:
            if sending is not None and not sending.done():
                sending.cancel()

    async def _hierarchical_allreduce(self, op: _Op, flat: Flat, a: Any, reduce: ReduceOp,
                                      hier: hierarchy.Hierarchy) -> None:
        """Chain reduce to each host's leader, ring allreduce among the
        leaders, chain broadcast from each leader (see :mod:`._hierarchy`).

        The array moves in chunks of at most ``h`` segments (``h`` hosts: a
        segment per ring block; a quarter of the array when that is less),
        and the three phases overlap chunk by chunk: while
        the leaders' ring runs on chunk ``c``, chunk ``c + 1`` is reduced
        inside the host and chunk ``c - 1`` broadcast. Each phase uses its
        own connections (or its own direction of one), so every connection
        still carries one phase's messages, in chunk order.
        """
        plan = hierarchy.allreduce_plan(hier, self.rank)
        h = len(hier.hosts)
        # At least four chunks where the segments allow, so that the phases
        # overlap for mid-sized messages too.
        per_chunk = min(self._per_segment(flat) * h, max(-(-flat.size // 4), 1024 * h))
        chunks = schedule.segments(0, flat.size, per_chunk)
        stride = 2 * h + 1  # steps per chunk: reduce, ring, broadcast
        reduced: asyncio.Queue[None] = asyncio.Queue()
        finished: asyncio.Queue[None] = asyncio.Queue()
        bcast = (plan.bcast_to,) if plan.bcast_to is not None else ()

        async def reducing() -> None:
            for c, (lo, hi) in enumerate(chunks):
                await self._chain_reduce(op, flat, a, reduce, plan.reduce_from, plan.reduce_to,
                                         c * stride, lo, hi)
                reduced.put_nowait(None)

        async def ringing() -> None:
            for c, (lo, hi) in enumerate(chunks):
                await reduced.get()
                bounds = [(lo + b_lo, lo + b_hi) for b_lo, b_hi in schedule.split(hi - lo, h)]
                if h > 1:
                    await self._ring_reduce_scatter(op, flat, a, bounds, reduce, plan.ring,
                                                    c * stride + 1)
                if reduce is ReduceOp.AVG:
                    b_lo, b_hi = bounds[plan.position]
                    flat.divide(a[b_lo:b_hi], self.world_size)
                    flat.sync()
                if h > 1:
                    await self._ring_allgather(op, flat, a, [[b] for b in bounds],
                                               c * stride + h, plan.ring)
                finished.put_nowait(None)

        async def broadcasting() -> None:
            for c, (lo, hi) in enumerate(chunks):
                if plan.ring:
                    await finished.get()
                await self._fan_chain(op, flat, a, plan.bcast_from, bcast, c * stride + 2 * h,
                                      lo, hi)

        if plan.ring:
            await _all(reducing(), ringing(), broadcasting())
        else:
            await _all(reducing(), broadcasting())

    async def _hierarchical_allgather(self, op: _Op, flat: Flat, a: Any, count: int,
                                      hier: hierarchy.Hierarchy) -> None:
        """Gather each host's blocks at its leader, ring allgather of host
        blocks among the leaders, chain broadcast of everything from each leader."""
        plan = hierarchy.allgather_plan(hier, self.rank)
        h = len(hier.hosts)

        def block(rank: int) -> Any:
            return flat.frame(a[rank * count:(rank + 1) * count])

        if plan.gather_to is not None:
            await self._send(plan.gather_to, op, 0, [block(self.rank)])
        elif plan.gather_from:
            await _all(*(self._recv(peer, op, 0, [block(peer)]) for peer in plan.gather_from))
        if plan.ring and h > 1:
            blocks = [_runs([(r * count, (r + 1) * count) for r in ranks])
                      for ranks in plan.blocks]
            await self._ring_allgather(op, flat, a, blocks, 1, plan.ring)
        bcast = (plan.bcast_to,) if plan.bcast_to is not None else ()
        await self._fan_chain(op, flat, a, plan.bcast_from, bcast, h, 0, flat.size)

    # -- collective operations ---------------------------------------------------

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
        reduce = _check_op(op, flat)
        _check_ring(algorithm, flat.size, self.world_size)
        large = self._large(flat.nbytes, algorithm, hierarchical=True)
        hier = self._hierarchical(flat.nbytes, algorithm)

        async def body(o: _Op) -> Any:
            await self._allreduce_flat(o, flat, reduce, large, hier)
            return flat.result()

        return self._submit(f"allreduce({flat.describe()},{reduce.value}{_mark(hier)})",
                            body, timeout)

    async def _allreduce_flat(self, o: _Op, flat: Flat, reduce: ReduceOp, large: bool,
                              hier: hierarchy.Hierarchy | None) -> None:
        n, a = self.world_size, flat.array
        if n == 1 or flat.size == 0:
            return
        if hier is not None:
            await self._hierarchical_allreduce(o, flat, a, reduce, hier)
        elif large and flat.size >= n:
            bounds = schedule.split(flat.size, n)
            await self._ring_reduce_scatter(o, flat, a, bounds, reduce)
            if reduce is ReduceOp.AVG:
                lo, hi = bounds[self.rank]
                flat.divide(a[lo:hi], n)
                flat.sync()
            await self._ring_allgather(o, flat, a, [[b] for b in bounds], n)
        else:
            await self._doubling_allreduce(o, flat, a, reduce)

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
        reduces = [_check_op(op, f) for f in flats]
        reduce = reduces[0] if reduces else ReduceOp(op)
        ranks = list(range(len(flats))) if priorities is None else list(priorities)
        if len(ranks) != len(flats):
            raise InvalidArgument(f"{len(ranks)} priorities for {len(flats)} tensors")
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise InvalidArgument(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        self._large(0, algorithm, hierarchical=True)  # validates the name
        order = sorted(range(len(flats)), key=lambda i: (ranks[i], i))
        buckets: list[list[int]] = []
        size, kind = 0, None
        for i in order:
            f = flats[i]
            key = (f.dtype.str, f.device, type(f.array))
            if (buckets and key == kind and size < bucket_bytes and f.nbytes < bucket_bytes
                    and size + f.nbytes <= bucket_bytes):
                buckets[-1].append(i)
                size += f.nbytes
            else:
                buckets.append([i])
                size, kind = f.nbytes, key
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
        large = self._large(total * first.itemsize, algorithm, hierarchical=True)
        hier = self._hierarchical(total * first.itemsize, algorithm)

        async def body(o: _Op) -> None:
            buffer = first.empty(total)
            offset = 0
            for p in parts:
                buffer[offset:offset + p.size] = p.array
                offset += p.size
            fused = Flat(buffer, first.xp, buffer, (total,), "C", first.device)
            fused.sync()
            await self._allreduce_flat(o, fused, reduce, large, hier)
            offset = 0
            for p in parts:
                p.array[...] = buffer[offset:offset + p.size]
                offset += p.size
            fused.sync()

        sizes = ",".join(str(p.size) for p in parts)
        if len(parts) > 8:  # keep the header short; still tells other splits apart
            sizes = f"{len(parts)}x{total}#{zlib.crc32(sizes.encode()):08x}"
        return self._submit(f"allreduce_bucket({first.dtype.str}[{sizes}]@{first.device},"
                            f"{reduce.value}{_mark(hier)})", body, timeout)

    def reduce(self, x: Any, root: int = 0, op: ReduceOp | str = ReduceOp.SUM, *,
               algorithm: Algorithm = "auto", timeout: float | None = None) -> asyncio.Future[Any]:
        """Reduce ``x`` over all ranks into ``x`` on ``root``.

        On the other ranks ``x`` serves as workspace and holds unspecified
        values afterwards (it is not copied). Returns ``x``.

        Raises:
            InvalidArgument: as :meth:`allreduce`.
        """
        flat = flatten(x)
        reduce = _check_op(op, flat)
        _check_root(root, self.world_size)
        _check_ring(algorithm, flat.size, self.world_size)
        large = self._large(flat.nbytes, algorithm)

        async def body(o: _Op) -> Any:
            n, a = self.world_size, flat.array
            if n > 1 and flat.size > 0:
                if large and flat.size >= n:
                    bounds = schedule.split(flat.size, n)
                    await self._ring_reduce_scatter(o, flat, a, bounds, reduce)
                    await self._gather_blocks(o, flat, a, bounds, root, step=n)
                else:
                    await self._tree_reduce(o, flat, a, reduce, root)
            if reduce is ReduceOp.AVG and self.rank == root:
                flat.divide(a, n)
            return flat.result()

        return self._submit(f"reduce({flat.describe()},{reduce.value},root={root})", body, timeout)

    async def _gather_blocks(self, op: _Op, flat: Flat, a: Any,
                             bounds: list[tuple[int, int]], root: int, step: int) -> None:
        """Every rank's block ``rank`` of ``a`` to ``root``, straight into root's ``a``."""
        if self.rank == root:
            await _all(*(
                self._recv(peer, op, step, [flat.frame(a[bounds[peer][0]:bounds[peer][1]])])
                for peer in range(self.world_size) if peer != root
            ))
        else:
            lo, hi = bounds[self.rank]
            await self._send(root, op, step, [flat.frame(a[lo:hi])])

    def broadcast(self, x: Any, root: int = 0, *, algorithm: Algorithm = "auto",
                  timeout: float | None = None) -> asyncio.Future[Any]:
        """Copy ``x`` from ``root`` into ``x`` on every rank; returns ``x``.

        Small arrays follow a binomial tree, large ones a pipelined chain.
        """
        _check_root(root, self.world_size)
        flat = flatten(x, writable=self.rank != root)
        large = self._large(flat.nbytes, algorithm, hierarchical=True)
        hier = self._hierarchical(flat.nbytes, algorithm)

        async def body(o: _Op) -> Any:
            if self.world_size > 1 and flat.size > 0:
                if hier is not None:
                    plan = hierarchy.broadcast_plan(hier, self.rank, root)
                    await self._fan_chain(o, flat, flat.array, plan.previous, plan.followers, 0,
                                          0, flat.size)
                elif large:
                    await self._chain_broadcast(o, flat, flat.array, root)
                else:
                    await self._tree_broadcast(o, flat, flat.array, root)
            return flat.result()

        return self._submit(f"broadcast({flat.describe()},root={root}{_mark(hier)})",
                            body, timeout)

    def allgather(self, x: Any, *, out: Any = None, algorithm: Algorithm = "auto",
                  timeout: float | None = None) -> asyncio.Future[Any]:
        """Every rank's ``x``, stacked: ``out[i]`` is rank ``i``'s.

        ``out`` (shape ``(world_size, *x.shape)``, same kind and dtype) is
        allocated when not given; receives land in it directly. Small arrays
        use Bruck's algorithm, large ones the ring.
        """
        flat = _c_ordered(flatten(x, writable=False), "allgather")
        n = self.world_size
        shape = (n, *flat.shape)
        target = _output(flat, out, shape)
        large = self._large(flat.nbytes * n, algorithm, hierarchical=True)
        hier = self._hierarchical(flat.nbytes * n, algorithm)

        async def body(o: _Op) -> Any:
            count, a, result = flat.size, target.array, target.array
            own = result[self.rank * count:(self.rank + 1) * count]
            if not _same_memory(own, flat.array):
                own[...] = flat.array
                target.sync()
            if n == 1 or count == 0:
                return target.result()
            bounds = [(i * count, (i + 1) * count) for i in range(n)]
            if hier is not None:
                await self._hierarchical_allgather(o, target, a, count, hier)
            elif large:
                await self._ring_allgather(o, target, a, [[b] for b in bounds], 0)
            else:
                await self._bruck_allgather(o, target, a, count)
            return target.result()

        return self._submit(f"allgather({flat.describe()}{_mark(hier)})", body, timeout)

    async def _bruck_allgather(self, op: _Op, flat: Flat, a: Any, count: int) -> None:
        n = self.world_size

        def blocks(first: int, number: int) -> list[Any]:
            # Blocks first .. first + number - 1 (mod n): one frame, or two
            # when the run wraps past the last rank.
            first %= n
            head = min(number, n - first)
            frames = [flat.frame(a[first * count:(first + head) * count])]
            if number > head:
                frames.append(flat.frame(a[: (number - head) * count]))
            return frames

        for step, plan in enumerate(schedule.bruck_steps(self.rank, n)):
            await self._exchange(op, step, plan.send_to, blocks(self.rank, plan.count),
                                 plan.recv_from, blocks(self.rank + plan.offset, plan.count))

    def reduce_scatter(self, x: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                       algorithm: Algorithm = "auto",
                       timeout: float | None = None) -> asyncio.Future[Any]:
        """Reduce ``x`` over all ranks; rank ``r`` gets part ``r`` of the result.

        ``x`` is split along its first axis into ``world_size`` nearly equal
        parts (as ``np.array_split``). The result is a view of ``x`` (its
        part); the rest of ``x`` serves as workspace.
        """
        flat = flatten(x)
        reduce = _check_op(op, flat)
        if not flat.shape:
            raise InvalidArgument("reduce_scatter needs an array of at least one dimension")
        if flat.order != "C":
            raise InvalidArgument("reduce_scatter needs a C-ordered array")
        n = self.world_size
        rows = schedule.split(flat.shape[0], n)
        row = flat.size // flat.shape[0] if flat.shape[0] else 0
        bounds = [(lo * row, hi * row) for lo, hi in rows]
        large = self._large(flat.nbytes, algorithm)
        lo_row, hi_row = rows[self.rank]

        async def body(o: _Op) -> Any:
            a = flat.array
            lo, hi = bounds[self.rank]
            if n > 1 and flat.size > 0:
                if large:
                    await self._ring_reduce_scatter(o, flat, a, bounds, reduce)
                else:
                    await self._doubling_allreduce(
                        o, flat, a, ReduceOp.SUM if reduce is ReduceOp.AVG else reduce)
            if reduce is ReduceOp.AVG:
                flat.divide(a[lo:hi], n)
            return flat.original[lo_row:hi_row]

        return self._submit(f"reduce_scatter({flat.describe()},{reduce.value})", body, timeout)

    def gather(self, x: Any, root: int = 0, *, out: Any = None,
               timeout: float | None = None) -> asyncio.Future[Any]:
        """Every rank's ``x`` stacked on ``root`` (``None`` elsewhere)."""
        _check_root(root, self.world_size)
        flat = _c_ordered(flatten(x, writable=False), "gather")
        n = self.world_size
        shape = (n, *flat.shape)
        target: Flat | None = None
        if self.rank == root:
            target = _output(flat, out, shape)

        async def body(o: _Op) -> Any:
            count = flat.size
            if target is None:
                await self._send(root, o, 0, [flat.frame(flat.array)])
                return None
            a = target.array
            a[root * count:(root + 1) * count] = flat.array
            await _all(*(
                self._recv(peer, o, 0, [target.frame(a[peer * count:(peer + 1) * count])])
                for peer in range(n) if peer != root
            ))
            return target.result()

        return self._submit(f"gather({flat.describe()},root={root})", body, timeout)

    def scatter(self, out: Any, parts: Any = None, root: int = 0, *,
                timeout: float | None = None) -> asyncio.Future[Any]:
        """Part ``r`` of ``parts`` (on ``root``, shape ``(world_size, *out.shape)``)
        into ``out`` on rank ``r``; returns ``out``."""
        _check_root(root, self.world_size)
        flat = _c_ordered(flatten(out, name="out"), "scatter")
        n = self.world_size
        source: Flat | None = None
        if self.rank == root:
            if parts is None:
                raise InvalidArgument("the root of a scatter must pass parts")
            source = _c_ordered(flatten(parts, writable=False, name="parts"), "scatter")
            if source.shape != (n, *flat.shape) or source.dtype != flat.dtype:
                raise InvalidArgument(
                    f"parts must be a {flat.dtype} array of shape {(n, *flat.shape)}")

        async def body(o: _Op) -> Any:
            count = flat.size
            if source is None:
                await self._recv(root, o, 0, [flat.frame(flat.array)])
                return flat.result()
            s = source.array
            flat.array[...] = s[root * count:(root + 1) * count]
            await _all(*(
                self._send(peer, o, 0, [source.frame(s[peer * count:(peer + 1) * count])])
                for peer in range(n) if peer != root
            ))
            return flat.result()

        return self._submit(f"scatter({flat.describe()},root={root})", body, timeout)

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
        target = _output(flat, out, flat.shape)

        async def body(o: _Op) -> Any:
            count = flat.size // n
            src, dst = flat.array, target.array

            def block(array: Any, i: int) -> Any:
                return array[i * count:(i + 1) * count]

            block(dst, self.rank)[...] = block(src, self.rank)
            for step, (to, frm) in enumerate(schedule.pairwise(self.rank, n)):
                await self._exchange(o, step, to, [flat.frame(block(src, to))],
                                     frm, [target.frame(block(dst, frm))])
            return target.result()

        return self._submit(f"alltoall({flat.describe()})", body, timeout)

    def barrier(self, *, timeout: float | None = None) -> asyncio.Future[None]:
        """Wait until every rank has reached the barrier (dissemination, log2 rounds)."""
        async def body(o: _Op) -> None:
            for step, (to, frm) in enumerate(schedule.dissemination(self.rank, self.world_size)):
                await self._exchange(o, step, to, [], frm, [])

        return self._submit("barrier()", body, timeout)

    # -- point to point ------------------------------------------------------------

    def _p2p_lock(self, kind: str, peer: int) -> asyncio.Lock:
        """The lock that keeps one pair's messages in order, one way."""
        key = (kind, peer)
        lock = self._p2p_locks.get(key)
        if lock is None:
            lock = self._p2p_locks[key] = asyncio.Lock()
        return lock

    def _check_peer(self, peer: int, name: str) -> None:
        if not isinstance(peer, int) or not 0 <= peer < self.world_size or peer == self.rank:
            raise InvalidArgument(f"{name} must be another rank of the group, got {peer!r}")

    def _p2p_timeout(self, timeout: float | None) -> float:
        if timeout is not None and not timeout > 0:
            raise InvalidArgument(f"timeout must be positive, got {timeout!r}")
        return self.config.timeout if timeout is None else timeout

    def _usable(self) -> None:
        if self._closed:
            raise CollectiveError(f"group {self.id} is closed")
        if self._failed is not None:
            raise self._failed

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
        self._usable()
        self._check_peer(dst, "dst")
        flat = flatten(x, writable=False)
        limit = self._p2p_timeout(timeout)
        try:
            async with self._p2p_lock("send", dst), asyncio.timeout(limit):
                conn = self._p2p_out.get(dst)
                if conn is None:
                    try:
                        conn = await self._runtime.dial(self._members[dst], self.id, "p2p")
                    except TransportError as exc:
                        raise RankFailedError(f"group {self.id}: cannot reach rank {dst}: {exc}",
                                              ranks=(dst,)) from exc
                    self._p2p_out[dst] = conn
                header = _HEAD.pack(0, tag & 0xFFFF_FFFF) + f"p2p({flat.describe()})".encode()
                try:
                    await conn.send([header, flat.frame(flat.array)])
                except ConnectionClosedError as exc:
                    raise await self._lost(dst, exc) from exc
        except TimeoutError:
            raise CollectiveTimeout(
                f"group {self.id}: rank {dst} did not take the message (tag {tag}) within "
                f"{limit} s", ranks=(dst,)) from None

    async def recv(self, out: Any, src: int, *, tag: int = 0,
                   timeout: float | None = None) -> Any:
        """Receive rank ``src``'s next ``send`` straight into ``out``; returns ``out``.

        A receive that times out while its message is arriving leaves that
        message to the next ``recv`` (which gets a copy of it), but ``out``
        may still be written after the timeout.

        Raises:
            MismatchError: the message has another tag, dtype or shape.
            CollectiveTimeout: nothing arrived in time.
            RankFailedError: ``src`` went away.
        """
        self._usable()
        self._check_peer(src, "src")
        flat = flatten(out, name="out")
        limit = self._p2p_timeout(timeout)
        try:
            async with self._p2p_lock("recv", src), asyncio.timeout(limit):
                conn = self._p2p_in.get(src)
                if conn is None:
                    conn = await self._runtime.incoming(self.id, self._members[src], "p2p")
                    self._p2p_in[src] = conn
                sig = f"p2p({flat.describe()})".encode()
                expected = _HEAD.pack(0, tag & 0xFFFF_FFFF) + sig
                frame = flat.frame(flat.array)

                def allocate(info: FrameInfo) -> Any:
                    if info.index == 1 and info.nbytes == flat.nbytes and (
                        (info.device == "cuda") == (flat.device == "cuda")
                    ):
                        return frame
                    return default_allocator(info)

                early = self._p2p_early.setdefault(src, {})
                wanted = tag & 0xFFFF_FFFF
                kept = early.get(wanted)
                got = kept.popleft() if kept else None
                while got is None:
                    try:
                        got = await conn.recv(allocator=allocate)
                    except ConnectionClosedError as exc:
                        raise await self._lost(src, exc) from exc
                    arrived = _tag_of(got[0])
                    if arrived is None or arrived == wanted:
                        break
                    # Another tag's message (it may have landed in ``out``,
                    # which this receive overwrites anyway): a copy waits for
                    # the receive that asks for its tag.
                    early.setdefault(arrived, deque()).append([bytes(got[0]),
                                                               *map(_keep, got[1:])])
                    got = None
        except TimeoutError:
            raise CollectiveTimeout(
                f"group {self.id}: nothing from rank {src} (tag {tag}) within {limit} s",
                ranks=(src,)) from None
        header = bytes(got[0])
        if header != expected or len(got) != 2 or _nbytes(got[1]) != flat.nbytes:
            try:
                _, their_tag = _HEAD.unpack_from(header)
                theirs = f"tag {their_tag} {header[_HEAD.size:].decode()}"
            except (struct.error, UnicodeDecodeError):
                theirs = "something unreadable"
            raise MismatchError(
                f"group {self.id}: rank {src} sent {theirs} where rank {self.rank} expected "
                f"tag {tag} {sig.decode()}", ranks=(src,))
        _settle([frame], got[1:])
        return flat.result()

    # -- closing -----------------------------------------------------------------

    async def close(self) -> None:
        """Leave the group: pending operations fail, connections close politely.

        Closing the root group closes its subgroups and leaves the rendezvous;
        rank 0 waits (up to ``rendezvous_timeout``) for the others to leave
        before it stops serving it.
        """
        if self._closed:
            return
        for child in self._children:
            await child.close()
        self._closed = True
        error = CollectiveError(f"group {self.id} was closed")
        if self._worker is not None and not self._worker.done():
            if self._failed is None:
                self._failed = error
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        for op in self._queue:
            if not op.future.done():
                op.future.set_exception(error)
        self._queue.clear()
        # Our peers should hear why we failed before they see us hang up.
        await self._runtime.flush()
        conns = [*self._peers.values(), *self._p2p_out.values(), *self._p2p_in.values()]
        if self._failed is not None and self._failed is not error:
            # A broken group's streams are in no known state, and a send to a
            # dead peer may never finish: nothing is worth a polite goodbye.
            for conn in conns:
                conn.abort()
        else:
            await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
        if self.id == "0":
            await self._runtime.close()

    async def _abandon(self) -> None:
        for conn in self._peers.values():
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


def _runs(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` with adjacent ones merged: fewer, larger messages."""
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def _c_ordered(flat: Flat, operation: str) -> Flat:
    """``flat`` if its array is C-ordered: operations that stack or split
    arrays along their first axis index them in C order.

    Raises:
        InvalidArgument: a Fortran-ordered array.
    """
    if flat.order != "C" and len(flat.shape) > 1:
        raise InvalidArgument(f"{operation} needs C-ordered arrays (np.ascontiguousarray)")
    return flat


def _output(like: Flat, out: Any, shape: tuple[int, ...]) -> Flat:
    """``out``, or a new array of ``like``'s kind, checked as a C-ordered ``shape`` result.

    Raises:
        InvalidArgument: ``out`` has another shape, dtype or order.
    """
    target = like.allocate(shape) if out is None else flatten(out, name="out")
    if target.shape != shape or target.dtype != like.dtype or target.order != "C":
        raise InvalidArgument(f"out must be a C-ordered {like.dtype} array of shape {shape}")
    return target


def _nbytes(frame: Any) -> int:
    if hasattr(frame, "nbytes"):
        return int(frame.nbytes)
    return memoryview(frame).nbytes


def _settle(mine: Sequence[Any], landed: Sequence[Any]) -> None:
    """Make sure received data is in ``mine``.

    A transport may have taken a small message out of its read-ahead buffer
    before our ``recv`` (and its allocator) came; such frames are copied
    over. Everything else landed in ``mine`` already and costs nothing here.
    """
    for dst, src in zip(mine, landed, strict=True):
        if src is dst:
            continue
        if hasattr(dst, "__cuda_array_interface__"):
            import cupy

            cupy.asarray(dst).reshape(-1)[...] = cupy.asarray(src).reshape(-1)
        else:
            np.asarray(dst).reshape(-1)[...] = np.asarray(src).reshape(-1)


def _tag_of(header: Any) -> int | None:
    """The tag of a point-to-point message's header, ``None`` when unreadable."""
    try:
        return int(_HEAD.unpack_from(bytes(header))[1])
    except struct.error:
        return None


def _keep(frame: Any) -> Any:
    """A copy of a received frame that outlives the buffer it landed in."""
    if hasattr(frame, "__cuda_array_interface__"):
        import cupy

        return cupy.array(frame, copy=True)
    return np.array(np.asarray(frame).reshape(-1).view(np.uint8), copy=True)


def _same_memory(a: Any, b: Any) -> bool:
    try:
        if hasattr(a, "__cuda_array_interface__"):
            return bool(a.__cuda_array_interface__["data"][0]
                        == b.__cuda_array_interface__["data"][0])
        return bool(a.__array_interface__["data"][0] == b.__array_interface__["data"][0])
    except (AttributeError, KeyError):
        return False


@dataclasses.dataclass(frozen=True, slots=True)
class EnvSettings:
    """What a launcher's environment says about this process's group."""

    rank: int
    world_size: int
    master: str
    host_master: bool | None


def env_settings(env: Mapping[str, str]) -> EnvSettings:
    """Rank, world size and rendezvous from a torchrun, Slurm or Open MPI environment.

    The rendezvous is ``TENSORWIRE_MASTER`` when set, else
    ``tcp://MASTER_ADDR:MASTER_PORT`` (port 29500 by default). Under torchrun
    with its agent store (``TORCHELASTIC_USE_AGENT_STORE=True``) torch's own
    store holds ``MASTER_PORT``, so tensorwire's rank 0 takes the next port.
    ``TENSORWIRE_MASTER_HOSTED=1`` says a launcher serves the rendezvous
    (no rank hosts it).

    Raises:
        ConfigError: no launcher's variables, or values that are not numbers.
    """
    for rank_key, size_key in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"),
                               ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank_key in env and size_key in env:
            break
    else:
        raise ConfigError(
            "no rank in the environment: set RANK and WORLD_SIZE (torchrun), or run under "
            "Slurm (SLURM_PROCID, SLURM_NTASKS) or Open MPI (OMPI_COMM_WORLD_RANK/SIZE)"
        )
    try:
        rank, world_size = int(env[rank_key]), int(env[size_key])
        port = int(env.get("MASTER_PORT", "29500"))
    except ValueError as exc:
        raise ConfigError(f"launcher variables must be integers: {exc}") from None
    hosted = env.get("TENSORWIRE_MASTER_HOSTED", "") in ("1", "true", "True")
    master = env.get("TENSORWIRE_MASTER")
    if not master:
        host = env.get("MASTER_ADDR")
        if not host:
            raise ConfigError(
                f"{rank_key} is set but neither TENSORWIRE_MASTER nor MASTER_ADDR "
                "(rank 0's host) is")
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            port += 1
        master = f"tcp://{host}:{port}"
    return EnvSettings(rank, world_size, master, False if hosted else None)
