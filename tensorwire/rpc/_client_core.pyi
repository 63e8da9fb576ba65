"""Stub of the compiled ``_client_core`` module (see _client_core.pyx)."""

import asyncio
from collections.abc import AsyncIterable
from typing import Any

from .. import serde
from .._counters import MethodMetrics, Metrics
from ..errors import RemoteError, TensorwireError
from . import protocol
from ._calls_in_flight import CallsInFlight
from ._connection_driver import ConnectionDriver
from ._slots import Slots
from .config import ClientConfig

def sendable(timeout: float) -> float: ...
def split_stream(
    args: tuple[Any, ...],
) -> tuple[tuple[Any, ...], AsyncIterable[Any] | None, int]: ...
def remote_error(message: protocol.Error) -> RemoteError: ...
def unexpected_answer(message: protocol.Message, method: str) -> Exception: ...

class SessionCore:
    loop: asyncio.AbstractEventLoop
    driver: ConnectionDriver | None
    slots: Slots
    calls: CallsInFlight
    error: TensorwireError | None
    @property
    def alive(self) -> bool: ...
    def take_slot(self) -> bool: ...

class ClientCore:
    config: ClientConfig
    _session: Any
    _encoder: serde.Encoder
    _decoder: serde.Decoder
    _metrics: Metrics
    async def _call(self, method: str, timeout: float | None, idempotent: bool, /,
                    *args: Any, **kwargs: Any) -> Any: ...
    def _deadline(self, timeout: float | None) -> float: ...
    def _encode(self, value: Any) -> list[Any]: ...
    def _result(self, message: protocol.Message, nbytes: int, metrics: MethodMetrics,
                method: str) -> Any: ...
