"""Point-to-point messages between two ranks of a group (``send``/``recv``).

They run outside the collective order, on connections of their own (one
each way per pair, opened on first use), so they never interleave with an
operation's messages. They are delivered by tag, as torch.distributed
delivers them: a pair's messages of one tag in the order they were sent; a
message of another tag that arrives first is kept (a copy) for the receive
that asks for its tag.
"""

from __future__ import annotations

import asyncio
import struct
from collections import deque
from typing import Any

import numpy as np

from ..errors import (
    CollectiveTimeout,
    ConnectionClosedError,
    InvalidArgument,
    MismatchError,
    RankFailedError,
    TransportError,
)
from ..transports import Connection, FrameInfo, default_allocator
from ._arrays import flatten
from ._links import nbytes, settle
from ._oplog import HEAD, OpLog
from ._runtime import Runtime

__all__ = ("PointToPoint",)


class PointToPoint:
    """This rank's point-to-point connections within one group."""

    def __init__(self, log: OpLog, runtime: Runtime) -> None:
        self._log = log
        self._runtime = runtime
        self.id = log.id
        self.rank = log.rank
        self.world_size = log.world_size
        self.config = log.config
        self._members = log.members
        self._out: dict[int, Connection] = {}
        self._in: dict[int, Connection] = {}
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        #: Received messages whose tag no recv asked for yet: peer -> tag -> frames.
        self._early: dict[int, dict[int, deque[list[Any]]]] = {}

    def connections(self) -> list[Connection]:
        """Every connection opened so far, both ways."""
        return [*self._out.values(), *self._in.values()]

    def _lock(self, kind: str, peer: int) -> asyncio.Lock:
        """The lock that keeps one pair's messages in order, one way."""
        key = (kind, peer)
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        return lock

    def _check_peer(self, peer: int, name: str) -> None:
        if not isinstance(peer, int) or not 0 <= peer < self.world_size or peer == self.rank:
            raise InvalidArgument(f"{name} must be another rank of the group, got {peer!r}")

    def _timeout(self, timeout: float | None) -> float:
        if timeout is not None and not timeout > 0:
            raise InvalidArgument(f"timeout must be positive, got {timeout!r}")
        return self.config.timeout if timeout is None else timeout

    async def send(self, x: Any, dst: int, *, tag: int = 0, timeout: float | None = None) -> None:
        """Send ``x`` to rank ``dst`` (:meth:`Group.send <tensorwire.collective.Group.send>`)."""
        self._log.usable()
        self._check_peer(dst, "dst")
        flat = flatten(x, writable=False)
        limit = self._timeout(timeout)
        try:
            async with self._lock("send", dst), asyncio.timeout(limit):
                conn = self._out.get(dst)
                if conn is None:
                    try:
                        conn = await self._runtime.dial(self._members[dst], self.id, "p2p")
                    except TransportError as exc:
                        raise RankFailedError(f"group {self.id}: cannot reach rank {dst}: {exc}",
                                              ranks=(dst,)) from exc
                    self._out[dst] = conn
                header = HEAD.pack(0, tag & 0xFFFF_FFFF) + f"p2p({flat.describe()})".encode()
                try:
                    await conn.send([header, flat.frame(flat.array)])
                except ConnectionClosedError as exc:
                    raise await self._log.lost(dst, exc) from exc
        except TimeoutError:
            raise CollectiveTimeout(
                f"group {self.id}: rank {dst} did not take the message (tag {tag}) within "
                f"{limit} s", ranks=(dst,)) from None

    async def recv(self, out: Any, src: int, *, tag: int = 0,
                   timeout: float | None = None) -> Any:
        """Receive into ``out`` from ``src`` (see :meth:`Group.recv
        <tensorwire.collective.Group.recv>`)."""
        self._log.usable()
        self._check_peer(src, "src")
        flat = flatten(out, name="out")
        limit = self._timeout(timeout)
        try:
            async with self._lock("recv", src), asyncio.timeout(limit):
                conn = self._in.get(src)
                if conn is None:
                    conn = await self._runtime.incoming(self.id, self._members[src], "p2p")
                    self._in[src] = conn
                sig = f"p2p({flat.describe()})".encode()
                expected = HEAD.pack(0, tag & 0xFFFF_FFFF) + sig
                frame = flat.frame(flat.array)

                def allocate(info: FrameInfo) -> Any:
                    if info.index == 1 and info.nbytes == flat.nbytes and (
                        (info.device == "cuda") == (flat.device == "cuda")
                    ):
                        return frame
                    return default_allocator(info)

                early = self._early.setdefault(src, {})
                wanted = tag & 0xFFFF_FFFF
                kept = early.get(wanted)
                got = kept.popleft() if kept else None
                while got is None:
                    try:
                        got = await conn.recv(allocator=allocate)
                    except ConnectionClosedError as exc:
                        raise await self._log.lost(src, exc) from exc
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
        if header != expected or len(got) != 2 or nbytes(got[1]) != flat.nbytes:
            try:
                _, their_tag = HEAD.unpack_from(header)
                theirs = f"tag {their_tag} {header[HEAD.size:].decode()}"
            except (struct.error, UnicodeDecodeError):
                theirs = "something unreadable"
            raise MismatchError(
                f"group {self.id}: rank {src} sent {theirs} where rank {self.rank} expected "
                f"tag {tag} {sig.decode()}", ranks=(src,))
        settle([frame], got[1:])
        return flat.result()


def _tag_of(header: Any) -> int | None:
    """The tag of a point-to-point message's header, ``None`` when unreadable."""
    try:
        return int(HEAD.unpack_from(bytes(header))[1])
    except struct.error:
        return None


def _keep(frame: Any) -> Any:
    """A copy of a received frame that outlives the buffer it landed in."""
    if hasattr(frame, "__cuda_array_interface__"):
        import cupy

        return cupy.array(frame, copy=True)
    return np.array(np.asarray(frame).reshape(-1).view(np.uint8), copy=True)
