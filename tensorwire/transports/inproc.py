"""inproc://name — connections inside one process and event loop.

For tests and co-located services. Frames pass by reference: the receiver
gets the very objects the sender passed (as flat byte views), so a sender
that mutates a buffer after ``send`` returns changes what the receiver sees,
and a read-only frame (``bytes``) arrives read-only. A ``recv`` given an
allocator copies each frame into the memory it hands out, once, so code that
receives into its own arrays works the same as over tcp:// or ucx://.

Names are scoped to the running event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ConfigError, ConnectionClosedError, LimitExceededError, TransportError
from ._base import Connection, ConnectionHandler, Listener, serve_connection
from ._frames import Allocator, FrameInfo, device_nbytes, host_view, is_device_frame, writable_view
from ._limit_checks import check_limits, refused_head
from ._registry import Backend
from .config import TransportConfig

__all__ = ("InprocBackend", "InprocConnection", "InprocListener", "backend")

class _Inbox:
    """A bounded queue of messages that can be shut, waking everyone."""

    def __init__(self, maxsize: int) -> None:
        self._maxsize = maxsize
        self._items: deque[list[Any]] = deque()
        self._getters: deque[asyncio.Future[None]] = deque()
        self._putters: deque[asyncio.Future[None]] = deque()
        self.error: ConnectionClosedError | None = None

    async def put(self, message: list[Any]) -> None:
        while len(self._items) >= self._maxsize and self.error is None:
            await self._wait(self._putters)
        if self.error is not None:
            raise self.error
        self._items.append(message)
        _wake(self._getters)

    async def get(self) -> list[Any]:
        while not self._items:
            if self.error is not None:
                raise self.error
            await self._wait(self._getters)
        _wake(self._putters)
        return self._items.popleft()

    def shut(self, error: ConnectionClosedError, *, discard: bool) -> None:
        """Refuse new messages; ``discard`` drops the ones not yet received."""
        if self.error is None:
            self.error = error
        if discard:
            self._items.clear()
        for waiters in (self._getters, self._putters):
            while waiters:
                _wake(waiters)

    @staticmethod
    async def _wait(waiters: deque[asyncio.Future[None]]) -> None:
        waiter = asyncio.get_running_loop().create_future()
        waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                _wake(waiters)  # pass on the wake-up this waiter can no longer use
            raise
        finally:
            # A woken waiter was popped already; remove() of a missing item
            # formats its repr into the ValueError, which costs more than
            # the rest of a call here.
            if not waiter.done() or waiter.cancelled():
                with contextlib.suppress(ValueError):
                    waiters.remove(waiter)


def _wake(waiters: deque[asyncio.Future[None]]) -> None:
    while waiters:
        waiter = waiters.popleft()
        if not waiter.done():
            waiter.set_result(None)
            return


class InprocConnection(Connection):
    """One end of an in-process connection."""

    scheme = "inproc"

    def __init__(
        self, local: str, peer: str, config: TransportConfig, allocator: Allocator | None
    ) -> None:
        self._local = local
        self._peer_name = peer
        self._config = config
        self._allocator = allocator
        self._on_refused: Callable[[LimitExceededError], None] | None = None
        self._inbox = _Inbox(config.inproc_queue)
        self._peer: InprocConnection | None = None
        self._closed = False

    @property
    def local_address(self) -> str:
        return self._local

    @property
    def peer_address(self) -> str:
        return self._peer_name

    @property
    def closed(self) -> bool:
        return self._closed

    async def send(self, frames: Sequence[Any]) -> None:
        peer = self._peer
        if self._closed or peer is None:
            raise self._inbox.error or ConnectionClosedError(f"{self._local} is closed")
        message = [f if is_device_frame(f) else host_view(f) for f in frames]
        await peer._inbox.put(message)
        self.messages_sent += 1
        self.bytes_sent += sum(device_nbytes(f) if is_device_frame(f) else f.nbytes
                               for f in message)

    def refuse_oversized(self, on_refused: Callable[[LimitExceededError], None]) -> bool:
        self._on_refused = on_refused
        return True

    async def recv(self, *, allocator: Allocator | None = None) -> list[Any]:
        while True:
            message = await self._inbox.get()
            sizes = [device_nbytes(f) if is_device_frame(f) else f.nbytes for f in message]
            self.messages_received += 1
            self.bytes_received += sum(sizes)
            try:
                check_limits(sizes, self._config.limits)
            except LimitExceededError as exc:
                on_refused = self._on_refused
                if on_refused is None or len(sizes) > self._config.limits.max_frames:
                    self.abort()
                    raise
                if (refused_head(sizes, self._config.limits) is not None
                        and not is_device_frame(message[0])):
                    exc.head = bytes(message[0])
                on_refused(exc)
                continue
            break
        allocator = allocator or self._allocator
        if allocator is None:
            return message
        return [_copy_into(allocator, index, frame) for index, frame in enumerate(message)]

    async def close(self) -> None:
        self.abort()

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._inbox.shut(ConnectionClosedError(f"{self._local} was closed"), discard=True)
        peer, self._peer = self._peer, None
        if peer is not None:
            # What we sent before closing stays readable by the peer, as on
            # a stream transport after a polite close.
            peer._closed = True
            peer._peer = None
            peer._inbox.shut(
                ConnectionClosedError(f"connection closed by the peer {self._local}"),
                discard=False,
            )


def _copy_into(allocator: Allocator, index: int, frame: Any) -> Any:
    if is_device_frame(frame):
        import cupy

        info = FrameInfo(index, device_nbytes(frame), "cuda")
        buffer = allocator(info)
        cupy.asarray(buffer).reshape(-1).view(cupy.uint8)[:] = (
            cupy.asarray(frame).reshape(-1).view(cupy.uint8)
        )
        return buffer
    info = FrameInfo(index, frame.nbytes)
    buffer = allocator(info)
    writable_view(buffer, info)[:] = frame
    return buffer


class InprocListener(Listener):
    """Accepts inproc:// connections by name."""

    def __init__(
        self,
        name: str,
        on_connection: ConnectionHandler,
        config: TransportConfig,
        allocator: Allocator | None,
        registry: dict[str, InprocListener],
    ) -> None:
        self._name = name
        self._on_connection = on_connection
        self._config = config
        self._allocator = allocator
        self._registry = registry
        self._tasks: set[asyncio.Task[None]] = set()
        self._conns: set[InprocConnection] = set()
        self._counter = itertools.count(1)
        self._open = True

    @property
    def address(self) -> str:
        return f"inproc://{self._name}"

    def _accept(self, client_config: TransportConfig, allocator: Allocator | None) -> Connection:
        if not self._open:
            raise ConnectionClosedError(f"{self.address} is closed")
        client_name = f"inproc://{self._name}#{next(self._counter)}"
        client = InprocConnection(client_name, self.address, client_config, allocator)
        server = InprocConnection(self.address, client_name, self._config, self._allocator)
        client._peer, server._peer = server, client
        self._conns.add(server)
        task = asyncio.get_running_loop().create_task(self._serve(server))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return client

    async def _serve(self, conn: InprocConnection) -> None:
        try:
            await serve_connection(self._on_connection, conn)
        finally:
            self._conns.discard(conn)

    async def close(self) -> None:
        if not self._open:
            return
        self._open = False
        if self._registry.get(self._name) is self:
            del self._registry[self._name]
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for conn in list(self._conns):
            conn.abort()
        await asyncio.gather(*tasks, return_exceptions=True)


