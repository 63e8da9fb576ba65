"""A group's operation log: the queue of operations, and why one failed.

Operations run one at a time, in the order they were submitted. Each
message carries the operation's sequence number and description
(:data:`HEAD` then the description), which is how a rank that called
something else is caught. When an operation fails, the log diagnoses it
(which ranks had not reached the operation, which called something else),
breaks the group, and tells the other ranks through rank 0; news of a
failure elsewhere breaks it here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import struct
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from .._counters import Metrics
from ..errors import (
    CollectiveError,
    CollectiveTimeout,
    InvalidArgument,
    MismatchError,
    RankFailedError,
)
from ._runtime import Runtime
from .config import GroupConfig

__all__ = ("HEAD", "Op", "OpLog")

logger = logging.getLogger(__name__)

#: A message's header: the operation's sequence number and the step within
#: it, followed by the operation's description.
HEAD = struct.Struct("<QI")
_STATUS_TIMEOUT = 2.0
#: How long a broken connection waits for rank 0's word on why.
_NEWS_GRACE = 1.0


@dataclasses.dataclass(slots=True)
class Op:
    """One operation in the log: its number, description, body and outcome."""

    seq: int
    sig: bytes
    body: Callable[[Op], Coroutine[Any, Any, Any]]
    timeout: float
    future: asyncio.Future[Any]
    done: bool = False
    bytes_in: int = 0
    bytes_out: int = 0

    @property
    def name(self) -> str:
        return self.sig.partition(b"(")[0].decode()


class OpLog:
    """The operations of one group on this rank, and the group's failure.

    Attributes:
        failed: why the group broke (``None`` while it works); every later
            operation raises it.
        closed: whether the group was closed.
        waiting_on: the rank a receive waits for, named when it times out.
        news: set when rank 0 reports a failure elsewhere.
    """

    def __init__(self, runtime: Runtime, group_id: str, members: Sequence[int], rank: int,
                 config: GroupConfig) -> None:
        self._runtime = runtime
        self.id = group_id
        self.members = tuple(members)
        self.rank = rank
        self.world_size = len(self.members)
        self.config = config
        self._queue: deque[Op] = deque()
        self._worker: asyncio.Task[None] | None = None
        self._seq = 0
        self._current: Op | None = None
        self.waiting_on: int | None = None
        self.failed: CollectiveError | None = None
        self.news = asyncio.Event()
        self.closed = False
        self._metrics = Metrics()
        # The deadline of the operation in its body (loop time), and one
        # loop timer for it (see _watch).
        self._in_body: Op | None = None
        self._deadline = math.inf
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._expired: Op | None = None

    def submit(self, describe: str, body: Callable[[Op], Coroutine[Any, Any, Any]],
               timeout: float | None) -> asyncio.Future[Any]:
        """Queue an operation: ``body(op)`` runs after those queued before it.

        Raises:
            CollectiveError: the group is closed or broken (its error).
            InvalidArgument: a timeout that is not positive.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if self.closed:
            raise CollectiveError(f"group {self.id} is closed")
        if self.failed is not None:
            raise self.failed
        if timeout is not None and not timeout > 0:
            raise InvalidArgument(f"timeout must be positive, got {timeout!r}")
        op = Op(self._seq, describe.encode(), body,
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
                error = self.failed or CollectiveError(
                    f"group {self.id}: the operation queue was cancelled")
                self._observe(op, started, error)
                self._fail_all(op, error)
                if self.failed is None:
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

    def _observe(self, op: Op, started: float, error: BaseException | None) -> None:
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

    async def _run(self, op: Op) -> Any:
        """Run ``op`` within its deadline; every failure becomes a CollectiveError."""
        self._watch(op)
        expired, cancels_left = False, 0
        try:
            try:
                return await op.body(op)
            finally:
                self._in_body = None
                expired, cancels_left = self._leave_deadline(op)
        except asyncio.CancelledError:
            # The deadline's cancel, unless another came too (news of a
            # failure, close()): as asyncio.timeout() tells them apart.
            if not expired or cancels_left > 0:
                raise
            raise await self._timed_out(op) from None
        except CollectiveError:
            raise
        except Exception as exc:
            raise CollectiveError(f"{op.sig.decode()} #{op.seq} failed: {exc!r}") from exc

    def _leave_deadline(self, op: Op) -> tuple[bool, int]:
        """``op`` left its body: whether its deadline expired, and then the
        worker's cancels left once the deadline's is taken back. Taken back
        however the body ended, as asyncio.timeout() does: a body that
        absorbed the cancel and returned must not leave it counted, or the
        next deadline's cancel would read as another's (close())."""
        if self._expired is not op:
            return False, 0
        self._expired = None
        assert self._worker is not None
        return True, self._worker.uncancel()

    # -- deadlines ------------------------------------------------------------
    #
    # One loop timer watches the deadline of the operation in its body,
    # instead of an asyncio.timeout() per operation: one entered and left
    # (its timer started and cancelled) took about 5.8 µs on uvloop here, a
    # small allreduce some tens. Operations mostly share
    # the group's timeout, so their deadlines come in order: the timer
    # armed for the first still stands when the next ones run, and when it
    # fires early it is armed again for the deadline of the operation then
    # running (see CallsInFlight, which does the same for RPC calls).

    def _watch(self, op: Op) -> None:
        """``op`` enters its body: its deadline is ``op.timeout`` from now."""
        loop = asyncio.get_running_loop()
        self._in_body = op
        self._deadline = loop.time() + op.timeout
        if self._deadline < self._timer_at:
            self._arm(loop, self._deadline)

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(when, self._check_deadline)
        self._timer_at = when

    def _check_deadline(self) -> None:
        """The timer fired: cancel the operation in its body if its deadline
        passed (the worker then raises CollectiveTimeout), else wait on."""
        self._timer, self._timer_at = None, math.inf
        op = self._in_body
        if op is None or self._worker is None:
            return  # between operations: the next one arms it again
        loop = asyncio.get_running_loop()
        if loop.time() < self._deadline:
            self._arm(loop, self._deadline)
            return
        self._expired = op
        self._worker.cancel()

    def _stop_watching(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, math.inf

    def _fail_all(self, op: Op, error: CollectiveError) -> None:
        op.done = True
        for each in (op, *self._queue):
            if not each.future.done():
                each.future.set_exception(error)
        self._queue.clear()

    def _break(self, error: CollectiveError) -> None:
        """The group is broken: remember why, and tell the other ranks."""
        if self.failed is not None:
            return
        self.failed = error
        logger.error("group %s on rank %d failed: %s", self.id, self.rank, error)
        self._runtime.report({
            "kind": "abort", "group": self.id, "rank": self._runtime.rank,
            "error": type(error).__name__, "reason": str(error),
            "ranks": [self.members[r] for r in error.ranks],
        })

    def hear(self, event: dict[str, Any]) -> None:
        """News from rank 0: a rank failed, or an operation failed elsewhere."""
        if self.failed is not None or self.closed:
            return
        world_rank = int(event.get("rank", -1))
        if event.get("kind") == "failed":
            if world_rank not in self.members:
                return
            rank = self.members.index(world_rank)
            reason = event.get("reason") or "its process exited or its link to rank 0 broke"
            error: CollectiveError = RankFailedError(
                f"group {self.id}: rank {rank} failed: {reason}", ranks=(rank,))
        elif event.get("kind") == "abort" and event.get("group") == self.id:
            ranks = tuple(self.members.index(r) for r in event.get("ranks", ())
                          if r in self.members)
            cls: type[CollectiveError] = {
                "MismatchError": MismatchError, "CollectiveTimeout": CollectiveTimeout,
                "RankFailedError": RankFailedError,
            }.get(str(event.get("error")), CollectiveError)
            error = cls(f"rank {self.members.index(world_rank)} reported: {event.get('reason')}",
                        ranks=ranks)
        else:
            return
        self.failed = error
        self.news.set()
        logger.error("group %s on rank %d failed: %s", self.id, self.rank, error)
        if self._worker is not None and not self._worker.done():
            self._worker.cancel()

    def status(self) -> dict[str, Any]:
        """Where this rank stands: the operation it runs or ran last."""
        op = self._current
        if op is None:
            return {"seq": -1, "op": "", "done": True}
        return {"seq": op.seq, "op": op.sig.decode(), "done": op.done}

    async def _statuses(self) -> dict[int, dict[str, Any] | None]:
        """Every other rank's :meth:`status` (``None`` where it does not answer)."""
        peers = [p for p in range(self.world_size) if p != self.rank]
        answers = await asyncio.gather(*(
            self._runtime.peer_status(self.members[p], self.id, _STATUS_TIMEOUT) for p in peers
        ))
        return dict(zip(peers, answers, strict=True))

    async def _timed_out(self, op: Op) -> CollectiveTimeout:
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
        if not behind and self.waiting_on is not None:
            behind.append(self.waiting_on)
            notes.append(f"rank {self.waiting_on} has not sent what rank {self.rank} waits for")
        detail = "; ".join(notes) or "every rank is in it"
        return CollectiveTimeout(
            f"{op.sig.decode()} #{op.seq} on rank {self.rank} did not finish within "
            f"{op.timeout} s: {detail}", ranks=tuple(sorted(behind)),
        )

    async def lost(self, peer: int, exc: BaseException) -> CollectiveError:
        """The error for a broken connection to ``peer``.

        A rank whose operation failed tells rank 0 and may then close its
        connections; give that news a moment to arrive, so that the error
        names the cause rather than the messenger.
        """
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.news.wait(), _NEWS_GRACE)
        return self.failed or RankFailedError(
            f"group {self.id}: the connection to rank {peer} broke ({exc})", ranks=(peer,))

    async def mismatch(self, peer: int, op: Op, header: bytes) -> MismatchError:
        """Name the ranks whose call differs from what most ranks called."""
        try:
            seq, _ = HEAD.unpack_from(header)
            theirs = f"#{seq} {header[HEAD.size:].decode()}"
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

    def usable(self) -> None:
        """Raise unless the group takes operations.

        Raises:
            CollectiveError: the group is closed or broken (its error).
        """
        if self.closed:
            raise CollectiveError(f"group {self.id} is closed")
        if self.failed is not None:
            raise self.failed

    async def close(self, error: CollectiveError) -> None:
        """Stop taking operations; the running one and those queued fail with ``error``."""
        self.closed = True
        self._stop_watching()
        if self._worker is not None and not self._worker.done():
            if self.failed is None:
                self.failed = error
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        for op in self._queue:
            if not op.future.done():
                op.future.set_exception(error)
        self._queue.clear()
