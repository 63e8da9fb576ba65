"""Stub of the compiled ``_wire`` module (see _wire.pyx)."""

from collections.abc import Sequence
from typing import Any, ClassVar

from ._kinds import Kind
from .protocol import Message

class ValueMessage(Message):
    value: list[Any]
    def __init__(self, call_id: int, value: list[Any]) -> None: ...
    @property
    def payload(self) -> list[Any]: ...

class Request(ValueMessage):
    method: str
    timeout: float | None
    stream_arg: int
    kind: ClassVar[Kind]
    fields: ClassVar[tuple[str, ...]]
    def __init__(self, call_id: int, method: str, timeout: float | None, stream_arg: int,
                 value: list[Any]) -> None: ...

class Response(ValueMessage):
    kind: ClassVar[Kind]

class Item(ValueMessage):
    kind: ClassVar[Kind]

REQUEST: int
RESPONSE: int
ITEM: int
SLICE_MAX: int
MAX_TIMEOUT: float

def parse_binary(frames: Sequence[Any]) -> Request | Response | Item | None: ...
def encode_request(call_id: int, method: str, timeout: float | None, stream_arg: int,
                   value: list[Any]) -> list[Any]: ...
def encode_reply(kind: int, call_id: int, value: list[Any]) -> list[Any]: ...
def encode_response(call_id: int, value: list[Any]) -> list[Any]: ...
