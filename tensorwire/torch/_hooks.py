"""DDP communication hooks: gradients through a tensorwire group or parameter server.

``DistributedDataParallel.register_comm_hook(state, hook)`` calls ``hook``
with each bucket of gradients as soon as the backward pass filled it; the
hook returns a ``torch.futures.Future`` of the reduced bucket and DDP waits
for all of them at the end of the backward pass (torch's
``ddp_comm_hooks/default_hooks.py`` has the same shape). Here the hook
hands the bucket to the group's (or the parameter server's) event loop,
which runs in a background thread, and returns at once: communication runs
while autograd computes the next buckets, and the loop thread completes the
torch future when the bucket is back.
"""

# No ``from __future__ import annotations``: DDP checks the hooks' annotations
# against dist.GradBucket and torch.futures.Future[torch.Tensor] as objects.
import concurrent.futures
import functools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
import torch.distributed as dist

from ..collective import Algorithm, Group, ReduceOp, SyncGroup
from ..errors import ConfigError
from ..ps import Aggregate, CompressionSpec, SyncClient, SyncStep, compressor_for
from ._compressed import CompressedAllreduce

__all__ = ("AllreduceState", "PSState", "allreduce_hook", "ps_hook")

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket
else:
    # DDP checks that a hook's ``bucket`` is annotated with this very class,
    # which torch's stubs do not show in torch.distributed.
    GradBucket = dist.GradBucket


class AllreduceState:
    """The state of :func:`allreduce_hook`: which group, how, and what compression.

    Args:
        group: the ranks to average over; usually every DDP rank
            (``collective.SyncGroup.from_env()``). Its configuration (the
            algorithm thresholds, hierarchical topology, timeouts,
            transport) applies to every bucket.
        algorithm: ``"auto"`` (the group's choice by size and topology),
            ``"ring"``, ``"tree"`` or ``"hierarchical"``.
        compression: ``None``, or a codec of :func:`tensorwire.ps.compressor_for`
            (``"fp16"``, ``"bf16"``, ``"int8"``, ``"fp8"``, ``"topk"``, a
            :class:`~tensorwire.ps.Compressor`). ``"fp16"`` and ``"bf16"``
            reduce in that precision (half the bytes of every algorithm); the
            others allgather each rank's payload and decode it on every rank.
            Lossy codecs keep error feedback per bucket: what a step's
            compression dropped is added to the next step's gradient.
        timeout: per bucket, seconds; default the group's.

    Attributes:
        error: the first failure of a bucket (also raised in ``backward``).

    Raises:
        ConfigError: an unknown codec.
    """

    def __init__(self, group: SyncGroup, *, algorithm: Algorithm = "auto",
                 compression: CompressionSpec = None, timeout: float | None = None) -> None:
        self.group = group
        self.algorithm: Algorithm = algorithm
        self.timeout = timeout
        codec = compressor_for(compression)
        self.compressed = (None if codec.name == "none"
                           else CompressedAllreduce(codec, algorithm=algorithm, timeout=timeout))
        self.error: BaseException | None = None


