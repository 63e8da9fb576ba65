"""Per-chunk, per-worker clocks of one shard and the rules of the consistency modes.

Pure bookkeeping, no asyncio: the shard asks whether a push may be applied
and whether a worker may read, and waits itself when the answer is "not yet".

A worker's *clock* is the number of steps it has pushed; its push for step
``t`` carries clock ``t`` and its pull after that push carries ``t + 1``.
Every chunk keeps, per worker, how many of that worker's pushes it took,
so a push split over several messages, or retried, counts once per chunk:
pushes are idempotent, keyed by (worker, clock, chunk).

- ``sync``: each chunk sums every worker's gradient for step ``t`` and is
  updated once the last one arrives; a read at clock ``t + 1`` waits for
  that. A push for a later step waits until the chunk's step ``t`` is done.
- ``ssp`` (stale synchronous parallel, Ho et al. 2013): every push is
  applied at once; a worker at clock ``c`` may read a chunk only when every
  worker's pushes up to step ``c - staleness - 1`` reached it.
- ``async``: every push is applied at once; reads never wait.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from ..errors import ConfigError, InvalidArgument

__all__ = ("Clocks", "Decision", "Mode")

Mode = Literal["sync", "ssp", "async"]
MODES: tuple[Mode, ...] = ("sync", "ssp", "async")


class Decision(enum.Enum):
    """What to do with a push."""

    APPLY = "apply"
    DUPLICATE = "duplicate"  # every chunk took it before: a retry
    WAIT = "wait"  # sync: a chunk is still collecting an earlier step


@dataclasses.dataclass(slots=True)
class _Chunk:
    taken: list[int]  # per worker: pushes this chunk took (the next clock expected)
    step: int = 0  # sync: steps applied; the step being collected
    done: set[int] = dataclasses.field(default_factory=set)  # sync: pushed for ``step``
    lost: int = 0  # steps skipped after a restore from an older checkpoint


class Clocks:
    """The clocks of ``num_workers`` workers on the chunks of one shard.

    Raises:
        ConfigError: an unknown mode, fewer than one worker, negative staleness.
    """

    def __init__(self, mode: str, num_workers: int, staleness: int = 0) -> None:
        if mode not in MODES:
            raise ConfigError(f"consistency must be one of {MODES}, got {mode!r}")
        if num_workers < 1:
            raise ConfigError(f"num_workers must be at least 1, got {num_workers}")
        if staleness < 0:
            raise ConfigError(f"staleness must be at least 0, got {staleness}")
        self.mode: str = mode
        self.num_workers = num_workers
        self.staleness = staleness
        self.chunks: dict[str, _Chunk] = {}

    # -- bookkeeping ------------------------------------------------------------

    def add(self, key: str) -> None:
        """Track a new chunk (at clock 0 for every worker)."""
        self.chunks.setdefault(key, _Chunk([0] * self.num_workers))

    def check_worker(self, worker: int) -> None:
        """Raises InvalidArgument for a worker outside ``0 .. num_workers - 1``."""
        if not 0 <= worker < self.num_workers:
            raise InvalidArgument(f"worker {worker} is not in 0..{self.num_workers - 1}")

    def _get(self, keys: Iterable[str]) -> list[tuple[str, _Chunk]]:
        try:
            return [(key, self.chunks[key]) for key in keys]
        except KeyError as exc:
            raise InvalidArgument(f"chunk {exc} is not initialized on this shard") from None

    @property
    def step(self) -> int:
        """sync: the step every chunk has completed (0 without chunks)."""
        return min((c.step for c in self.chunks.values()), default=0)

    @property
    def clocks(self) -> list[int]:
        """Per worker: the pushes every chunk has taken from it."""
        if not self.chunks:
            return [0] * self.num_workers
        return [min(c.taken[w] for c in self.chunks.values()) for w in range(self.num_workers)]

    @property
    def lost_steps(self) -> int:
        """The most steps any chunk skipped after restarting from an older checkpoint."""
        return max((c.lost for c in self.chunks.values()), default=0)

    # -- pushes -----------------------------------------------------------------

    def decide(self, worker: int, clock: int, keys: Iterable[str],
               seen: int = 0) -> Decision:
        """What :meth:`admit` would decide, without changing anything: the
        predicate a waiting push re-evaluates.

        ``seen`` is the clock of the worker's latest read of these chunks; a
        sync chunk behind it is judged as if it had already skipped ahead.

        Raises:
            InvalidArgument: unknown worker or chunk, or a negative clock.
        """
        self.check_worker(worker)
        if clock < 0:
            raise InvalidArgument(f"clock must be at least 0, got {clock}")
        fresh = False
        for _, chunk in self._get(keys):
            if self.mode == "sync":
                # A chunk behind ``seen`` jumps to it and forgets who pushed.
                step = max(chunk.step, seen)
                done = chunk.done if step == chunk.step else ()
                if clock > step:
                    # Ahead of the chunk: the rest of the current step is on
                    # its way (pushes may arrive out of order after a retry).
                    # Only a worker that has read a later step (``seen``)
                    # proves the shard restarted from an older one.
                    return Decision.WAIT
                if clock == step and worker not in done:
                    fresh = True
            elif clock >= chunk.taken[worker]:
                fresh = True
        return Decision.APPLY if fresh else Decision.DUPLICATE

    def admit(self, worker: int, clock: int, keys: Iterable[str],
              seen: int = 0) -> tuple[Decision, list[str]]:
        """May ``worker``'s push for step ``clock`` to ``keys`` be applied now?

        ``seen`` is the clock of the worker's latest read of these chunks.
        Returns the decision (:meth:`decide`'s) and, in sync mode, the chunks
        whose partly collected step was dropped: a chunk behind ``seen`` lost
        steps (the shard restarted from an older checkpoint) and jumps ahead,
        which this call does. A push ahead of a chunk's step otherwise waits
        for that step to complete.

        Raises:
            InvalidArgument: unknown worker or chunk, or a negative clock.
        """
        decision = self.decide(worker, clock, keys, seen)
        dropped: list[str] = []
        if self.mode == "sync":
            for key, chunk in self._get(keys):
                if seen > chunk.step:
                    if chunk.done:
                        dropped.append(key)
                    self._skip(chunk, seen)
        return decision, dropped

    def _skip(self, chunk: _Chunk, step: int) -> None:
        chunk.lost += step - chunk.step
        chunk.step = step
        chunk.done.clear()
        chunk.taken = [max(t, step) for t in chunk.taken]

    def accepts(self, worker: int, clock: int, key: str) -> bool:
        """Whether chunk ``key`` takes this push (False: it took it before)."""
        chunk = self.chunks[key]
        if self.mode == "sync":
            return clock == chunk.step and worker not in chunk.done
        return clock >= chunk.taken[worker]

    def record(self, worker: int, clock: int, key: str) -> bool:
        """Note that chunk ``key`` took the push; True when (sync) that
        completes the chunk's step: the caller applies the sum and calls
        :meth:`advance`."""
        chunk = self.chunks[key]
        chunk.taken[worker] = max(chunk.taken[worker], clock + 1)
        if self.mode != "sync":
            return False
        chunk.done.add(worker)
        return len(chunk.done) == self.num_workers

    def advance(self, key: str) -> None:
        """sync: the chunk's collected step was applied; collect the next one."""
        chunk = self.chunks[key]
        chunk.step += 1
        chunk.done.clear()

    # -- reads ------------------------------------------------------------------

    def _chunk_ready(self, chunk: _Chunk, clock: int) -> bool:
        if self.mode == "sync":
            return chunk.step >= clock
        if self.mode == "ssp":
            return min(chunk.taken) >= clock - self.staleness
        return True

    def ready(self, worker: int, clock: int, keys: Iterable[str]) -> bool:
        """May ``worker`` read ``keys`` now, at ``clock`` (the steps it has pushed)?

        Raises:
            InvalidArgument: unknown worker or chunk.
        """
        self.check_worker(worker)
        return all(self._chunk_ready(chunk, clock) for _, chunk in self._get(keys))

    def behind(self, clock: int, keys: Iterable[str]) -> list[int]:
        """The workers a read of ``keys`` at ``clock`` waits for."""
        late: set[int] = set()
        for _, chunk in self._get(keys):
            if self._chunk_ready(chunk, clock):
                continue
            if self.mode == "sync":
                late.update(w for w in range(self.num_workers) if w not in chunk.done)
            else:
                late.update(w for w, t in enumerate(chunk.taken) if t < clock - self.staleness)
        return sorted(late)

    def waiting_for(self, keys: Iterable[str]) -> list[int]:
        """sync: the workers whose push for the steps being collected is missing."""
        late: set[int] = set()
        for _, chunk in self._get(keys):
            if chunk.done:
                late.update(w for w in range(self.num_workers) if w not in chunk.done)
        return sorted(late)

    # -- moving chunks between shards -----------------------------------------------

    def export(self, key: str) -> dict[str, Any]:
        """Everything chunk ``key``'s clocks know, for another shard's :meth:`adopt`:
        the idempotence keys (per-worker pushes taken, the sync step and who
        pushed for it) travel with the chunk.

        Raises:
            InvalidArgument: unknown chunk.
        """
        ((_, chunk),) = self._get([key])
        return {"taken": list(chunk.taken), "step": chunk.step, "done": sorted(chunk.done),
                "lost": chunk.lost}

    def adopt(self, key: str, state: Mapping[str, Any]) -> None:
        """Track chunk ``key`` with the clocks :meth:`export` gave.

        Raises:
            InvalidArgument: the state is for another number of workers.
        """
        taken = [int(t) for t in state["taken"]]
        if len(taken) != self.num_workers:
            raise InvalidArgument(
                f"chunk {key!r} comes with {len(taken)} workers, the job has {self.num_workers}")
        self.chunks[key] = _Chunk(taken, int(state["step"]), {int(w) for w in state["done"]},
                                  int(state["lost"]))

    def remove(self, key: str) -> None:
        """Forget chunk ``key`` (it moved to another shard)."""
        self.chunks.pop(key, None)

    # -- checkpoints ------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The state a checkpoint keeps (partly collected steps are not kept)."""
        return {key: {"taken": list(c.taken), "step": c.step} for key, c in self.chunks.items()}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take the state of :meth:`snapshot`.

        Raises:
            InvalidArgument: the snapshot is for another number of workers.
        """
        for key, saved in state.items():
            taken = [int(t) for t in saved["taken"]]
            if len(taken) != self.num_workers:
                raise InvalidArgument(
                    f"checkpoint has {len(taken)} workers, the job {self.num_workers}")
            self.chunks[key] = _Chunk(taken, int(saved["step"]))
