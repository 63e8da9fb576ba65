"""Stub of the compiled ``_decoder`` module (see _decoder.pyx)."""

from collections.abc import Sequence
from typing import Any

from ._limits import Limits
from ._registry import TypeRegistry

class Decoder:
    def __init__(
        self, *, registry: TypeRegistry | None = None, limits: Limits | None = None
    ) -> None: ...
    @property
    def limits(self) -> Limits: ...
    def decode(self, header: Any, buffers: Sequence[Any] = ()) -> Any: ...
    def decode_frames(self, frames: list[Any]) -> Any: ...
