"""One step of a worker pushed in parts (:meth:`PSClient.begin_step`).

A DDP hook gets a model's gradients a bucket at a time, while the backward
pass goes on; pushing each bucket at once overlaps communication with it.
The shards keep their clocks, sync sums and error-feedback residuals per
chunk, and every part carries the step's clock, so a step pushed in parts
changes the shards exactly as one push of the same gradients would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import FailedPrecondition, InvalidArgument
from ._arrivals import Arrivals

if TYPE_CHECKING:
    from .client import PSClient

__all__ = ("Step",)

Array = np.ndarray[Any, Any]


class Step:
    """The parts of one step: made by :meth:`PSClient.begin_step`.

    Each tensor is pushed in exactly one part; the step is :attr:`complete`
    when every tensor was. Parts may be pushed while earlier ones are still
    in flight; each part's messages go to the shards at once.

    Attributes:
        clock: the step's clock (the worker's steps before it).
    """

    def __init__(self, client: PSClient, clock: int, names: Sequence[str]) -> None:
        self.clock = clock
        self._client = client
        self._order = {name: i for i, name in enumerate(names)}
        self._left = set(names)
        self._parts = 0

    @property
    def complete(self) -> bool:
        """Whether every tensor was pushed."""
        return not self._left

    @property
    def missing(self) -> list[str]:
        """The tensors not pushed yet, in the model's order."""
        return sorted(self._left, key=self._order.__getitem__)

    def push(self, grads: Mapping[str, Array]) -> asyncio.Task[None]:
        """Push the gradients of some tensors of this step; the task
        finishes when every shard took them.

        Raises:
            InvalidArgument: no gradient, an unknown tensor, one pushed in
                an earlier part of this step, a wrong shape.
            FailedPrecondition: the step is not the client's current one
                (the placement was initialized again).
            DeadlineExceeded: (from the task) as :meth:`PSClient.push`.
        """
        payloads, order, first = self._take(grads, "push")
        client = self._client

        async def push() -> None:
            with client._operation("push", self.clock):
                await client._run("push", self.clock, payloads, order=order,
                                  keys=set(payloads), first=first)

        return asyncio.get_running_loop().create_task(push())

    def push_pull(self, grads: Mapping[str, Array]) -> asyncio.Task[dict[str, Array]]:
        """Push some tensors' gradients and read those tensors back at the
        next clock (as :meth:`PSClient.push_pull` does for all of them).

        Raises:
            What :meth:`push` raises.
        """
        return self.push_pull_each(grads).task  # type: ignore[return-value]

    def push_pull_each(self, grads: Mapping[str, Array]) -> Arrivals:
        """:meth:`push_pull`, handing back each tensor as soon as it arrived.

        Raises:
            What :meth:`push` raises.
        """
        payloads, order, first = self._take(grads, "push_pull")
        return self._client._arrivals("push_pull", self.clock, payloads, order,
                                      names=list(grads), first=first)

    def _take(self, grads: Mapping[str, Array], what: str
              ) -> tuple[dict[str, Any], dict[str, int] | None, bool]:
        """Check a part, compress it and mark its tensors pushed, before any await."""
        if self._client._step is not self:
            raise FailedPrecondition(f"step {self.clock} is no longer the client's current "
                                     "step: init() placed the tensors again")
        if not grads:
            raise InvalidArgument(f"step.{what}() needs at least one gradient")
        unknown = [name for name in grads if name not in self._order]
        if unknown:
            raise InvalidArgument(f"step.{what}(): unknown tensors {sorted(unknown)[:5]}")
        again = [name for name in grads if name not in self._left]
        if again:
            raise InvalidArgument(f"step.{what}(): {sorted(again)[:5]} were pushed in an "
                                  f"earlier part of step {self.clock}")
        payloads = self._client._compress(grads)
        self._left.difference_update(grads)
        first = self._parts == 0
        self._parts += 1
        # A part's messages queue for the shards' windows in the order they
        # were pushed, even with priorities on. In sync mode a message holds
        # its window place while the shard waits for the other workers'
        # gradients of its chunks; if a later part's more urgent messages
        # could overtake queued ones, two workers that got their parts at
        # different moments would each hold places the other waits for (a
        # deadlock the DDP benchmark hit). Every worker pushes the parts in
        # the same order, so in pushed order the oldest message is in
        # flight everywhere and finishes.
        order = {name: i for i, name in enumerate(grads)}
        return payloads, order, first