def allreduce_hook(state: AllreduceState,
                   bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over ``state.group``; DDP's ``register_comm_hook`` hook.

    ::

        group = collective.SyncGroup.from_env()
        model = DistributedDataParallel(model)
        model.register_comm_hook(tensorwire.torch.AllreduceState(group),
                                 tensorwire.torch.allreduce_hook)

    The bucket (a contiguous CPU tensor, or CUDA with ucx://) is reduced in
    place, without a copy; the future is completed by the group's loop
    thread. With compression, whose codecs run in NumPy, a CUDA bucket is
    copied to host memory and the result back. A failure (a rank that died:
    :class:`RankFailedError`) fails the future, and with it the backward
    pass: DDP raises it as a RuntimeError whose text starts
    ``tensorwire RankFailedError:``; ``state.error`` is
    the original exception.
    """
    buffer = bucket.buffer()
    compressed = state.compressed
    if compressed is None:
        done = state.group.submit(functools.partial(
            _average, buffer, algorithm=state.algorithm, timeout=state.timeout))
    else:
        index = bucket.index()
        # Copied here, on the thread whose stream computed the gradients.
        host = _on_host(buffer)
        done = state.group.submit(functools.partial(_reduce_on_host, compressed, index,
                                                    buffer, host))
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.add_done_callback(functools.partial(_complete, state, future, [buffer]))
    return future


def _average(buffer: torch.Tensor, group: Group, *, algorithm: Algorithm,
             timeout: float | None) -> Any:
    return group.allreduce(buffer, ReduceOp.AVG, algorithm=algorithm, timeout=timeout)


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in host memory: itself on the CPU (``cpu()`` copies only
    from a device), else a copy there."""
    return tensor.detach().cpu()


async def _reduce_on_host(compressed: CompressedAllreduce, index: int, buffer: torch.Tensor,
                          host: torch.Tensor, group: Group) -> torch.Tensor:
    """The compressed average of ``host`` (``buffer``'s data in host memory),
    written back into ``buffer`` if that is on a device."""
    await compressed.run(group, index, host)
    if host.data_ptr() != buffer.data_ptr():
        buffer.copy_(host)
    return buffer


def _complete(state: "AllreduceState | PSState",
              futures: torch.futures.Future[torch.Tensor] | list[torch.futures.Future[Any]],
              results: Sequence[torch.Tensor], done: concurrent.futures.Future[Any]) -> None:
    """Pass the outcome of ``done`` on to the torch futures (on the loop thread)."""
    targets = futures if isinstance(futures, list) else [futures]
    error = (concurrent.futures.CancelledError() if done.cancelled() else done.exception())
    if error is not None and state.error is None:
        state.error = error
        logger.error("a gradient bucket failed: %s", error)
    if error is not None:
        # DDP's C++ reducer turns a failed hook future into a RuntimeError
        # carrying only its text, so the text names the error's type.
        error = _for_torch(error)
    for target, result in zip(targets, results, strict=True):
        if error is not None:
            target.set_exception(error)
        else:
            target.set_result(result)


def _for_torch(error: BaseException) -> Exception:
    """``error`` as a torch future can carry it: a RuntimeError naming its type."""
    wrapped = RuntimeError(f"tensorwire {type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped


Mode = Literal["gradient", "parameters"]


class PSState:
    """The state of :func:`ps_hook`: a parameter-server client and the model's names.

    Initializes the shards with rank 0's parameters and copies what the
    shards hold into ``module``, so every worker starts from the same
    values (call it on every worker, after building the model).

    With an :class:`~tensorwire.ps.Aggregate` client (``mode="gradient"``)
    the shards sum the workers' gradients and the hook returns their mean,
    which DDP writes into ``.grad`` for the local optimizer. With a
    server-side optimizer (:class:`~tensorwire.ps.SGD`, ``Adam``, ...;
    ``mode="parameters"``) the shards update the parameters: the hook writes
    them into the model and returns a zero gradient, so the local optimizer
    has nothing to do (use none, or plain SGD without weight decay).

    Args:
        client: a :class:`tensorwire.ps.SyncClient` of this worker.
        module: the model (the module DDP wraps); its parameter names are
            the shards' keys.

    Attributes:
        mode: ``"gradient"`` or ``"parameters"``, from the client's optimizer.
        error: the first failure of a push (also raised in ``backward``).

    Raises:
        ConfigError: a parameter shared between two names.
        What :meth:`tensorwire.ps.SyncClient.init` raises.
    """

    def __init__(self, client: SyncClient, module: torch.nn.Module) -> None:
        self.client = client
        params = dict(module.named_parameters())
        self._names: dict[int, str] = {}
        for name, param in params.items():
            if param.data_ptr() in self._names:
                raise ConfigError(f"parameter {name!r} shares its memory with "
                                  f"{self._names[param.data_ptr()]!r}")
            self._names[param.data_ptr()] = name
        self._params = params
        self.mode: Mode = ("gradient" if isinstance(client.client.job.optimizer, Aggregate)
                           else "parameters")
        self.num_workers = client.client.job.num_workers
        start = client.init({name: _on_host(p).numpy() for name, p in params.items()})
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(torch.from_numpy(np.asarray(start[name])).view_as(param))
        #: The step being pushed, bucket by bucket (begun at bucket 0).
        self._step: SyncStep | None = None
        self.error: BaseException | None = None

    def _part(self, bucket: GradBucket) -> tuple[dict[str, np.ndarray[Any, Any]],
                                                 dict[str, torch.Tensor]]:
        """The bucket's gradients by parameter name: as arrays to push (in
        host memory: the shards' optimizers run in NumPy, so CUDA gradients
        are copied), and as the views of the bucket's buffer to write the
        answer into."""
        views = {self._names[param.data_ptr()]: grad
                 for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True)}
        return {name: _on_host(grad).numpy() for name, grad in views.items()}, views

    def _finish(self, views: dict[str, torch.Tensor], result: dict[str, Any]) -> None:
        """Write the shards' answer into a bucket (and, for parameters, the model)."""
        with torch.no_grad():
            for name, view in views.items():
                value = torch.from_numpy(np.asarray(result[name])).view_as(view)
                if self.mode == "gradient":
                    view.copy_(value).div_(self.num_workers)
                else:
                    # Autograd is done with this parameter: its bucket is
                    # ready only once every use of it has its gradient.
                    self._params[name].copy_(value)
                    view.zero_()


def ps_hook(state: PSState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Push each bucket's gradients to the parameter server; DDP's comm hook.

    The first bucket of a backward pass begins a step
    (:meth:`tensorwire.ps.SyncClient.begin_step`); each bucket is pushed as
    a part of it as soon as DDP hands it over, while autograd computes the
    next ones, and its future is completed when the shards answered for
    its parameters (see :class:`PSState` for the two modes). The keys are
    the parameter names, which stay put when DDP rebuilds its buckets after
    the first step. A step pushed in parts leaves the shards exactly where
    one push of the whole model would.

    Raises:
        FailedPrecondition: the previous backward pass stopped part-way, so
            its step lacks some buckets (in sync mode the shards wait for
            them; restart from a checkpoint).
    """
    if bucket.index() == 0:
        state._step = state.client.begin_step()
    step = state._step
    if step is None:  # pragma: no cover - DDP hands bucket 0 first
        raise ConfigError("ps_hook got a bucket before bucket 0 of the step")
    grads, views = state._part(bucket)
    done = step.submit_push_pull(grads)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    buffer = bucket.buffer()

    def finish(done: concurrent.futures.Future[Any]) -> None:
        if not done.cancelled() and done.exception() is None:
            try:
                state._finish(views, done.result())
            except Exception as exc:  # a shard answered something that does not fit
                failed: concurrent.futures.Future[Any] = concurrent.futures.Future()
                failed.set_exception(exc)
                done = failed
        _complete(state, future, [buffer], done)

    done.add_done_callback(finish)
    return future
