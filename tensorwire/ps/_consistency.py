"""Per-worker clocks of one shard and the rules of the three consistency modes.

Pure bookkeeping, no asyncio: the shard asks whether a push may be applied
and whether a worker may read, and waits itself when the answer is "not yet".

A worker's *clock* is the number of steps it has pushed; its push for step
``t`` carries clock ``t`` and its pull after that push carries ``t + 1``.

- ``sync``: the shard sums every worker's gradient for step ``t`` and
  applies them together; a pull at clock ``t + 1`` waits for that. A push
  for a later step waits until step ``t`` is complete.
- ``ssp`` (stale synchronous parallel, Ho et al. 2013): every push is
  applied at once; a worker at clock ``c`` may read only when the slowest
  worker has clock ``c - staleness`` or more.
- ``async``: every push is applied at once; reads never wait.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

from ..errors import ConfigError, InvalidArgument

__all__ = ("Clocks", "Decision", "Mode")

Mode = Literal["sync", "ssp", "async"]
MODES: tuple[Mode, ...] = ("sync", "ssp", "async")


class Decision(enum.Enum):
    """What to do with a push."""

    APPLY = "apply"
    DUPLICATE = "duplicate"  # applied before: drop it (a retry)
    WAIT = "wait"  # a later step than the one being collected (sync only)


class Clocks:
    """The clocks of ``num_workers`` workers on one shard.

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
        #: Steps pushed, per worker (the next clock each worker will push).
        self.clocks = [0] * num_workers
        #: sync: steps fully applied; the step being collected.
        self.step = 0
        #: sync: workers whose push for ``step`` has arrived.
        self.done: set[int] = set()
        #: Steps skipped because the shard lost them (restored from an older checkpoint).
        self.lost_steps = 0

    def _check_worker(self, worker: int) -> None:
        if not 0 <= worker < self.num_workers:
            raise InvalidArgument(f"worker {worker} is not in 0..{self.num_workers - 1}")

    def admit(self, worker: int, clock: int, seen: int = 0) -> Decision:
        """May the push of ``worker`` for step ``clock`` be applied now?

        ``seen`` is the clock of the worker's latest read from this shard. In
        sync mode, a ``seen`` beyond the step being collected, or a push for
        a later step when nothing of the current one has arrived, means this
        shard lost steps (it was restored from an older checkpoint): it jumps
        ahead, dropping what it collected of the lost step.

        Raises:
            InvalidArgument: unknown worker or a negative clock.
        """
        self._check_worker(worker)
        if clock < 0:
            raise InvalidArgument(f"clock must be at least 0, got {clock}")
        if self.mode != "sync":
            return Decision.APPLY
        if seen > self.step:
            self._skip_to(seen)
        if clock < self.step or (clock == self.step and worker in self.done):
            return Decision.DUPLICATE
        if clock > self.step:
            if self.done:
                return Decision.WAIT
            self._skip_to(clock)
        return Decision.APPLY

    def _skip_to(self, step: int) -> None:
        self.lost_steps += step - self.step
        self.step = step
        self.done.clear()
        self.clocks = [max(c, step) for c in self.clocks]

    def record(self, worker: int, clock: int) -> bool:
        """Note that the push of ``worker`` for ``clock`` was taken.

        Returns True in sync mode when that push completes the step: the
        caller applies the step's sum and calls :meth:`advance`.
        """
        self.clocks[worker] = max(self.clocks[worker], clock + 1)
        if self.mode != "sync":
            return False
        self.done.add(worker)
        return len(self.done) == self.num_workers

    def advance(self) -> None:
        """sync: the collected step was applied; collect the next one."""
        self.step += 1
        self.done.clear()

    def ready(self, worker: int, clock: int) -> bool:
        """May ``worker`` read now, at ``clock`` (the steps it has pushed)?

        Raises:
            InvalidArgument: unknown worker.
        """
        self._check_worker(worker)
        if self.mode == "sync":
            return self.step >= clock
        if self.mode == "ssp":
            return min(self.clocks) >= clock - self.staleness
        return True

    def behind(self, clock: int) -> list[int]:
        """The workers a read at ``clock`` waits for."""
        if self.mode == "sync":
            if self.step >= clock:
                return []
            return [w for w in range(self.num_workers) if w not in self.done]
        if self.mode == "ssp":
            return [w for w, c in enumerate(self.clocks) if c < clock - self.staleness]
        return []

    def push_may_wait_for(self) -> list[int]:
        """sync: the workers whose push for the collected step is missing."""
        return [w for w in range(self.num_workers) if w not in self.done]

    def snapshot(self) -> dict[str, Any]:
        """The state a checkpoint keeps (the partly collected step is not kept)."""
        return {"clocks": list(self.clocks), "step": self.step}

    def restore(self, state: dict[str, Any]) -> None:
        """Take the state of :meth:`snapshot`.

        Raises:
            InvalidArgument: the snapshot is for another number of workers.
        """
        clocks = [int(c) for c in state["clocks"]]
        if len(clocks) != self.num_workers:
            raise InvalidArgument(
                f"checkpoint has {len(clocks)} workers, the job {self.num_workers}"
            )
        self.clocks = clocks
        self.step = int(state["step"])
        self.done.clear()
