"""Stub of the compiled ``_driver_core`` module (see _driver_core.pyx)."""

import asyncio
from collections.abc import Callable
from typing import Any

from ..errors import TensorwireError, Unavailable
from ..transports import Connection
from ..transports._receiver import MessageReceiver
from ._flush_gate import FlushGate
from .protocol import Message

BATCH: int

def frames_nbytes(frames: list[Any]) -> int: ...
def unavailable(error: BaseException) -> Unavailable: ...
def fail_waiter(waiting: asyncio.Future[None] | None, error: BaseException) -> None: ...

class MessageHandler:
    def __call__(self, message: Message, nbytes: int) -> None: ...

class DriverCore(MessageReceiver):
    conn: Connection
    loop: asyncio.AbstractEventLoop
    error: TensorwireError | None
    reading_paused: bool
    _last_seen: float
    _on_message: Callable[[Message, int], None]
    _outbox: list[list[Any]]
    _flushed: asyncio.Future[None] | None
    _writing: asyncio.Future[None] | None
    _writing_flushed: asyncio.Future[None] | None
    _turn: asyncio.Handle | None
    _turn_posts: int
    _eager: bool
    flush_gate: FlushGate
    _stamp_messages: bool
    _unsent: int
    _outbox_bytes: int
    _high_water: int
    _low_water: int
    _drained: asyncio.Future[None] | None
    def __init__(self, conn: Connection, on_message: Callable[[Message, int], None], *,
                 max_unsent: int) -> None: ...
    @property
    def closed(self) -> bool: ...
    def post(self, message: Message) -> int: ...
    def post_frames(self, frames: list[Any]) -> int: ...
    def _sent(self, nbytes: int) -> None: ...
    def _end_turn(self) -> None: ...
    def _flush(self) -> None: ...
    def _written(self, nbytes: int, writing: asyncio.Future[None]) -> None: ...
    def _deliver(self, frames: list[Any]) -> None: ...
    def close_with(self, error: TensorwireError) -> None: ...
