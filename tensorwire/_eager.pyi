"""Stub of the compiled ``_eager`` module (see _eager.pyx)."""

import asyncio
from collections.abc import Coroutine
from typing import Any

def start_eagerly(coro: Coroutine[Any, None, None]) -> asyncio.Future[None] | None: ...
