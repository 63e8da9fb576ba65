"""Handing received messages to their consumer: the queue of ``recv()``
calls and messages (``RecvQueue``), a consumer's callbacks
(``call_consumer``), and the fairness budget of one read."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from ..errors import TransportError
from ._frames import Allocator

__all__ = ("READ_BUDGET_BYTES", "READ_BUDGET_MESSAGES", "RecvQueue", "call_consumer",
           "consumer_failed")

logger = logging.getLogger(__name__)

#: Fairness: one read callback of a connection hands out at most this many
#: messages (the consumer's work on them, such as RPC handlers run inline,
#: happens inside the callback) and reads at most about this many bytes,
#: then gives the event loop back; the rest follows on a later turn. A peer
#: that pipelines at full speed otherwise keeps the loop from every other
#: connection, timer and accept (issue 21).
READ_BUDGET_MESSAGES = 64
READ_BUDGET_BYTES = 1 << 20


def call_consumer(callback: Callable[[Any], None], arg: Any, what: str,
                  peer: str) -> TransportError | None:
    """Call a consumer's ``callback`` (a message receiver, a refusal
    handler) with ``arg``. What it raises is logged and returned as the
    error that ends the connection (``what`` names the callback)."""
    try:
        callback(arg)
    except Exception as exc:
        return consumer_failed(exc, what, peer)
    return None


def consumer_failed(exc: Exception, what: str, peer: str) -> TransportError:
    """Log what a consumer's callback raised; the error that ends the
    connection (see ``call_consumer``, for callers that inline its call)."""
    logger.exception("%s of %s failed", what, peer, exc_info=exc)
    error = TransportError(f"{what} failed: {exc!r}")
    error.__cause__ = exc
    return error


class RecvQueue:
    """The messages a connection received and the ``recv()`` calls waiting.

    A transport allocates the next message with the first waiter's allocator
    (``bind`` that waiter), so the message goes to that waiter; one whose
    waiter gave up, or that needed no allocation, goes to the next waiter or
    waits in ``ready``.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.waiters: deque[tuple[asyncio.Future[list[Any]], Allocator | None]] = deque()
        self.ready: deque[list[Any]] = deque()
        self._bound: asyncio.Future[list[Any]] | None = None

    async def wait(self, allocator: Allocator | None, kick: Callable[[], None]) -> list[Any]:
        """Wait for the next message; ``kick`` tells the transport someone waits."""
        waiter: asyncio.Future[list[Any]] = self._loop.create_future()
        entry = (waiter, allocator)
        self.waiters.append(entry)
        kick()
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                # The message was ours already when the cancel landed: keep it
                # for the next recv() instead of dropping it.
                self.ready.appendleft(waiter.result())
            raise
        finally:
            if not waiter.done() or waiter.cancelled():
                with contextlib.suppress(ValueError):
                    self.waiters.remove(entry)

    def bind(self, waiter: asyncio.Future[list[Any]]) -> None:
        """The message now being received was allocated for ``waiter``."""
        self._bound = waiter

    def deliver(self, message: list[Any]) -> None:
        bound, self._bound = self._bound, None
        if bound is not None and not bound.done():
            for entry in self.waiters:
                if entry[0] is bound:
                    self.waiters.remove(entry)
                    break
            bound.set_result(message)
            return
        while self.waiters:
            waiter, _ = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(message)
                return
        self.ready.append(message)

    def fail(self, error: BaseException) -> None:
        """Fail every waiting ``recv()`` with ``error``."""
        bound, self._bound = self._bound, None
        while self.waiters:
            waiter, _ = self.waiters.popleft()
            if not waiter.done():
                waiter.set_exception(error)
        if bound is not None and not bound.done():
            bound.set_exception(error)