class InprocBackend(Backend):
    """The inproc:// transport; one name space per event loop."""

    def __init__(self) -> None:
        self._names: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, dict[str, InprocListener]
        ] = weakref.WeakKeyDictionary()
        self._anonymous = itertools.count(1)

    def _registry(self) -> dict[str, InprocListener]:
        return self._names.setdefault(asyncio.get_running_loop(), {})

    async def connect(
        self, address: str, config: TransportConfig, allocator: Allocator | None
    ) -> Connection:
        listener = self._registry().get(address)
        if listener is None:
            raise TransportError(f"nothing listens on inproc://{address}")
        return listener._accept(config, allocator)

    async def listen(
        self,
        address: str,
        on_connection: ConnectionHandler,
        config: TransportConfig,
        allocator: Allocator | None,
    ) -> Listener:
        if not address or address.endswith("*"):
            address = f"{address.rstrip('*') or 'anon'}-{next(self._anonymous)}"
        if "/" in address or "#" in address:
            raise ConfigError(f"inproc names may not contain '/' or '#': {address!r}")
        registry = self._registry()
        if address in registry:
            raise TransportError(f"inproc://{address} is already in use")
        listener = InprocListener(address, on_connection, config, allocator, registry)
        registry[address] = listener
        return listener


backend = InprocBackend()
