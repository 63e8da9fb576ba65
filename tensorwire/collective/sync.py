"""Blocking collectives for plain training loops (no asyncio in the caller).

Runs a :class:`Group` on an event loop in a background thread, like
:class:`tensorwire.rpc.SyncClient` and :class:`tensorwire.ps.SyncClient`.
Every operation blocks until it is done; each ``submit_*`` twin returns a
``concurrent.futures.Future`` at once, so communication overlaps
computation::

    with collective.SyncGroup.from_env() as group:     # torchrun, tensorwire launch
        group.allreduce(grad)                          # in place
        group.broadcast(params, src=0)                 # torch's spelling; root= works too
        parts = [np.empty_like(x) for _ in range(group.world_size)]
        group.all_gather(parts, x)                     # torch's list output
        future = group.submit_allreduce(other)         # returns at once
        ...
        future.result()

The operations keep :class:`Group`'s rules: every rank calls the same
operations in the same order (calls run in the order they are made, from
whichever thread), arrays are contiguous and reduced in place. Beside our
names this facade takes ``torch.distributed``'s: ``src=`` / ``dst=`` for
the root, ``all_gather(tensor_list, tensor)`` and ``gather(tensor,
gather_list, dst)`` filling lists.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from .._background import BackgroundLoop, HasBackgroundLoop
from ..errors import InvalidArgument
from ._arrays import ReduceOp
from .config import GroupConfig
from .group import Algorithm, Group

__all__ = ("SyncGroup",)

T = TypeVar("T")


def _root(root: int | None, other: int | None, names: tuple[str, str], default: int = 0) -> int:
    """One root from ours (``root=``) and torch's (``src=``/``dst=``) spelling.

    Raises:
        InvalidArgument: both are given and differ.
    """
    if root is not None and other is not None and root != other:
        raise InvalidArgument(f"{names[0]}={root!r} and {names[1]}={other!r} disagree")
    if root is not None:
        return root
    return default if other is None else other


class SyncGroup:
    """A :class:`Group` whose operations block; its event loop runs in a thread.

    Make one with :meth:`create` or :meth:`from_env` (they join at once). A
    group belongs to the loop it was created on, so a ``SyncGroup`` always
    joins its own, on its own loop.

    Attributes:
        group: the async group underneath (use it only on :attr:`loop`).
        loop: the event loop the group runs on, in a background thread.
        rank, world_size: as :class:`Group`'s.
    """

    def __init__(self, join: Callable[[], Coroutine[Any, Any, Group]], name: str,
                 loop_of: HasBackgroundLoop | None = None) -> None:
        self._background = BackgroundLoop(
            name, beside=None if loop_of is None else loop_of.background)
        self.loop = self._background.loop
        try:
            self.group: Group = self._background.run(join()).result()
        except BaseException:
            self._background.close()
            raise
        self.rank = self.group.rank
        self.world_size = self.group.world_size

    @classmethod
    def create(cls, *, rank: int, world_size: int, master: str, listen: str | None = None,
               host_master: bool | None = None, config: GroupConfig | None = None,
               loop_of: HasBackgroundLoop | None = None) -> SyncGroup:
        """Join a group as :meth:`Group.create` does; blocks until every rank joined.

        ``loop_of``: run on that facade's background loop thread rather
        than a new one (see the class).

        Raises:
            What :meth:`Group.create` raises.
            FailedPrecondition: ``loop_of`` is closed.
        """
        return cls(lambda: Group.create(rank=rank, world_size=world_size, master=master,
                                        listen=listen, host_master=host_master, config=config),
                   f"tensorwire-group rank {rank}", loop_of)

    @classmethod
    def from_env(cls, *, listen: str | None = None, config: GroupConfig | None = None,
                 environ: Mapping[str, str] | None = None,
                 loop_of: HasBackgroundLoop | None = None) -> SyncGroup:
        """Join the group a launcher describes, as :meth:`Group.from_env` does.

        ``loop_of``: as in :meth:`create`.

        Raises:
            What :meth:`Group.from_env` raises.
            FailedPrecondition: ``loop_of`` is closed.
        """
        return cls(lambda: Group.from_env(listen=listen, config=config, environ=environ),
                   "tensorwire-group", loop_of)

    @property
    def background(self) -> BackgroundLoop:
        """The background loop this group runs on; pass the group as
        ``loop_of=`` to run another facade on the same thread."""
        return self._background

    # -- running things on the loop -------------------------------------------------

    def submit(self, start: Callable[[Group], Any]) -> concurrent.futures.Future[Any]:
        """Run ``start(group)`` on the loop and await what it returns.

        ``start`` is called on the loop thread, in the order ``submit`` calls
        were made, so operations it queues keep that order.

        Raises:
            FailedPrecondition: the facade is closed.
        """
        async def run() -> Any:
            return await start(self.group)

        return self._background.run(run())

    def _wait(self, future: concurrent.futures.Future[T]) -> T:
        return self._background.wait(future)

    # -- collectives ----------------------------------------------------------------

    def submit_allreduce(self, x: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                         algorithm: Algorithm = "auto",
                         timeout: float | None = None) -> concurrent.futures.Future[Any]:
        """Start :meth:`Group.allreduce`; the future resolves to ``x``, reduced."""
        return self.submit(lambda g: g.allreduce(x, op, algorithm=algorithm, timeout=timeout))

    def allreduce(self, x: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                  algorithm: Algorithm = "auto", timeout: float | None = None) -> Any:
        """See :meth:`Group.allreduce`; blocks, returns ``x`` reduced in place.

        Raises:
            What :meth:`Group.allreduce` raises.
        """
        return self._wait(self.submit_allreduce(x, op, algorithm=algorithm, timeout=timeout))

    def submit_allreduce_many(
        self, tensors: Sequence[Any], op: ReduceOp | str = ReduceOp.SUM, *,
        priorities: Sequence[float] | None = None, bucket_bytes: int = 4 << 20,
        algorithm: Algorithm = "auto", timeout: float | None = None,
    ) -> concurrent.futures.Future[list[Any]]:
        """Start :meth:`Group.allreduce_many`; the future resolves when every array is done."""
        async def run(g: Group) -> list[Any]:
            futures = g.allreduce_many(tensors, op, priorities=priorities,
                                       bucket_bytes=bucket_bytes, algorithm=algorithm,
                                       timeout=timeout)
            return [await f for f in futures]

        return self.submit(run)

    def allreduce_many(self, tensors: Sequence[Any], op: ReduceOp | str = ReduceOp.SUM, *,
                       priorities: Sequence[float] | None = None, bucket_bytes: int = 4 << 20,
                       algorithm: Algorithm = "auto", timeout: float | None = None) -> list[Any]:
        """See :meth:`Group.allreduce_many`; blocks until every array is reduced.

        Raises:
            What :meth:`Group.allreduce_many` raises.
        """
        return self._wait(self.submit_allreduce_many(
            tensors, op, priorities=priorities, bucket_bytes=bucket_bytes,
            algorithm=algorithm, timeout=timeout))

    def submit_broadcast(self, x: Any, root: int | None = None, *, src: int | None = None,
                         algorithm: Algorithm = "auto",
                         timeout: float | None = None) -> concurrent.futures.Future[Any]:
        """Start :meth:`Group.broadcast` (``src=`` is torch's name for ``root``)."""
        source = _root(root, src, ("root", "src"))
        return self.submit(lambda g: g.broadcast(x, source, algorithm=algorithm,
                                                 timeout=timeout))

    def broadcast(self, x: Any, root: int | None = None, *, src: int | None = None,
                  algorithm: Algorithm = "auto", timeout: float | None = None) -> Any:
        """See :meth:`Group.broadcast`; ``src=`` is torch's name for ``root`` (default 0).

        Raises:
            InvalidArgument: ``root`` and ``src`` disagree; what
                :meth:`Group.broadcast` raises.
        """
        return self._wait(self.submit_broadcast(x, root, src=src, algorithm=algorithm,
                                                timeout=timeout))

    def reduce(self, x: Any, root: int | None = None, op: ReduceOp | str = ReduceOp.SUM, *,
               dst: int | None = None, algorithm: Algorithm = "auto",
               timeout: float | None = None) -> Any:
        """See :meth:`Group.reduce`; ``dst=`` is torch's name for ``root``.

        Raises:
            InvalidArgument: ``root`` and ``dst`` disagree; what
                :meth:`Group.reduce` raises.
        """
        target = _root(root, dst, ("root", "dst"))
        return self._wait(self.submit(lambda g: g.reduce(x, target, op, algorithm=algorithm,
                                                         timeout=timeout)))

    def allgather(self, x: Any, *, out: Any = None, algorithm: Algorithm = "auto",
                  timeout: float | None = None) -> Any:
        """See :meth:`Group.allgather`: every rank's ``x``, stacked.

        Raises:
            What :meth:`Group.allgather` raises.
        """
        return self._wait(self.submit(lambda g: g.allgather(x, out=out, algorithm=algorithm,
                                                            timeout=timeout)))

    def all_gather(self, tensor_list: list[Any], tensor: Any, *,
                   timeout: float | None = None) -> list[Any]:
        """torch's spelling: ``tensor_list[i]`` gets rank ``i``'s ``tensor``.

        The ranks' arrays are gathered into one stacked array and copied into
        the list's arrays (which need not be adjacent in memory). Returns
        ``tensor_list``.

        Raises:
            InvalidArgument: the list does not hold ``world_size`` arrays of
                ``tensor``'s shape; what :meth:`Group.allgather` raises.
        """
        _check_list(tensor_list, tensor, self.world_size, "tensor_list")
        stacked = self.allgather(tensor, timeout=timeout)
        for i, part in enumerate(tensor_list):
            _copy(part, stacked[i])
        return tensor_list

    def gather(self, x: Any, gather_list: list[Any] | None = None, root: int | None = None,
               *, dst: int | None = None, out: Any = None,
               timeout: float | None = None) -> Any:
        """Every rank's ``x`` on the root (``dst=`` in torch's spelling).

        With ``gather_list`` (torch's spelling; given on the root only) the
        root's list is filled and returned; otherwise the root gets the
        stacked array of :meth:`Group.gather`. Other ranks get ``None``.

        Raises:
            InvalidArgument: ``root`` and ``dst`` disagree, or a list on the
                root that does not hold ``world_size`` arrays like ``x``.
        """
        target = _root(root, dst, ("root", "dst"))
        if gather_list is not None and self.rank == target:
            _check_list(gather_list, x, self.world_size, "gather_list")
        stacked = self._wait(self.submit(lambda g: g.gather(x, target, out=out,
                                                            timeout=timeout)))
        if gather_list is None or stacked is None:
            return stacked
        for i, part in enumerate(gather_list):
            _copy(part, stacked[i])
        return gather_list

    def scatter(self, out: Any, parts: Any = None, root: int | None = None, *,
                src: int | None = None, timeout: float | None = None) -> Any:
        """See :meth:`Group.scatter`; ``src=`` is torch's name for ``root``.

        ``parts`` may be a list of ``world_size`` arrays (torch's
        ``scatter_list``) or one stacked array.

        Raises:
            InvalidArgument: ``root`` and ``src`` disagree; what
                :meth:`Group.scatter` raises.
        """
        source = _root(root, src, ("root", "src"))
        if isinstance(parts, list | tuple):
            parts = _stack(parts, out)
        return self._wait(self.submit(lambda g: g.scatter(out, parts, source, timeout=timeout)))

    def reduce_scatter(self, x: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                       algorithm: Algorithm = "auto", timeout: float | None = None) -> Any:
        """See :meth:`Group.reduce_scatter`.

        Raises:
            What :meth:`Group.reduce_scatter` raises.
        """
        return self._wait(self.submit(lambda g: g.reduce_scatter(x, op, algorithm=algorithm,
                                                                 timeout=timeout)))

    def alltoall(self, x: Any, *, out: Any = None, timeout: float | None = None) -> Any:
        """See :meth:`Group.alltoall`.

        Raises:
            What :meth:`Group.alltoall` raises.
        """
        return self._wait(self.submit(lambda g: g.alltoall(x, out=out, timeout=timeout)))

    def barrier(self, *, timeout: float | None = None) -> None:
        """See :meth:`Group.barrier`.

        Raises:
            What :meth:`Group.barrier` raises.
        """
        self._wait(self.submit(lambda g: g.barrier(timeout=timeout)))

    def send(self, x: Any, dst: int, *, tag: int = 0, timeout: float | None = None) -> None:
        """See :meth:`Group.send`.

        Raises:
            What :meth:`Group.send` raises.
        """
        self._wait(self.submit(lambda g: g.send(x, dst, tag=tag, timeout=timeout)))

    def recv(self, out: Any, src: int, *, tag: int = 0, timeout: float | None = None) -> Any:
        """See :meth:`Group.recv`.

        Raises:
            What :meth:`Group.recv` raises.
        """
        return self._wait(self.submit(lambda g: g.recv(out, src, tag=tag, timeout=timeout)))

    def metrics(self) -> dict[str, dict[str, Any]]:
        """See :meth:`Group.metrics`."""
        async def snapshot(g: Group) -> dict[str, dict[str, Any]]:
            return g.metrics()

        return self._wait(self.submit(snapshot))

    # -- closing ----------------------------------------------------------------------

    def close(self) -> None:
        """Leave the group (see :meth:`Group.close`) and stop the background thread."""
        self._background.close(self.group.close())

    def __enter__(self) -> SyncGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<SyncGroup {self.group.id} rank {self.rank} of {self.world_size}>"


def _check_list(parts: Sequence[Any], like: Any, n: int, name: str) -> None:
    if not isinstance(parts, list) or len(parts) != n:
        raise InvalidArgument(f"{name} must be a list of {n} arrays (one per rank)")
    for part in parts:
        if tuple(part.shape) != tuple(like.shape) or part.dtype != like.dtype:
            raise InvalidArgument(f"every array of {name} must be {like.dtype} of shape "
                                  f"{tuple(like.shape)}, got {part.dtype} {tuple(part.shape)}")


def _copy(dst: Any, src: Any) -> None:
    """``dst[...] = src`` for NumPy arrays and torch tensors alike."""
    if hasattr(dst, "copy_"):
        dst.copy_(src)
    else:
        dst[...] = src


def _stack(parts: Sequence[Any], like: Any) -> Any:
    """A list of arrays (torch's ``scatter_list``) as one stacked array of ``like``'s kind."""
    if hasattr(like, "copy_"):
        import torch

        return torch.stack(list(parts))
    import numpy as np

    return np.stack(parts)
