"""A blocking parameter-server client for plain training loops.

Runs a :class:`PSClient` on an event loop in a background thread, like
:class:`tensorwire.rpc.SyncClient`. The blocking methods wait; the
``submit_*`` methods return ``concurrent.futures.Future`` objects so
communication overlaps computation::

    with ps.SyncClient(addresses, worker=rank, num_workers=n,
                       optimizer=ps.SGD(lr=0.1)) as client:
        params = client.init(initial)
        for batch in data:
            params = client.push_pull(grads(params, batch))
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from .._background import BackgroundLoop, HasBackgroundLoop
from ._compress import CompressionSpec
from ._consistency import Mode
from ._optim import Optimizer
from ._step import Step
from .client import PSClient, connect
from .config import PSConfig

__all__ = ("SyncClient", "SyncStep")

T = TypeVar("T")
Array = np.ndarray[Any, Any]


class SyncClient:
    """Blocking parameter-server calls from any thread; one background loop thread.

    Takes the arguments of :func:`tensorwire.ps.connect` and connects at once.
    Calls run in the order they are made (each takes its clock then).

    ``loop_of``: run on that blocking facade's background loop thread (a
    :class:`tensorwire.collective.SyncGroup`, another client) instead of a
    thread of its own. ucx:// needs it when a process uses ucx:// for both:
    UCX runs one worker per process, driven by one event loop. The thread
    stops when the last facade on it closed.

    Raises:
        ConfigError, Unavailable: as :func:`tensorwire.ps.connect`.
        FailedPrecondition: ``loop_of`` is closed.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        worker: int,
        num_workers: int,
        optimizer: Optimizer,
        consistency: Mode = "sync",
        staleness: int = 0,
        compression: CompressionSpec = None,
        config: PSConfig | None = None,
        loop_of: HasBackgroundLoop | None = None,
    ) -> None:
        self._background = BackgroundLoop(
            f"tensorwire-ps worker {worker}",
            beside=None if loop_of is None else loop_of.background)
        self._run = self._background.run
        self._wait = self._background.wait
        try:
            self._client: PSClient = self._run(connect(
                addresses, worker=worker, num_workers=num_workers, optimizer=optimizer,
                consistency=consistency, staleness=staleness, compression=compression,
                config=config,
            )).result()
        except BaseException:
            self._background.close()
            raise

    @property
    def client(self) -> PSClient:
        """The async client underneath (use it only on its own loop)."""
        return self._client

    @property
    def background(self) -> BackgroundLoop:
        """The background loop this client runs on (for another facade's ``loop_of=``)."""
        return self._background

    @property
    def imbalance(self) -> float:
        """See :attr:`PSClient.imbalance`."""
        return self._client.imbalance

    def _start(self, make: Callable[[], Awaitable[T]]) -> concurrent.futures.Future[T]:
        async def run() -> T:
            return await make()

        return self._run(run())

    def init(self, params: Mapping[str, Array]) -> dict[str, Array]:
        """See :meth:`PSClient.init`."""
        return self._wait(self._start(lambda: self._client.init(params)))

    def submit_push(self, grads: Mapping[str, Array]) -> concurrent.futures.Future[None]:
        """Start :meth:`PSClient.push`; the future finishes when the shards took it."""
        return self._start(lambda: self._client.push(grads))

    def submit_pull(self) -> concurrent.futures.Future[dict[str, Array]]:
        """Start :meth:`PSClient.pull`."""
        return self._start(self._client.pull)

    def submit_push_pull(
        self, grads: Mapping[str, Array]
    ) -> concurrent.futures.Future[dict[str, Array]]:
        """Start :meth:`PSClient.push_pull`."""
        return self._start(lambda: self._client.push_pull(grads))

    def push(self, grads: Mapping[str, Array]) -> None:
        """See :meth:`PSClient.push`; blocks until the shards took the gradients."""
        self._wait(self.submit_push(grads))

    def pull(self) -> dict[str, Array]:
        """See :meth:`PSClient.pull`."""
        return self._wait(self.submit_pull())

    def push_pull(self, grads: Mapping[str, Array]) -> dict[str, Array]:
        """See :meth:`PSClient.push_pull`."""
        return self._wait(self.submit_push_pull(grads))

    def begin_step(self) -> SyncStep:
        """See :meth:`PSClient.begin_step`: a step pushed in parts.

        Raises:
            What :meth:`PSClient.begin_step` raises.
        """
        async def begin() -> Step:
            return self._client.begin_step()

        return SyncStep(self, self._wait(self._run(begin())))

    def checkpoint(self) -> list[str]:
        """See :meth:`PSClient.checkpoint`."""
        return self._wait(self._start(self._client.checkpoint))

    def status(self) -> list[dict[str, Any]]:
        """See :meth:`PSClient.status`."""
        return self._wait(self._start(self._client.status))

    def reshard(self, addresses: Sequence[str]) -> dict[str, Any]:
        """See :meth:`PSClient.reshard`: call between steps."""
        return self._wait(self._start(lambda: self._client.reshard(addresses)))

    def rebalance(self, *, threshold: float | None = None) -> dict[str, Any]:
        """See :meth:`PSClient.rebalance`: call between steps."""
        return self._wait(self._start(lambda: self._client.rebalance(threshold=threshold)))

    def close(self) -> None:
        """Close the shard connections, let calls submitted before it end (they fail
        with ``Unavailable``), and stop the background thread."""
        self._background.close(self._client.close())

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class SyncStep:
    """A :class:`~tensorwire.ps.Step` of a :class:`SyncClient`:
    ``submit_*`` return at once with a future, the others block.

    A part's checks run on the client's loop, so a misuse (a tensor pushed
    twice in the step) fails its future, or the blocking call.

    Attributes:
        step: the async step underneath (use it only on the client's loop).
        clock: the step's clock.
    """

    def __init__(self, client: SyncClient, step: Step) -> None:
        self._client = client
        self.step = step
        self.clock = step.clock

    def submit_push(self, grads: Mapping[str, Array]) -> concurrent.futures.Future[None]:
        """Start :meth:`Step.push <tensorwire.ps.Step.push>`."""
        return self._client._start(lambda: self.step.push(grads))

    def submit_push_pull(
        self, grads: Mapping[str, Array]
    ) -> concurrent.futures.Future[dict[str, Array]]:
        """Start :meth:`Step.push_pull <tensorwire.ps.Step.push_pull>`."""
        return self._client._start(lambda: self.step.push_pull(grads))

    def push(self, grads: Mapping[str, Array]) -> None:
        """Push a part; blocks until the shards took it.

        Raises:
            What :meth:`Step.push <tensorwire.ps.Step.push>` raises.
        """
        self._client._wait(self.submit_push(grads))

    def push_pull(self, grads: Mapping[str, Array]) -> dict[str, Array]:
        """Push a part and read its tensors back; blocks.

        Raises:
            What :meth:`Step.push_pull <tensorwire.ps.Step.push_pull>` raises.
        """
        return self._client._wait(self.submit_push_pull(grads))
