"""Horovod's shape without DDP: a distributed optimizer and start-of-training broadcasts.

``DistributedOptimizer`` wraps any ``torch.optim.Optimizer``. A hook on each
parameter starts that gradient's allreduce as soon as autograd has
accumulated it (Horovod's ``horovod/torch/optimizer.py`` does the same), so
communication overlaps the rest of the backward pass; ``step()`` first
waits for every reduction (``synchronize()``), then steps the wrapped
optimizer.
"""

from __future__ import annotations

import concurrent.futures
import io
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from ..collective import Algorithm, ReduceOp, SyncGroup
from ..errors import FailedPrecondition, InvalidArgument

__all__ = ("DistributedOptimizer", "broadcast_optimizer_state", "broadcast_parameters")


class DistributedOptimizer:
    """``optimizer`` with its gradients averaged over ``group`` before each step.

    Gradients are reduced in place, each as soon as autograd has it, in a
    fixed order (the reverse of the parameters' order, the order backward
    usually produces them): one that is ready early waits only for those
    before it, so every rank queues the same operations in the same order.
    Every rank must produce gradients for the same parameters.

    Gradient accumulation, as Horovod spells it: with
    ``backward_passes_per_step=N`` a gradient is reduced when autograd has
    accumulated it for the N-th time since the last ``step()``, so N
    micro-batches are summed locally and cross the network once (divide
    the loss by N for their mean). A further backward pass before
    ``step()`` raises ``FailedPrecondition`` from ``backward()``: its
    gradient was added into a tensor whose reduction is in flight, so the
    step's gradients are not to be trusted.

    Args:
        optimizer: any ``torch.optim.Optimizer``; its parameters are reduced.
        group: the ranks to average over.
        op: ``ReduceOp.AVG`` (default) or ``ReduceOp.SUM``.
        algorithm: the group's algorithm choice per gradient.
        backward_passes_per_step: backward passes accumulated per ``step()``.

    Raises:
        InvalidArgument: a parameter that is not a leaf, or one listed
            twice; ``backward_passes_per_step`` below 1.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, group: SyncGroup, *,
                 op: ReduceOp | str = ReduceOp.AVG, algorithm: Algorithm = "auto",
                 backward_passes_per_step: int = 1) -> None:
        if (not isinstance(backward_passes_per_step, int)
                or isinstance(backward_passes_per_step, bool) or backward_passes_per_step < 1):
            raise InvalidArgument(f"backward_passes_per_step must be an int of at least 1, "
                                  f"got {backward_passes_per_step!r}")
        self.optimizer = optimizer
        self.group = group
        self.op = ReduceOp(op)
        self.algorithm: Algorithm = algorithm
        self.backward_passes_per_step = backward_passes_per_step
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        if len({id(p) for p in params}) != len(params):
            raise InvalidArgument("a parameter appears twice in the optimizer's groups")
        self._order: list[torch.Tensor] = params[::-1]
        self._index = {id(p): i for i, p in enumerate(self._order)}
        #: Backward passes each parameter's gradient has had since the last step.
        self._passes = [0] * len(self._order)
        self._next = 0
        self._pending: list[concurrent.futures.Future[Any]] = []
        self._handles = []
        for p in params:
            if not p.is_leaf:
                raise InvalidArgument("DistributedOptimizer needs leaf parameters")
            self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _on_grad(self, param: torch.Tensor) -> None:
        """Autograd accumulated ``param``'s gradient: start what may start, in order."""
        index = self._index[id(param)]
        self._passes[index] += 1
        if self._passes[index] > self.backward_passes_per_step:
            raise FailedPrecondition(
                f"a gradient was computed {self._passes[index]} times since the last step(), "
                f"with backward_passes_per_step={self.backward_passes_per_step}: its reduction "
                f"was already under way (call step(), or raise backward_passes_per_step to "
                f"accumulate more passes locally)")
        # In order: each gradient waits for those before it to have had
        # all their passes.
        while (self._next < len(self._order)
               and self._passes[self._next] >= self.backward_passes_per_step):
            self._launch(self._order[self._next])
            self._next += 1

    def _launch(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        if not grad.is_contiguous():
            param.grad = grad = grad.contiguous()
        self._pending.append(self.group.submit_allreduce(grad, self.op,
                                                         algorithm=self.algorithm))

    def synchronize(self) -> None:
        """Start what backward left (parameters without a hook call) and wait for all.

        Raises:
            CollectiveError: a reduction failed (``RankFailedError``, ...).
        """
        for param in self._order[self._next:]:
            self._launch(param)
        pending, self._pending = self._pending, []
        self._next = 0
        self._passes = [0] * len(self._order)
        for future in pending:
            future.result()

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """``synchronize()``, then the wrapped optimizer's ``step``.

        Raises:
            What :meth:`synchronize` raises.
        """
        self.synchronize()
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's state."""
        return self.optimizer.state

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict``."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The wrapped optimizer's ``load_state_dict``."""
        self.optimizer.load_state_dict(state_dict)

    def remove_hooks(self) -> None:
        """Stop reducing gradients (the wrapped optimizer is left as it was)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    | Iterable[torch.Tensor],
    group: SyncGroup, *, root_rank: int = 0,
) -> None:
    """Copy ``root_rank``'s tensors into every rank's, in place.

    ``params`` is a ``state_dict()``, ``named_parameters()`` or a list of
    tensors, in the same order on every rank. The broadcasts are queued at
    once and pipelined.

    Raises:
        InvalidArgument: a tensor that is not contiguous.
        CollectiveError: a broadcast failed.
    """
    items = params.values() if isinstance(params, Mapping) else params
    tensors = [t[1] if isinstance(t, tuple) else t for t in items]
    pending = [group.submit_broadcast(t.data, root_rank) for t in tensors]
    for future in pending:
        future.result()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer | DistributedOptimizer,
                              group: SyncGroup, *, root_rank: int = 0) -> None:
    """Give every rank ``root_rank``'s optimizer state (moments, step counts, settings).

    The root's ``state_dict()`` travels serialized by ``torch.save`` and is
    loaded with ``weights_only=True`` (tensors and plain values only).

    Raises:
        CollectiveError: a broadcast failed.
    """
    size = np.zeros(1, np.int64)
    blob = b""
    if group.rank == root_rank:
        out = io.BytesIO()
        torch.save(optimizer.state_dict(), out)
        blob = out.getvalue()
        size[0] = len(blob)
    group.broadcast(size, root_rank)
    data = np.frombuffer(bytearray(blob), np.uint8) if blob else np.empty(int(size[0]), np.uint8)
    group.broadcast(data, root_rank)
    if group.rank != root_rank:
        state = torch.load(io.BytesIO(data.tobytes()), weights_only=True)
        optimizer.load_state_dict(state)
