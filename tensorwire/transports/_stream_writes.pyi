from collections.abc import Sequence
from typing import Any

__all__ = ("IOV_MAX", "JOIN_MAX", "outgoing", "outgoing_many", "write_some")

IOV_MAX: int
JOIN_MAX: int

def outgoing(frames: Sequence[Any], owner: Any = None) -> list[Any]: ...
def outgoing_many(messages: Sequence[Sequence[Any]], owner: Any) -> tuple[list[Any], int]: ...
def write_some(fd: int, buffers: list[Any]) -> int: ...
