"""Services the RPC tests call (importable by child processes too)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from tensorwire import rpc
from tensorwire.errors import DeadlineExceeded, NotFound


class Store(rpc.Service):
    """A key-value store of tensors."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self.events: dict[str, asyncio.Event] = {}
        self.cancelled: list[str] = []
        self.calls = 0
        self.produced = 0

    @rpc.method
    async def put(self, key: str, value: Any) -> None:
        """Store ``value`` under ``key``."""
        self.calls += 1
        self.data[key] = value

    @rpc.method(idempotent=True)
    async def get(self, key: str) -> Any:
        """The value under ``key``."""
        self.calls += 1
        if key not in self.data:
            raise NotFound(f"no key {key!r}")
        return self.data[key]

    @rpc.method
    async def echo(self, value: Any) -> Any:
        return value

    @rpc.method
    async def inspect(self, value: np.ndarray[Any, Any]) -> dict[str, Any]:
        """How the argument arrived: does it own its memory, what is its root buffer."""
        root = value
        while isinstance(getattr(root, "base", None), np.ndarray):
            root = root.base
        return {
            "owndata": bool(value.flags.owndata),
            "writeable": bool(value.flags.writeable),
            "root_nbytes": int(root.nbytes),
            "root_dtype": str(root.dtype),
            "address": int(value.ctypes.data),
        }

    @rpc.method
    async def expire(self, text: str) -> None:
        """A handler's own deadline error, with its own message."""
        raise DeadlineExceeded(text)

    @rpc.method
    async def boom(self, key: str) -> None:
        return {}[key]  # type: ignore[no-any-return]

    @rpc.method
    async def sleep(self, seconds: float, tag: str = "") -> str:
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.cancelled.append(tag)
            raise
        return tag

    @rpc.method(idempotent=True)
    async def slow_idempotent(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "done"

    @rpc.method
    async def slow(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "done"

    @rpc.method
    async def count(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            self.produced = i + 1
            yield i

    @rpc.method
    async def total(self, values: AsyncIterator[Any], delay: float = 0.0) -> float:
        result = 0.0
        async for value in values:
            result += float(np.sum(value))
            if delay:
                await asyncio.sleep(delay)
        return result

    @rpc.method
    async def scale(self, factor: float, values: AsyncIterator[np.ndarray[Any, Any]]
                    ) -> AsyncIterator[np.ndarray[Any, Any]]:
        async for value in values:
            yield value * factor


async def serve(url: str, ready: Any = None) -> None:
    server = rpc.Server([Store()])
    (address,) = await server.start(url)
    if ready is not None:
        ready(address)
    await server.serve_forever()
