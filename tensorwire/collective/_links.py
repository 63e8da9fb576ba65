"""A group's links: one data connection to every other rank, and its messages.

Every message of an operation is the header (:data:`~._oplog.HEAD`: the
operation's sequence number and step, then its description) and the data
frames. A receive lands each frame straight in the place given for it (the
caller's array, or scratch), and checks the header against the operation
this rank runs, so a rank that called something else is named, not
misread.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any

import numpy as np

from ..errors import ConnectionClosedError, RankFailedError, TransportError
from ..transports import Connection, FrameInfo, default_allocator
from ._arrays import Flat
from ._oplog import HEAD, Op, OpLog
from ._runtime import Runtime

__all__ = ("Links", "ScratchPool", "nbytes", "run_all", "settle")

async def run_all(*coros: Coroutine[Any, Any, Any]) -> None:
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


def nbytes(frame: Any) -> int:
    """The size of a frame (an array, or anything with the buffer protocol)."""
    if hasattr(frame, "nbytes"):
        return int(frame.nbytes)
    return memoryview(frame).nbytes


def settle(mine: Sequence[Any], landed: Sequence[Any]) -> None:
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


class ScratchPool:
    """Receive buffers kept from one operation for the next.

    A training loop reduces the same buckets step after step; a fresh
    segment of scratch per operation is a fresh ``mmap`` whose pages fault
    in while the data lands (issue 25). The pool keeps up to ``keep``
    buffers per device of at most ``limit`` bytes each, as raw bytes, and
    hands each out to one user at a time (the phases of a hierarchical
    allreduce need scratch at once), viewed as the caller's dtype.

    Scratch below ``smallest`` bytes is not pooled: malloc serves it from
    its heap, pages already touched, and the pool's bookkeeping cost more
    than the allocation (3.2 µs against 0.4 here, in an 8-byte allreduce of
    about 90 µs).
    """

    def __init__(self, limit: int, keep: int = 4, smallest: int = 64 << 10) -> None:
        self.limit = limit
        self.keep = keep
        self.smallest = smallest
        self._free: dict[str, list[Any]] = {}

    def take(self, flat: Flat, count: int) -> contextlib.AbstractContextManager[Any]:
        """A flat array of ``count`` items of ``flat``'s dtype on its device.

        Its contents are undefined. A pooled one goes back to the pool when
        the block ends normally; after an exception it is dropped, since a
        transport cut off part-way may still write to it.
        """
        nbytes = count * flat.itemsize
        if nbytes < self.smallest:
            return contextlib.nullcontext(flat.empty(count))
        return self._lend(flat, nbytes)

    @contextlib.contextmanager
    def _lend(self, flat: Flat, nbytes: int) -> Iterator[Any]:
        free = self._free.setdefault(flat.device, [])
        # By index, not list.remove: arrays compare element-wise.
        fits = [i for i, b in enumerate(free) if b.nbytes >= nbytes]
        if fits:
            buffer = free.pop(min(fits, key=lambda i: free[i].nbytes))
        else:
            buffer = flat.xp.empty(nbytes, dtype=flat.xp.uint8)
        yield buffer[:nbytes].view(flat.dtype)
        if 0 < buffer.nbytes <= self.limit:
            free.append(buffer)
            free.sort(key=lambda b: -b.nbytes)
            del free[self.keep:]  # the smallest go


class Links:
    """This rank's connections to the other ranks of one group.

    Attributes:
        peers: the connection to each other rank (the higher rank dials).
        scratch: receive buffers reused across operations.
    """

    def __init__(self, log: OpLog) -> None:
        self._log = log
        self.rank = log.rank
        self.world_size = log.world_size
        self.config = log.config
        self.id = log.id
        self._members = log.members
        self.peers: dict[int, Connection] = {}
        self.scratch = ScratchPool(max(self.config.segment_bytes, self.config.small_bytes))

    async def connect(self, runtime: Runtime) -> None:
        """Open a data connection to every other rank (the higher rank dials).

        Raises:
            RankFailedError: a rank did not connect within the rendezvous
                timeout, or its address cannot be reached.
        """
        async def link(peer: int) -> None:
            if peer < self.rank:
                conn = await runtime.dial(self._members[peer], self.id, "coll")
            else:
                conn = await runtime.incoming(self.id, self._members[peer], "coll")
            self.peers[peer] = conn

        peers = [p for p in range(self.world_size) if p != self.rank]
        try:
            async with asyncio.timeout(self.config.rendezvous_timeout):
                await run_all(*(link(p) for p in peers))
        except TimeoutError:
            missing = sorted(p for p in peers if p not in self.peers)
            raise RankFailedError(
                f"group {self.id}: no data connection with ranks {missing} "
                f"within {self.config.rendezvous_timeout} s", ranks=tuple(missing),
            ) from None
        except TransportError as exc:
            raise RankFailedError(f"group {self.id}: cannot connect the ranks: {exc}") from exc

    @staticmethod
    def _message(op: Op, step: int, frames: Sequence[Any]) -> list[Any]:
        """``frames`` as the message of ``op`` at ``step`` (the header
        first), counted in the operation's bytes out."""
        op.bytes_out += sum(nbytes(f) for f in frames)
        return [HEAD.pack(op.seq, step) + op.sig, *frames]

    async def send(self, peer: int, op: Op, step: int, frames: Sequence[Any]) -> None:
        """Send ``frames`` as ``peer``'s message of ``op`` at ``step``."""
        try:
            await self.peers[peer].send(self._message(op, step, frames))
        except ConnectionClosedError as exc:
            raise await self._log.lost(peer, exc) from exc

    async def recv(self, peer: int, op: Op, step: int, frames: Sequence[Any]) -> None:
        """Receive ``peer``'s message of ``op`` straight into ``frames``."""
        sizes = [nbytes(f) for f in frames]
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

        self._log.waiting_on = peer
        try:
            got = await self.peers[peer].recv(allocator=allocate)
        except ConnectionClosedError as exc:
            raise await self._log.lost(peer, exc) from exc
        finally:
            self._log.waiting_on = None
        header = bytes(got[0])
        if header[HEAD.size:] != op.sig or HEAD.unpack_from(header) != (op.seq, step) or [
            nbytes(f) for f in got[1:]
        ] != sizes:
            raise await self._log.mismatch(peer, op, header)
        settle(frames, got[1:])

    async def exchange(self, op: Op, step: int, dst: int, send: Sequence[Any],
                       src: int, recv: Sequence[Any]) -> None:
        """Send to ``dst`` and receive from ``src`` at the same time.

        The message is posted (``send_nowait``: whatever the transport
        cannot send at once goes out in the background) before the receive
        waits, so two ranks exchanging with each other cannot deadlock and
        neither side needs a task per direction; the send is awaited last,
        since the caller reuses ``send`` afterwards.
        """
        sending = await self._post(dst, op, step, send)
        try:
            await self.recv(src, op, step, recv)
        except BaseException:
            if sending is not None:
                # The operation failed; what the send ends with is ours to
                # collect, not asyncio's "exception was never retrieved".
                sending.add_done_callback(_collect)
            raise
        if sending is not None:
            await self._sent(dst, sending)

    async def send_each(self, op: Op, step: int,
                        messages: Sequence[tuple[int, Sequence[Any]]]) -> None:
        """Send each ``(peer, frames)`` of ``messages`` as that peer's
        message of ``op`` at ``step``, all at once: every message is posted
        (``send_nowait``) before any is awaited, so a slow peer holds up
        none of the others, and no peer needs a task of its own."""
        pending: list[tuple[int, asyncio.Future[None]]] = []
        try:
            for peer, frames in messages:
                sending = await self._post(peer, op, step, frames)
                if sending is not None:
                    pending.append((peer, sending))
            for peer, sending in pending:
                await self._sent(peer, sending)
        except BaseException:
            for _, sending in pending:
                sending.add_done_callback(_collect)
            raise

    async def _post(self, peer: int, op: Op, step: int,
                    frames: Sequence[Any]) -> asyncio.Future[None] | None:
        """Post ``frames`` to ``peer`` without waiting (``send_nowait``):
        None when it went out at once, else the future of the rest."""
        try:
            return self.peers[peer].send_nowait([self._message(op, step, frames)])
        except ConnectionClosedError as exc:
            raise await self._log.lost(peer, exc) from exc

    async def _sent(self, peer: int, sending: asyncio.Future[None]) -> None:
        """Wait until what ``_post`` left to ``peer`` has gone."""
        try:
            # Shielded: cancelling the operation must not cut a message
            # short on the connection (the transport finishes it).
            await asyncio.shield(sending)
        except ConnectionClosedError as exc:
            raise await self._log.lost(peer, exc) from exc

    def per_segment(self, flat: Flat) -> int:
        """How many items of ``flat`` travel in one message of a pipelined algorithm."""
        return max(1, self.config.segment_bytes // max(flat.itemsize, 1))
