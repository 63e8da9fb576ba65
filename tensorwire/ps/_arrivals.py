"""The tensors of one pull or push_pull, each handed out as soon as it arrived."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Generator, Sequence
from typing import Any

import numpy as np

__all__ = ("Arrivals",)

Array = np.ndarray[Any, Any]


class Arrivals:
    """The tensors of one pull or push_pull, each as soon as all its chunks
    are back: ``await arrivals[name]`` for one, ``async for name, value in
    arrivals`` in arrival order, ``await arrivals`` for the whole dict. The
    next forward pass can start on the first layers while the rest arrive.
    """

    def __init__(self, names: Sequence[str]) -> None:
        loop = asyncio.get_running_loop()
        self._futures: dict[str, asyncio.Future[Array]] = {
            name: loop.create_future() for name in names}
        for future in self._futures.values():
            # An error reaches every tensor; no "never retrieved" noise.
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._arrived: asyncio.Queue[str] = asyncio.Queue()
        self.task: asyncio.Task[dict[str, Array]] | None = None

    def _deliver(self, name: str, value: Array) -> None:
        self._futures[name].set_result(value)
        self._arrived.put_nowait(name)

    def _fail(self, error: BaseException) -> None:
        for future in self._futures.values():
            if not future.done():
                future.set_exception(error)
        self._arrived.put_nowait("")

    def __getitem__(self, name: str) -> asyncio.Future[Array]:
        return self._futures[name]

    def __aiter__(self) -> AsyncIterator[tuple[str, Array]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[str, Array]]:
        for _ in range(len(self._futures)):
            name = await self._arrived.get()
            if not name:
                assert self.task is not None
                await self.task  # raises the error
            yield name, self._futures[name].result()

    def __await__(self) -> Generator[Any, None, dict[str, Array]]:
        assert self.task is not None
        return self.task.__await__()
