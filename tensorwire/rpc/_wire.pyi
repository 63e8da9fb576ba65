"""Stub of the compiled ``_wire`` module (see _wire.pyx)."""

from collections.abc import Sequence
from typing import Any

from .protocol import Item, Request, Response

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
