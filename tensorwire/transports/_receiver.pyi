"""Stub of the compiled ``_receiver`` module (see _receiver.pyx)."""

from typing import Any

class MessageReceiver:
    def __call__(self, frames: list[Any]) -> None: ...
