"""Stub of the compiled ``_encoder`` module (see _encoder.pyx)."""

from typing import Any, Final

from ._limits import Limits
from ._registry import TypeRegistry

DEFAULT_INLINE_THRESHOLD: Final[int]

class Encoder:
    def __init__(
        self,
        *,
        registry: TypeRegistry | None = None,
        inline_threshold: int = ...,
        limits: Limits | None = None,
    ) -> None: ...
    @property
    def inline_threshold(self) -> int: ...
    @property
    def limits(self) -> Limits: ...
    def encode(self, obj: Any) -> tuple[bytes, list[Any]]: ...
    def encode_nested(self, obj: list[Any]) -> tuple[bytes, list[Any]]: ...
    def encode_frames(self, obj: Any) -> list[Any]: ...
    def encode_arguments(self, args: tuple[Any, ...], kwargs: dict[Any, Any]) -> list[Any]: ...
