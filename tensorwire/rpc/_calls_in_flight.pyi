"""Stub of the compiled ``_calls_in_flight`` module (see _calls_in_flight.pyx)."""

import asyncio
from collections.abc import Callable
from typing import Any

from .._counters import MethodMetrics
from ..serde import Encoder
from ._call_table import CallTable
from ._calls import CallState
from ._driver_core import DriverCore, MessageHandler
from .protocol import Message

LONGEST: float

class DeadlineQueue:
    size: int
    last: float
    def __len__(self) -> int: ...

class UnaryCall(CallState):
    future: asyncio.Future[None]
    call_id: int
    probing: bool
    answer: Message | None
    answer_bytes: int

class CallsInFlight(MessageHandler):
    pending: CallTable[Any]
    deadlines: list[tuple[float, int]]
    in_order: DeadlineQueue
    def __init__(self, loop: asyncio.AbstractEventLoop,
                 on_other: Callable[[Message, int], None],
                 encoder: Encoder | None = None) -> None: ...
    def add(self, waiter: Any, expires: float) -> int: ...
    def probes(self, method: str) -> bool: ...
    async def call_streaming(self, driver: DriverCore, method: str, deadline: float,
                             stream_arg: int, args: tuple[Any, ...], kwargs: dict[str, Any],
                             metrics: MethodMetrics, grace: float, waiter: Any,
                             on_sent: Callable[[int], asyncio.Task[None]],
                             ) -> tuple[Message, int]: ...
    def fail(self, call_id: int, error: BaseException) -> bool: ...
    def fail_all(self, error: BaseException) -> None: ...
    def _expire_due(self) -> None: ...

async def until_drained(driver: Any, deadline: float, method: str) -> None: ...
